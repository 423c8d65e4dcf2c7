"""A real ``woq serve`` (uvicorn on loopback, real SmolLM2 int4 g128) and a real HTTP client."""
import json
import time

import httpx
import pytest

from conftest import LiveServer, metric_value

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def server(smollm2_dir):
    s = LiveServer("--model", str(smollm2_dir), "--served-model-name", MODEL, "--quant", "int4",
                   "--group-size", "128", "--max-seq-len", "512", "--max-num-seqs", "4", "--kernel-timing-every", "1")
    yield s
    s.stop()


def _chat(content, **kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


def test_chat_answers_paris(server):
    r = httpx.post(server.url + "/v1/chat/completions",
                   json=_chat("What is the capital of France?", temperature=0, max_tokens=32), timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and "Paris" in choice["message"]["content"]
    assert choice["finish_reason"] == "stop"
    u = body["usage"]
    assert u["prompt_tokens"] > 10 and 0 < u["completion_tokens"] <= 32
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


def _sse_lines(resp):
    for line in resp.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: "):]


def test_chat_streaming_matches_non_streaming(server):
    req = _chat("Name three colors.", temperature=0, max_tokens=24)
    whole = httpx.post(server.url + "/v1/chat/completions", json=req, timeout=120).json()
    events = []
    with httpx.stream("POST", server.url + "/v1/chat/completions",
                      json={**req, "stream": True, "stream_options": {"include_usage": True}}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = list(_sse_lines(r))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert len([c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]) > 3
    assert text == whole["choices"][0]["message"]["content"]
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["finish_reason"] for c in finals] == [whole["choices"][0]["finish_reason"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


def test_completions_streaming_and_not(server):
    req = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    r = httpx.post(server.url + "/v1/completions", json=req, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 8
    with httpx.stream("POST", server.url + "/v1/completions", json={**req, "stream": True}, timeout=120) as s:
        events = list(_sse_lines(s))
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == body["choices"][0]["text"]


def test_models_health_metrics(server):
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert (card["id"], card["max_model_len"]) == (MODEL, 512)  # (--max-seq-len: the pool holds more)
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    text = httpx.get(server.url + "/metrics").text
    for name in ("woq_requests_total", "woq_time_to_first_token_seconds_bucket", "woq_inter_token_latency_seconds",
                 "woq_request_latency_seconds", "woq_prompt_tokens_total", "woq_generation_tokens_total",
                 "woq_requests_running", "woq_requests_waiting", "woq_batch_size_bucket"):
        assert name in text, name
    assert 'woq_kernel_latency_seconds_count{bits="4",layer="gate_up",m_bucket="1",path="cpu_reference"}' in text
    assert 'woq_kernel_calls_total{bits="16",layer="lm_head"' in text


def test_generated_tokens_are_counted_as_they_come_and_what_is_served_is_described(server):
    """``woq_generation_tokens_total`` grows while a stream is still running (not only when a
    request ends); ``woq_build_info`` names the model and its quantization; no ``_created``
    series are exported."""
    before = metric_value(httpx.get(server.url + "/metrics").text, "woq_generation_tokens_total")
    req = {"model": MODEL, "prompt": "Count: one, two,", "max_tokens": 128, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=req, timeout=120) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: {")
            if seen == 8:
                break
        mid = metric_value(httpx.get(server.url + "/metrics").text, "woq_generation_tokens_total")
    assert before + 8 <= mid < before + 128
    text = httpx.get(server.url + "/metrics").text
    from prometheus_client.parser import text_string_to_metric_families

    from woq.kernels.build import source_hash

    [info] = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "woq_build_info"]
    assert info.value == 1 and info.labels["quant"].startswith("int4 g128 asym")  # (", rtn": read from the cache)
    assert (info.labels["model"], info.labels["device"], info.labels["kernel_version"]) == (MODEL, "cpu", source_hash())
    assert "_created" not in text


def test_models_through_the_openai_client(server):
    """The official client lists the served model and retrieves it by id, with the same
    stable `created`; an unknown id is its NotFoundError (404, OpenAI's error JSON)."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    listed = client.models.list().data
    assert [m.id for m in listed] == [MODEL]
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object, card.created) == (MODEL, "model", listed[0].created)
    time.sleep(1.1)
    assert client.models.retrieve(MODEL).created == card.created
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-17")
    assert e.value.status_code == 404 and "gpt-17" in str(e.value)


BAD = [
    ("empty messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("max_tokens 0", "/v1/chat/completions", _chat("hi", max_tokens=0), 400, "max_tokens"),
    ("beyond context", "/v1/chat/completions", _chat("hi", max_tokens=100000), 400, "context"),
    ("negative temperature", "/v1/chat/completions", _chat("hi", temperature=-1), 400, "temperature"),
    ("top_p 0", "/v1/chat/completions", _chat("hi", top_p=0), 400, "top_p"),
    ("top_p > 1", "/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("wrong model", "/v1/chat/completions", {**_chat("hi"), "model": "gpt-17"}, 404, "gpt-17"),
    ("missing prompt", "/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("bad role", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "role"),
    ("n > 16", "/v1/completions", {"model": MODEL, "prompt": "x", "n": 17}, 400, "n"),
    ("token id out of range", "/v1/completions", {"model": MODEL, "prompt": [1, 10**9]}, 400, "token"),
]


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_openai_error_json(server, case):
    _, path, body, status, needle = case
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert needle in err["message"] or needle == err["param"]
    assert "Traceback" not in r.text and "/site-packages/" not in r.text


def test_malformed_json_and_unknown_route(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
