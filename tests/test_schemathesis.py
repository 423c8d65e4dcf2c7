"""Schemathesis over the live OpenAPI document: property-based requests to every operation of
a real `woq serve` (SmolLM2 on CPU, loopback), bounded so that CI runs it in well under three
minutes. Every response must be no 5xx, carry a status code that its operation lists by number
(FastAPI's undeclared 422 would be the classic one: this server sends 400), and match the
documented content type and schema.

Each operation gets its own test, driven by ``APIOperation.as_strategy`` under ``@given``
(valid and invalid requests alike) with a fixed number of derandomized examples. (Not
``schemathesis.pytest.from_fixture``: its lazy schema sets ``Node._nodeid``, which pytest 9.2
no longer has.)"""
from __future__ import annotations

import pytest

from conftest import LiveServer

schemathesis = pytest.importorskip("schemathesis", reason="needs schemathesis (pip install -e '.[dev]')")
from hypothesis import HealthCheck, given, settings  # noqa: E402  (a dependency of schemathesis)
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

pytestmark = pytest.mark.slow
MODEL = "smollm2"
MAX_EXAMPLES = 100  # per operation
TIMEOUT = 30  # seconds, per request: a hung request fails the test rather than the CI job
# Generation is the expensive part on 2 CPU cores: a request may ask for a few tokens of a few
# choices, never for what --max-seq-len 256 allows (the length checks are tested elsewhere).
MAX_TOKENS, MAX_N = 4, 2

# Every operation of the document (test_every_operation_is_tested keeps this list complete)
OPERATIONS = [("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"), ("GET", "/v1/models/{model_id}"),
              ("POST", "/v1/chat/completions"), ("POST", "/v1/completions")]

@pytest.fixture(scope="module")
def server(smollm2_dir):
    s = LiveServer("--model", str(smollm2_dir), "--served-model-name", MODEL, "--quant", "int4",
                   "--max-seq-len", "256", "--max-num-seqs", "4", "--request-timeout", str(TIMEOUT - 5))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def api(server):
    # (unsanitized: a failure's reproducing request shows max_tokens, a "secret" to the default)
    config = schemathesis.Config.from_dict({"request-timeout": TIMEOUT, "output": {"sanitization": {"enabled": False}}})
    return schemathesis.openapi.from_url(server.url + "/openapi.json", config=config, timeout=TIMEOUT)


def status_code_listed(ctx, response, case) -> None:
    """Stricter than ``status_code_conformance``, which the "default" response of the /v1
    operations satisfies whatever the code: a 4xx must be listed by its number."""
    listed = set(case.operation.definition.raw.get("responses", {}))
    if response.status_code < 500 and str(response.status_code) not in listed:
        raise AssertionError(f"{case.operation.label} answered {response.status_code}, which its responses do not "
                             f"list (only {sorted(listed)}): {response.text[:300]}")


CHECKS = [not_a_server_error, status_code_conformance, status_code_listed, content_type_conformance,
          response_schema_conformance]


def _bounded(case) -> None:
    """Cap what a generated body may ask the model to generate (and name the served model, so
    that most requests reach generation rather than a 404). Only values the schema accepts
    are changed, into values it accepts: an invalid request stays invalid."""
    body = case.body
    if not isinstance(body, dict) or case.operation.method.upper() != "POST":
        return
    if isinstance(body.get("model"), str):
        body["model"] = MODEL
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        if type(body.get(key)) is int and body[key] > MAX_TOKENS:
            body[key] = MAX_TOKENS
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS  # (unset: the whole context)
    if type(body.get("n")) is int and MAX_N < body["n"] <= 16:
        body["n"] = MAX_N


def _with_a_valid_prompt(case):
    """The same valid request with a prompt the server takes: most generated messages break a
    rule the schema cannot say (a tool message needs 'tool_call_id', ...), so that without
    this the sampling parameters would seldom reach the engine."""
    if isinstance(case.body, dict):
        if "messages" in case.body:
            case.body["messages"] = [{"role": "user", "content": "Hi"}]
        if "prompt" in case.body:
            case.body["prompt"] = "Hi"
    return case


def _cases(operation):
    """Valid and invalid requests, and valid ones with a valid prompt (those with a body)."""
    strategies = [operation.as_strategy(GenerationMode.POSITIVE)]
    if operation.body or any(True for _ in operation.iter_parameters()):
        strategies.append(operation.as_strategy(GenerationMode.NEGATIVE))  # (no input: no invalid one)
    if operation.body:
        strategies.append(operation.as_strategy(GenerationMode.POSITIVE).map(_with_a_valid_prompt))
    return st.one_of(*strategies)


def test_every_operation_is_tested(api):
    assert sorted((op.method.upper(), op.path) for op in (r.ok() for r in api.get_all_operations())) \
        == sorted(OPERATIONS)


@pytest.mark.parametrize("method, path", OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_operation_conforms_to_the_document(api, method, path):
    @settings(max_examples=MAX_EXAMPLES, derandomize=True, database=None, deadline=None, print_blob=False,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                                     HealthCheck.large_base_example])
    @given(case=_cases(api[path][method]))
    def run(case):
        _bounded(case)
        case.call_and_validate(checks=CHECKS, timeout=TIMEOUT)

    run()


def test_streams_and_metrics_are_their_documented_media_types(api):
    """A stream's 200 is server-sent events, /metrics' Prometheus text: both as documented."""
    for method, path, body, media in [
            ("GET", "/metrics", None, "text/plain"),
            ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                                              "stream": True}, "text/event-stream"),
            ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "stream": True}, "text/event-stream")]:
        case = api[path][method].Case(**({"body": body} if body is not None else {}))
        response = case.call(timeout=TIMEOUT)
        assert response.status_code == 200 and response.headers["content-type"][0].startswith(media), path
        case.validate_response(response, checks=[content_type_conformance])
