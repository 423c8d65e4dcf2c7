"""Every OpenAI parameter works or is refused by name, against a real `woq serve` on loopback
(SmolLM2): a parameter we do not implement is accepted only at the value that asks for
nothing; types are strict; errors speak of the JSON the client sent."""
import httpx
import pytest

from conftest import LiveServer, metric_value

pytestmark = pytest.mark.slow
MODEL = "smollm2"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server


def _chat(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0, **kw}


def _completion(**kw):
    return {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0, **kw}


def _post(server, path, body, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


def _error(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    return err


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}

# (endpoint, parameter, a value asking for something we do not do, its neutral value)
UNSUPPORTED = [
    (CHAT, "functions", [{"name": "f", "parameters": {}}], []),
    (CHAT, "function_call", {"name": "f"}, "none"),
    (CHAT, "modalities", ["text", "audio"], ["text"]),
    (CHAT, "audio", {"voice": "alloy", "format": "wav"}, None),
    (CHAT, "prediction", {"type": "content", "content": "Hello"}, None),
    (CHAT, "reasoning_effort", "high", "none"),
    (CHAT, "verbosity", "low", None),
    (CHAT, "web_search_options", {}, None),
    (COMPLETIONS, "best_of", 2, 1),
    (COMPLETIONS, "suffix", " and so on.", ""),
    # vLLM's extensions, as its clients send them
    (CHAT, "skip_special_tokens", False, True),
    (CHAT, "spaces_between_special_tokens", False, True),
    (CHAT, "use_beam_search", True, False),
    (CHAT, "length_penalty", 0.5, 1.0),
    (CHAT, "priority", 1, 0),
    (CHAT, "truncate_prompt_tokens", 8, None),
    (CHAT, "echo", True, False),
    (COMPLETIONS, "skip_special_tokens", False, True),
]


@pytest.mark.parametrize("case", UNSUPPORTED, ids=[f"{c[0].split('/')[-1]}-{c[1]}-{i}"
                                                   for i, c in enumerate(UNSUPPORTED)])
def test_unsupported_parameter_is_refused_by_name_unless_neutral(server, case):
    path, param, value, neutral = case
    body = _chat if path == CHAT else _completion
    err = _error(_post(server, path, body(**{param: value})))
    assert err["param"] == param and err["code"] == "unsupported_parameter"
    assert err["message"].startswith(f"'{param}' is not supported by this server")
    r = _post(server, path, body(**{param: neutral}))
    assert r.status_code == 200, r.text


def test_nested_unsupported_parameters_are_named_by_their_path(server):
    cases = [
        (_chat(stream=True, stream_options={"include_obfuscation": True}), "stream_options.include_obfuscation",
         "unsupported_parameter"),
        (_chat(stream=True, stream_options={"continuous_usage_stats": True}), "stream_options.continuous_usage_stats",
         "unsupported_parameter"),
        (_chat(messages=[{"role": "user", "content": "Hi", "name": "bob"}]), "messages[0].name",
         "unsupported_parameter"),
        (_chat(messages=[{"role": "function", "content": "42", "name": "f"}]), "messages[0].role",
         "unsupported_value"),
        (_chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
         "messages[0].content[0].type", "unsupported_value"),
        (_completion(prompt=["one"] * 17), "prompt", None),
    ]
    for body, param, code in cases:
        err = _error(_post(server, CHAT if "messages" in body else COMPLETIONS, body))
        assert (err["param"], err["code"]) == (param, code), err
        assert err["message"].startswith(f"'{param}' ") and "this server" in err["message"], err


def test_what_real_clients_send_by_default_is_accepted(server):
    """Every unsupported parameter at its neutral value (or null), the informational ones set,
    text parts, an assistant turn with a null refusal: one 200 each."""
    neutral = {c[1]: c[3] for c in UNSUPPORTED if c[0] == CHAT}
    informational = {"user": "u-1", "metadata": {"k": "v"}, "store": True, "service_tier": "auto",
                     "safety_identifier": "s-1", "prompt_cache_key": "k", "prompt_cache_retention": "24h",
                     "parallel_tool_calls": True}
    messages = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": "Hi", "name": ""},
                {"role": "assistant", "content": "Hello", "refusal": None, "tool_calls": []},
                {"role": "user", "content": "Again"}]
    r = _post(server, CHAT, _chat(messages=messages, **neutral, **informational,
                                  stream_options={"include_usage": False, "include_obfuscation": False,
                                                  "continuous_usage_stats": False}))
    assert r.status_code == 200, r.text
    nulls = {c[1]: None for c in UNSUPPORTED if c[0] == CHAT} | {"temperature": None, "top_p": None, "stop": None}
    assert _post(server, CHAT, _chat(**nulls)).status_code == 200  # (null asks for the default)
    r = _post(server, COMPLETIONS, _completion(**{c[1]: c[3] for c in UNSUPPORTED if c[0] == COMPLETIONS},
                                               echo=False, user="u-1"))
    assert r.status_code == 200, r.text


def test_unknown_fields_are_refused_by_name(server):
    for path, body, param in [
        (CHAT, _chat(frobnicate=1), "frobnicate"),
        (COMPLETIONS, _completion(max_new_tokens=4), "max_new_tokens"),
        (CHAT, _chat(messages=[{"role": "user", "content": "Hi", "mood": "happy"}]), "messages[0].mood"),
        (CHAT, _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "Hi", "lang": "en"}]}]),
         "messages[0].content[0].lang"),
        (CHAT, _chat(stream_options={"include_usage": True, "every": 2}), "stream_options.every"),
    ]:
        err = _error(_post(server, path, body))
        assert (err["param"], err["code"]) == (param, "unknown_parameter"), err
        assert "is not a parameter of this API" in err["message"]


COERCIONS = [
    (CHAT, "max_tokens", "5", "an integer"),
    (CHAT, "max_tokens", True, "an integer"),
    (CHAT, "max_tokens", 2.0, "an integer"),
    (CHAT, "max_completion_tokens", "2", "an integer"),
    (CHAT, "temperature", "0.5", "a number"),
    (CHAT, "temperature", False, "a number"),
    (CHAT, "top_p", "1", "a number"),
    (CHAT, "stream", "true", "true or false"),
    (CHAT, "stream", 1, "true or false"),
    (CHAT, "seed", "7", "an integer"),
    (CHAT, "n", "1", "an integer"),
    (COMPLETIONS, "top_k", "3", "an integer"),
    (COMPLETIONS, "ignore_eos", "yes", "true or false"),
    (COMPLETIONS, "echo", 1, "true or false"),
    (COMPLETIONS, "model", 7, "a string"),
]


@pytest.mark.parametrize("case", COERCIONS, ids=[f"{c[1]}={c[2]!r}" for c in COERCIONS])
def test_no_type_coercion(server, case):
    path, param, value, expected = case
    err = _error(_post(server, path, (_chat if path == CHAT else _completion)(**{param: value})))
    assert err["param"] == param and f"must be {expected}" in err["message"], err


def test_an_integer_is_a_number(server):
    assert _post(server, CHAT, _chat(temperature=1, top_p=1, seed=3)).status_code == 200


def test_top_k_minus_one_is_off_as_in_vllm_and_sglang(server):
    """vLLM's and SGLang's clients send ``top_k: -1`` for no top-k: the tokens of ``top_k: 0``
    (seeded sampling over the whole vocabulary), and unlike ``top_k: 1`` (greedy); so is a
    top-k of the whole vocabulary or more, however large (past 64 bits it had been a 500);
    below -1 is refused by name."""
    def text(**kw):
        r = _post(server, COMPLETIONS, _completion(max_tokens=12, temperature=1.5, seed=5, **kw))
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    vocab = 49152  # (SmolLM2's)
    assert text(top_k=-1) == text(top_k=0) == text(top_k=vocab) == text(top_k=10 ** 30) != text(top_k=1)
    assert text(top_k=vocab - 1) != text(top_k=1)
    err = _error(_post(server, COMPLETIONS, _completion(top_k=-2)))
    assert err["param"] == "top_k" and "must be >= -1" in err["message"]


def test_prompt_token_ids_outside_the_vocabulary_are_refused(server):
    """Token-id prompts: the last id of the vocabulary is served; one past it, a negative
    one and one past 64 bits are refused by name (400), never a 500."""
    vocab = 49152  # (SmolLM2's tokenizer and embedding)
    assert _post(server, COMPLETIONS, _completion(prompt=[[1, vocab - 1]])).status_code == 200
    for ids in ([1, vocab], [-1], [10 ** 30]):
        err = _error(_post(server, COMPLETIONS, _completion(prompt=[ids])))
        assert err["param"] == "prompt" and f"[0, {vocab})" in err["message"], (ids, err)


PYDANTIC_WORDS = ("Input should", "list[", "TextPart", "function-", "str]", ".str", "dictionary", "Field required")


def test_union_fields_are_named_as_the_client_wrote_them(server):
    cases = [
        (CHAT, _chat(messages=[{"role": "user", "content": 5}]), "messages[0].content",
         "must be a string or an array of text parts"),
        (CHAT, _chat(messages=[{"role": "user", "content": ["Hi"]}]), "messages[0].content[0]",
         "must be an object, not a string"),
        (CHAT, _chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages[0].content[0].text",
         "is required"),
        (CHAT, _chat(stop=5), "stop", "must be a string or an array of up to 4 strings"),
        (CHAT, _chat(stop=["a", 1]), "stop[1]", "must be a string, not an integer"),
        (CHAT, _chat(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4"),
        (CHAT, _chat(stop=""), "stop[0]", "must not be empty"),
        (COMPLETIONS, _completion(prompt={"text": "Hi"}), "prompt",
         "must be a string or an array of token ids (integers)"),
        (COMPLETIONS, _completion(prompt=[1, True]), "prompt", "array of token ids (integers)"),
        (COMPLETIONS, _completion(prompt=""), "prompt", "must not be empty"),
        (CHAT, {"model": MODEL}, "messages", "is required"),
        # a field that a rule across fields asks for is named, not the object holding it
        (CHAT, _chat(messages=[{"role": "user", "content": "Hi"}, {"role": "tool", "content": "42"}]),
         "messages[1].tool_call_id", "is required"),
        (CHAT, _chat(messages=[{"role": "user", "content": []}]), "messages[0].content", "is required"),
        (CHAT, _chat(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant"}]), "messages[1].content",
         "is required (or 'tool_calls')"),
        (CHAT, _chat(response_format={"type": "regex"}), "response_format.regex", "is required (by type 'regex')"),
        (CHAT, _chat(top_logprobs=3), "top_logprobs", "needs 'logprobs': true"),
        (CHAT, _chat(messages=[{"role": "user", "content": "Hi", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]),
         "messages[0].tool_calls", "is only for assistant messages, not 'user' ones"),
    ]
    for path, body, param, needle in cases:
        err = _error(_post(server, path, body))
        assert err["param"] == param and err["message"].startswith(f"'{param}' ") and needle in err["message"], err
        assert not any(w in err["message"] for w in PYDANTIC_WORDS), err


def test_a_body_that_is_no_json_object(server):
    url = server.url + COMPLETIONS
    for content, ctype, needle in [
        (b"", "application/json", "the request body is empty; it must be a JSON object"),
        (b"", None, "the request body is empty; it must be a JSON object"),
        (b"[1, 2]", "application/json", "the request body must be a JSON object, not an array"),
        (b'"Hi"', "application/json", "the request body must be a JSON object, not a string"),
        (b"prompt=Hi&max_tokens=1", "application/x-www-form-urlencoded", "'Content-Type: application/json'"),
        (b'{"prompt": "Hi", "max_tokens": 1}', "text/plain", "'Content-Type: application/json'"),
        (b'{"prompt": "Hi", "max_tokens": 1}', None, "'Content-Type: application/json'"),
        (b'{"prompt": "Hi",}', "application/json", "not valid JSON"),
        (b'{"prompt": "Hi \xff", "max_tokens": 1}', "application/json",
         "the request body is not valid UTF-8 (byte 0xff at offset 15)"),
    ]:
        r = httpx.post(url, content=content, headers={"content-type": ctype} if ctype else {}, timeout=60)
        err = _error(r)
        assert needle in err["message"] and err["param"] is None, (content, ctype, err)
        assert "None" not in err["message"]
    # the same body as JSON is served
    assert httpx.post(url, content=b'{"prompt": "Hi", "max_tokens": 1}',
                      headers={"content-type": "application/json; charset=utf-8"}, timeout=60).status_code == 200


def test_echo_of_token_ids_gives_the_prompt_as_text(server, smollm2_dir):
    from transformers import AutoTokenizer

    text = "The capital of France is"
    ids = AutoTokenizer.from_pretrained(smollm2_dir).encode(text)
    by_text = _post(server, COMPLETIONS, _completion(prompt=text, echo=True, max_tokens=2)).json()
    by_ids = _post(server, COMPLETIONS, _completion(prompt=ids, echo=True, max_tokens=2)).json()
    assert by_text["choices"][0]["text"].startswith(text) and len(by_text["choices"][0]["text"]) > len(text)
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]


def test_a_too_long_prompt_names_prompt_or_messages(server):
    err = _error(_post(server, COMPLETIONS, _completion(prompt=[42] * 1100)))
    assert (err["param"], err["code"]) == ("prompt", "context_length_exceeded")
    err = _error(_post(server, CHAT, _chat(messages=[{"role": "user", "content": "Hi " * 1100}])))
    assert (err["param"], err["code"]) == ("messages", "context_length_exceeded")


@pytest.fixture(scope="module")
def small_pool(smollm2_dir):
    """A KV pool of a few blocks (on the CPU: --kv-cache-gib), far below --max-seq-len."""
    s = LiveServer("--model", str(smollm2_dir), "--served-model-name", MODEL, "--quant", "int4",
                   "--max-seq-len", "512", "--max-num-seqs", "2", "--kv-cache-gib", "0.003")
    yield s
    s.stop()


def test_a_pool_below_the_context_bounds_requests_by_its_positions(small_pool):
    """Where the KV pool holds fewer positions than one --max-seq-len sequence, the model's
    card says so, a request without max_tokens is served up to the pool's positions (not
    refused for a budget it did not ask for), and one that asks for more is refused by
    naming max_tokens."""
    metrics = httpx.get(small_pool.url + "/metrics").text
    positions = int(metric_value(metrics, "woq_kv_cache_blocks") * metric_value(metrics, "woq_kv_cache_block_size"))
    assert 0 < positions < 512
    assert httpx.get(small_pool.url + f"/v1/models/{MODEL}").json()["max_model_len"] == positions
    r = _post(small_pool, CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0,
                                 "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == positions
    err = _error(_post(small_pool, CHAT, _chat(max_tokens=positions)))
    assert (err["param"], err["code"]) == ("max_tokens", "context_length_exceeded")
    assert f"the KV cache's {positions} positions" in err["message"]
    err = _error(_post(small_pool, COMPLETIONS, _completion(prompt=[42] * positions)))
    assert (err["param"], err["code"]) == ("prompt", "context_length_exceeded")


def test_the_openai_client(server):
    """The official client sends no field it was not given: its plain calls are served; a
    refused parameter is its BadRequestError, naming the parameter."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    # (sampled at the default temperature: any text, even a special token's empty one)
    assert isinstance(chat.choices[0].message.content, str) and 1 <= chat.usage.completion_tokens <= 2
    assert chat.choices[0].finish_reason in ("stop", "length")
    follow_up = [*messages, chat.choices[0].message, {"role": "user", "content": "More"}]
    assert client.chat.completions.create(model=MODEL, messages=follow_up, max_completion_tokens=1,
                                          presence_penalty=0, frequency_penalty=0, logprobs=False, n=1,
                                          user="u", metadata={"a": "b"}, store=False).choices
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True})
    assert [c for c in stream][-1].usage.completion_tokens <= 2
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=1).choices[0].text is not None

    for call, param in [
        (lambda: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                                functions=[{"name": "f", "parameters": {}}]), "functions"),
        (lambda: client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, best_of=2), "best_of"),
        (lambda: client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, extra_body={"min_q": 1}), "min_q"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.status_code == 400 and e.value.param == param and param in str(e.value)


def test_openapi_declares_400_not_422(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    ref = "#/components/schemas/ErrorResponse"
    for path in (CHAT, COMPLETIONS):
        responses = doc["paths"][path]["post"]["responses"]
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"] == ref
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert doc["components"]["schemas"][body.split("/")[-1]]["additionalProperties"] is False
    assert not [(p, m) for p, ops in doc["paths"].items() for m, op in ops.items() if "422" in op["responses"]]
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    error = doc["components"]["schemas"]["ErrorDetail"]
    assert set(error["properties"]) == {"message", "type", "param", "code"}
    # the documented parameters are the accepted ones: no unsupported one is advertised
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"messages", "max_completion_tokens", "top_k", "ignore_eos", "user", "logprobs", "top_logprobs", "n",
            "presence_penalty", "frequency_penalty", "logit_bias", "response_format"} <= set(chat)
    assert {"tools", "tool_choice", "parallel_tool_calls"} <= set(chat)
    assert not {"functions", "function_call", "audio"} & set(chat)
