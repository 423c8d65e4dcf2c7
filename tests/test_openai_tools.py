"""Tool calls and assistant prefill through a real `woq serve` on loopback (SmolLM2 int4), with
the official `openai` client: one server per tool-call format (its chat template from
tests/data/templates, and SmolLM2's own, which knows no tools), calls parsed and checked
against the tools' schemas."""
import json
from pathlib import Path

import pytest

from conftest import LiveServer

pytestmark = pytest.mark.slow
MODEL = "smollm2"
TEMPLATES = Path(__file__).parent / "data" / "templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_weather(call):
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit") and isinstance(args["city"], str)


@pytest.fixture(scope="module", params=["hermes", "llama3_json", "mistral", "own"])
def client(request, smollm2_dir):
    import openai

    template = [] if request.param == "own" else ["--chat-template", str(TEMPLATES / f"{request.param}.jinja")]
    s = LiveServer("--model", str(smollm2_dir), "--served-model-name", MODEL, "--quant", "int4",
                   "--max-seq-len", "1024", "--max-num-seqs", "4", *template)
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
    s.stop()


def test_required_and_named_tool_calls_parse(client):
    from concurrent.futures import ThreadPoolExecutor

    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], parallel_tool_calls=False, max_tokens=80, temperature=0)
    with ThreadPoolExecutor(2) as pool:  # (sent together: a row's tokens do not depend on its batch)
        required, named = pool.map(lambda choice: client.chat.completions.create(**kw, tool_choice=choice),
                                   ["required", {"type": "function", "function": {"name": "get_weather"}}])
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    assert choice.message.tool_calls[0].function.name in ("get_weather", "get_time")
    assert named.choices[0].finish_reason == "tool_calls"
    assert all(c.function.name == "get_weather" for c in named.choices[0].message.tool_calls)
    _check_weather(named.choices[0].message.tool_calls[0])


def test_streamed_tool_call_and_the_answer_to_its_result(client):
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=80, temperature=0, stream=True)
    calls, reasons, text = [], [], ""
    for chunk in stream:
        for ch in chunk.choices:
            calls += ch.delta.tool_calls or []
            text += ch.delta.content or ""
            reasons.append(ch.finish_reason)
    assert reasons[-1] == "tool_calls" and calls and text == ""
    _check_weather(calls[0])
    # the call and its result sent back: the model answers in text
    follow = [*ASK, {"role": "assistant", "tool_calls": [{"id": calls[0].id, "type": "function", "function": {
        "name": calls[0].function.name, "arguments": calls[0].function.arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": '{"temperature": 18, "sky": "clear"}'}]
    r = client.chat.completions.create(model=MODEL, messages=follow, tools=[WEATHER], max_tokens=20, temperature=0)
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")


def test_tool_choice_none_and_refusals(client):
    import openai

    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none",
                                       max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    for kw, param in [(dict(tool_choice="required"), "tool_choice"),
                      (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
                       "tool_choice"),
                      (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, **kw)
        assert e.value.body["param"].startswith(param), (kw, e.value.body)
    # a schema that cannot be enforced is named by its tool, in one line (llguidance's reason)
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "strin"}}}}}
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, tools=[WEATHER, bad],
                                           tool_choice=choice)
        err = e.value.body
        assert err["param"] == "tools[1].function.parameters" and "\n" not in err["message"], err
        assert err["message"].startswith("'tools[1].function.parameters' cannot be enforced") \
            and "strin" in err["message"], err


def test_a_final_assistant_message_is_continued(client, smollm2_dir):
    """The reply continues the assistant's prefix: the same tokens as a completion of the
    template rendered with that message left open."""
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "Name the capital of France."},
                {"role": "assistant", "content": "The capital of France is"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    own = tok.apply_chat_template(messages, continue_final_message=True, add_generation_prompt=False, tokenize=False)
    if own.endswith("The capital of France is"):  # (SmolLM2's own template; the test templates differ)
        c = client.completions.create(model=MODEL, prompt=tok(own)["input_ids"], max_tokens=6, temperature=0)
        assert r.choices[0].message.content == c.choices[0].text
    assert not r.choices[0].message.content.startswith("The capital")  # (continued, not started over)
    assert r.choices[0].message.content.strip()


@pytest.mark.parametrize("client", ["hermes", "own"], indirect=True)  # (the formats SmolLM2 writes 2+ calls in)
def test_calls_cut_off_by_max_tokens_end_by_length_and_keep_their_text(client):
    """Parallel calls cut inside the second by ``max_tokens``: the finish reason is "length"
    (not "tool_calls", which would hide the cut), and the unfinished output comes back whole
    as content: its tokens' bytes (chat logprobs, from the vocabulary) joined, streamed and
    not. (Each format's parser on cut outputs: tests/test_tools.py.)"""
    from concurrent.futures import ThreadPoolExecutor

    two = [{"role": "user", "content": "What is the weather in Paris, and what time is it in Tokyo?"}]
    kw = dict(model=MODEL, messages=two, tools=[WEATHER, TIME], tool_choice="required", temperature=0, max_tokens=45,
              logprobs=True)
    with ThreadPoolExecutor(1) as pool:  # (the whole reply asked beside the stream read below)
        whole = pool.submit(client.chat.completions.create, **kw)
        streamed, reasons = "", []
        for chunk in client.chat.completions.create(**kw, stream=True):
            for ch in chunk.choices:
                assert not ch.delta.tool_calls
                streamed += ch.delta.content or ""
                reasons.append(ch.finish_reason)
        r = whole.result()
    choice = r.choices[0]
    assert r.usage.completion_tokens == 45 and choice.finish_reason == "length"
    text = b"".join(bytes(t.bytes) for t in choice.logprobs.content).decode()
    assert choice.message.tool_calls is None and choice.message.content == text
    call, end = json.JSONDecoder().raw_decode(text, text.index("{"))  # a whole first call, then another begun
    assert call["name"] in ("get_weather", "get_time") and "{" in text[end:], text
    assert not text.rstrip().endswith(("}", ">")), text  # (not cut at a call's end)
    assert streamed == text and reasons[-1] == "length"
