"""Log-probabilities, n, penalties, logit bias and response_format through a real `woq serve`
on loopback (SmolLM2 int4), driven by the official `openai` client; log-probabilities
checked against the same model run in this process (fp64 log-softmax)."""
import json

import pytest
import torch

pytestmark = pytest.mark.slow
MODEL = "smollm2"


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_completion_logprobs_are_the_models(client, smollm2_int4):
    lm = smollm2_int4
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=4, echo=True)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert lp.text_offset[0] == len(prompt)
    ids = lm.tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        want = torch.log_softmax(lm.model(torch.tensor([ids]), last_only=True)[0].double(), -1)
    top = want.topk(4)
    assert abs(lp.token_logprobs[0] - top.values[0].item()) < 2e-3  # (greedy: the most likely token)
    assert list(lp.top_logprobs[0].values()) == pytest.approx(top.values.tolist(), abs=2e-3)
    assert list(lp.top_logprobs[0]) == [lm.tokenizer.decode([t]) for t in top.indices.tolist()]


def test_chat_logprobs_streaming_and_not(client):
    messages = [{"role": "user", "content": "Name a fruit."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens or r.choices[0].finish_reason == "stop"
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.logprob == pytest.approx(c.top_logprobs[0].logprob)  # (greedy)
        assert bytes(c.bytes).decode() == c.token
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True)
    streamed = [c for chunk in stream for ch in chunk.choices if ch.logprobs for c in ch.logprobs.content]
    assert [(c.token, round(c.logprob, 4)) for c in streamed] == [(c.token, round(c.logprob, 4)) for c in content]


def test_n_choices_each_equal_their_own_seeded_request(client):
    messages = [{"role": "user", "content": "Write a word."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=1.0, seed=11, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1  # (sampled choices differ)
    for i, c in enumerate(r.choices):
        alone = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=1.0,
                                               seed=11 + i)
        assert c.message.content == alone.choices[0].message.content, i
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=1.0, seed=11,
                                            n=3, stream=True, stream_options={"include_usage": True})
    texts, reasons, usage = ["", "", ""], [None] * 3, None
    for chunk in stream:
        usage = chunk.usage or usage
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            reasons[ch.index] = ch.finish_reason or reasons[ch.index]
    assert texts == [c.message.content for c in r.choices] and None not in reasons
    assert usage.completion_tokens == r.usage.completion_tokens


def test_min_p_draws_only_tokens_near_the_most_likely(client):
    """Every token drawn under min_p is at least min_p times as likely as the most likely one, by
    the model's own log-probabilities (returned beside it; temperature 1: the same distribution);
    the same seeds without min_p draw tokens below that bar; min_p = 1 is the greedy reply."""
    import math

    messages = [{"role": "user", "content": "Tell me a story about a dragon."}]

    def draws(**kw):
        gaps = []  # (the drawn token's log-probability) - (the most likely one's)
        for c in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=1.0,
                                                seed=5, n=6, logprobs=True, top_logprobs=1, **kw).choices:
            gaps += [t.logprob - t.top_logprobs[0].logprob for t in c.logprobs.content]
        return gaps

    bar = math.log(0.2)
    assert min(draws(extra_body={"min_p": 0.2})) >= bar - 1e-3
    assert min(draws()) < bar  # (the check above can fail)
    greedy = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    top_only = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=1.0,
                                              seed=3, extra_body={"min_p": 1.0})
    assert top_only.choices[0].message.content == greedy.choices[0].message.content


def test_include_stop_str_in_output_keeps_the_stop_string(client):
    """vLLM's extension: the reply ends with the stop string rather than before it, streamed
    or not; the text before it is the reply without the option's."""
    prompt, kw = "The capital of France is", dict(model=MODEL, max_tokens=24, temperature=0)
    full = client.completions.create(prompt=prompt, **kw).choices[0].text
    stop = full.split()[2]  # (a word well inside the greedy reply)
    cut = client.completions.create(prompt=prompt, stop=stop, **kw).choices[0]
    kept = client.completions.create(prompt=prompt, stop=stop, extra_body={"include_stop_str_in_output": True},
                                     **kw).choices[0]
    assert cut.finish_reason == kept.finish_reason == "stop"
    assert kept.text == cut.text + stop and full.startswith(kept.text)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        prompt=prompt, stop=stop, stream=True, extra_body={"include_stop_str_in_output": True}, **kw))
    assert streamed == kept.text


def test_logit_bias_bans_and_forces_tokens(client, smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    (paris,) = tok.encode(" Paris")
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=0)
    assert plain.choices[0].logprobs.tokens[0] == " Paris"  # (the greedy next token)
    banned = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=0,
                                       logit_bias={str(paris): -100})
    assert " Paris" not in banned.choices[0].logprobs.tokens
    forced = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=0,
                                       logit_bias={"1002": 100})
    assert forced.choices[0].logprobs.tokens == [tok.decode([1002])] * 4


def test_tokens_inside_a_character_have_its_bytes(client, smollm2_dir):
    """An emoji is three byte-level tokens: each one alone (forced by logit bias) is served as
    the tokenizer decodes it, U+FFFD, never an empty text; its ``bytes`` are its own, and the
    three tokens' bytes join into the emoji's UTF-8."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(smollm2_dir)).encode("👋")
    assert len(ids) > 1
    messages = [{"role": "user", "content": "Wave."}]
    joined = b""
    for t in ids:
        kw = dict(model=MODEL, messages=messages, max_tokens=1, temperature=0, logit_bias={str(t): 100})
        r = client.chat.completions.create(**kw, logprobs=True)
        (lp,) = r.choices[0].logprobs.content
        assert r.choices[0].message.content == lp.token == "\ufffd"
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                           if c.choices)
        assert streamed == r.choices[0].message.content
        joined += bytes(lp.bytes)
    assert joined == "👋".encode()


def test_text_offsets_of_split_characters_are_where_they_begin(client):
    """Greedy Japanese after a Japanese prompt: several tokens are pieces of one character.
    Each token's ``text_offset`` is where its character begins in the text, the same
    whether the choice is streamed (offsets from the text sent before each token) or not."""
    kw = dict(model=MODEL, prompt="日本語で「こんにちは」は", max_tokens=8, temperature=0, logprobs=0)
    choice = client.completions.create(**kw).choices[0]
    text, lp = choice.text, choice.logprobs
    pieces = [i for i, t in enumerate(lp.tokens) if t == "\ufffd"]
    assert pieces, lp.tokens  # (the case under test occurs)
    streamed = [(t, o) for c in client.completions.create(**kw, stream=True)
                for ch in c.choices if ch.logprobs for t, o in zip(ch.logprobs.tokens, ch.logprobs.text_offset)]
    assert streamed == list(zip(lp.tokens, lp.text_offset))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text)
    for i in pieces:  # a piece begins at a character that is not ASCII
        assert ord(text[lp.text_offset[i]]) > 127


def test_penalties_cut_repetition(client):
    from collections import Counter
    from concurrent.futures import ThreadPoolExecutor

    def most_repeated(text: str, **kw) -> int:
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=40,
                                           temperature=0, logprobs=True, **kw)
        return max(Counter(c.token for c in r.choices[0].logprobs.content).values())

    echo = "Repeat after me: " + "hello " * 10
    count = "Count from 1 to 30."
    asks = [(echo, {}), (echo, dict(frequency_penalty=1.5)), (echo, dict(extra_body={"repetition_penalty": 2.0})),
            (count, dict(presence_penalty=2.0)), (count, {})]
    with ThreadPoolExecutor(len(asks)) as pool:  # (sent together: a row's tokens do not depend on its batch)
        plain, frequency, repetition, presence, counted = pool.map(lambda a: most_repeated(a[0], **a[1]), asks)
    assert plain >= 20  # (the prompt makes the model repeat)
    assert frequency < plain / 4
    assert repetition < plain / 4
    # a presence penalty takes a constant off every token seen: less than a frequency penalty's pull
    assert presence < counted


def test_out_of_range_sampling_parameters_are_refused(client):
    import openai

    messages = [{"role": "user", "content": "Say yes."}]
    # ("²" is a digit to str.isdigit, not to int(): it had been a 500)
    for kw, param in [(dict(logit_bias={"abc": 1}), "logit_bias"), (dict(logit_bias={"10": 101}), "logit_bias"),
                      (dict(logit_bias={"²": 1}), "logit_bias"),
                      (dict(n=17), "n"), (dict(top_logprobs=21, logprobs=True), "top_logprobs"),
                      (dict(frequency_penalty=2.5), "frequency_penalty"),
                      (dict(response_format={"type": "json_schema"}), "response_format")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, **kw)
        assert e.value.body["param"].split(".")[0] == param, (kw, e.value.body)
    # a schema that llguidance cannot enforce is named, with its reason
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/nope"}}})
    assert e.value.body["param"] == "response_format.json_schema.schema", e.value.body
    assert "'/$defs/nope' does not exist" in e.value.body["message"], e.value.body
    # a regex, with its parser's reason alone (not the grammar that wraps it)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                       response_format={"type": "regex", "regex": "(?<=a)b"})
    assert e.value.body["param"] == "response_format.regex", e.value.body
    assert e.value.body["message"] == "'response_format.regex' cannot be enforced as a regex: look-around, " \
        "including look-ahead and look-behind, is not supported", e.value.body


def test_response_format_json_schema_and_json_object(client):
    from concurrent.futures import ThreadPoolExecutor

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
              "required": ["city", "population"], "additionalProperties": False}
    asks = [("A big city, as JSON.", {"type": "json_schema",
                                      "json_schema": {"name": "city", "schema": schema, "strict": True}}),
            ("JSON with a name.", {"type": "json_object"})]
    with ThreadPoolExecutor(2) as pool:  # (sent together: a row's tokens do not depend on its batch)
        city, r = pool.map(lambda a: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": a[0]}], max_tokens=60, temperature=0,
            response_format=a[1]), asks)
    value = json.loads(city.choices[0].message.content)
    assert city.choices[0].finish_reason == "stop"  # (the grammar ended it)
    assert set(value) == {"city", "population"} and 0 <= value["population"] <= 99999999
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")


def test_json_schema_outputs_validate_over_50_prompts(client):
    """Every one of 50 replies under a strict JSON schema parses and matches it (checked here
    field by field, not by the grammar engine)."""
    from concurrent.futures import ThreadPoolExecutor

    schema = {"type": "object", "additionalProperties": False, "required": ["title", "year", "genres", "rating"],
              "properties": {"title": {"type": "string", "minLength": 1, "maxLength": 40},
                             "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                             "genres": {"type": "array", "items": {"type": "string", "enum": ["drama", "comedy",
                                                                                               "action", "horror"]},
                                        "minItems": 1, "maxItems": 3},
                             "rating": {"type": "integer", "minimum": 0, "maximum": 10}}}
    topics = ["space", "love", "a dog", "the sea", "war", "a robot", "music", "a city", "winter", "a detective"]
    prompts = [f"Invent a film about {t}, as JSON{'!' * (i // 10)}" for i, t in enumerate(topics * 5)]

    def ask(i_prompt):
        i, prompt = i_prompt
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=120, temperature=0.7, seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": "film", "schema": schema, "strict": True}})

    with ThreadPoolExecutor(16) as pool:  # (the server's 16 sequences)
        replies = list(pool.map(ask, enumerate(prompts)))
    for r in replies:
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        v = json.loads(r.choices[0].message.content)
        assert set(v) == {"title", "year", "genres", "rating"}
        assert isinstance(v["title"], str) and 1 <= len(v["title"]) <= 40
        assert type(v["year"]) is int and 1900 <= v["year"] <= 2030
        assert 1 <= len(v["genres"]) <= 3 and set(v["genres"]) <= {"drama", "comedy", "action", "horror"}
        assert type(v["rating"]) is int and 0 <= v["rating"] <= 10


def test_several_prompts_give_each_their_choices(client, smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    prompts = ["The capital of France is", "1, 2, 3,", tok("Once upon a time")["input_ids"]]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=5, temperature=0, echo=True)
    assert [c.index for c in r.choices] == list(range(6))
    for k, p in enumerate(prompts):
        alone = client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0, echo=True)
        assert r.choices[2 * k].text == r.choices[2 * k + 1].text == alone.choices[0].text, k
    assert r.usage.prompt_tokens == sum(len(tok(p)["input_ids"]) if isinstance(p, str) else len(p) for p in prompts)
    stream = client.completions.create(model=MODEL, prompt=prompts[:2], max_tokens=5, temperature=0, stream=True)
    texts = ["", ""]
    for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] += ch.text
    assert texts == [r.choices[0].text.removeprefix(prompts[0]), r.choices[2].text.removeprefix(prompts[1])]


def test_a_stream_sends_a_chunk_per_token_held_back_text_included(client):
    """Every generated token arrives in a chunk of its own: one whose text the possible
    start of a stop string holds back (" the" before " the qqqq") comes with empty text,
    and the next chunk carries it. The count is the usage's completion tokens, and the
    texts join to the non-streamed completion's."""
    kw = dict(model=MODEL, prompt="The history of the city of Paris", max_tokens=32, temperature=0,
              stop=[" the qqqq"], extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    stream = client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    texts, usage = [], None
    for chunk in stream:
        texts += [ch.text for ch in chunk.choices]
        usage = chunk.usage or usage
    assert len(texts) == usage.completion_tokens == whole.usage.completion_tokens == 32
    assert "".join(texts) == whole.choices[0].text
    assert "" in texts[:-1] and " the" in whole.choices[0].text  # (a token was held back)
