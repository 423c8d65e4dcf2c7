"""Tool-call formats (service/tools.py): parsing each format's calls, the constrained
grammar accepting exactly a call (checked by llguidance consuming real tokenizations), and
the stream holding back an output that starts as a call."""
import json

import pytest

from woq.service.tools import FORMATS, ToolStream, detect

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}

CALLS = {
    "hermes": 'I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                   '{"name": "get_time", "parameters": {"zone": "CET"}}',
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
               '{"name": "get_time", "arguments": {"zone": "CET"}}]',
}


@pytest.mark.parametrize("name", list(CALLS))
def test_each_format_parses_its_calls(name):
    content, calls = FORMATS[name].parse(CALLS[name])
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("get_time", {"zone": "CET"})]
    assert content == ("I will check." if name == "hermes" else None)
    plain = "The weather in Paris is mild."
    assert FORMATS[name].parse(plain) == (plain, [])


def test_formats_are_read_from_templates():
    assert detect("{{ '[TOOL_CALLS]' }} {% if tools %}")[0].name == "mistral"
    assert detect("<|python_tag|>{% for t in tools %}")[0].name == "llama3_json"
    assert detect("{% if tools %}<tool_call>")[0].name == "hermes"
    assert detect("{{ message['content'] }}") == (FORMATS["hermes"], False)  # (no tools: the fallback)


@pytest.fixture(scope="module")
def ll_tokenizer(smollm2_dir):
    import llguidance.hf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    return tok, llguidance.hf.from_tokenizer(tok)


def _accepts(ll_tokenizer, grammar: str, text: str) -> bool:
    import llguidance

    tok, llt = ll_tokenizer
    m = llguidance.LLMatcher(llt, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    return all(m.consume_token(t) for t in tok.encode(text)) and m.is_accepting()


@pytest.mark.parametrize("name", list(CALLS))
def test_the_grammar_takes_a_call_and_nothing_else(ll_tokenizer, name):
    from woq.engine.grammar import lark_grammar

    fmt = FORMATS[name]
    one = lark_grammar(fmt.grammar([WEATHER, TIME], parallel=False, marker_token=None))
    many = lark_grammar(fmt.grammar([WEATHER, TIME], parallel=True, marker_token=None))
    named = lark_grammar(fmt.grammar([TIME], parallel=False, marker_token=None))
    key = fmt.args_key
    call = {"hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
            "llama3_json": '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
            "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]'}[name]
    assert _accepts(ll_tokenizer, one, call)
    assert not _accepts(ll_tokenizer, named, call)  # (a named choice takes only its function)
    assert not _accepts(ll_tokenizer, one, call.replace('"Oslo"', "5"))  # (the parameters' schema)
    assert not _accepts(ll_tokenizer, one, call.replace(f'"{key}"', '"args"'))
    assert not _accepts(ll_tokenizer, one, "Sure! " + call)
    two = CALLS[name].removeprefix("I will check.\n").removeprefix("<|python_tag|>")
    assert _accepts(ll_tokenizer, many, two) and not _accepts(ll_tokenizer, one, two)


def test_stream_holds_back_a_call_and_passes_text():
    fmt = FORMATS["hermes"]
    s = ToolStream(fmt)
    assert s.feed("<tool") == "" and s.feed('_call>\n{"name": "get_weather", ') == ""
    assert s.feed('"arguments": {"city": "Rome"}}\n</tool_call>') == ""
    rest, calls = s.finish()
    assert rest == "" and [c.name for c in calls] == ["get_weather"]
    s = ToolStream(fmt)
    assert s.feed("<t") == "" and s.feed("oday it rains") == "<today it rains" and s.feed(" a lot") == " a lot"
    assert s.finish() == ("", [])
    s = ToolStream(FORMATS["llama3_json"])
    assert s.feed(" {\"name\": 1}") == ""
    assert s.finish() == (" {\"name\": 1}", [])  # (JSON that is no call: the text after all)


@pytest.mark.parametrize("name", list(CALLS))
def test_an_output_with_a_call_that_does_not_parse_is_all_content(name):
    """All or nothing: cut inside the second call (as by ``max_tokens``), or with a call that
    is not one, the output is returned whole as content, with no calls."""
    text = CALLS[name]
    cut = text[: text.index("get_time") + 4]
    assert FORMATS[name].parse(cut) == (cut, [])
    broken = text.replace('"get_time"', "get_time")  # (the second call's JSON no longer parses)
    assert FORMATS[name].parse(broken) == (broken, [])
    nameless = text.replace('"name": "get_time"', '"tool": "get_time"')  # (JSON, but not a call)
    assert FORMATS[name].parse(nameless) == (nameless, [])
