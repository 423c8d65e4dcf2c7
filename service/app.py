"""The HTTP surface: OpenAI-compatible completions and chat completions, streaming or not."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.routing import Match

from .. import __version__
from ..engine.engine import Engine, EngineStoppedError, QueueFullError, RequestTooLongError, StreamEvent
from ..engine.grammar import json_schema_grammar, lark_grammar, regex_grammar
from ..engine.logits import TokenLogprob
from ..engine.sampling import SamplingParams
from .errors import APIError, error_body, error_response, install_handlers
from .logs import request_id
from .metrics import Metrics
from .schemas import (ChatCompletionRequest, CompletionRequest, ErrorResponse, ModelCard, ModelList, NamedToolChoice,
                      Usage, new_id, now)
from .tools import FALLBACK_SYSTEM, ToolStream, detect

log = logging.getLogger("woq.service")
access_log = logging.getLogger("woq.access")


@dataclass
class ServerState:
    engine: Engine
    tokenizer: object
    model_name: str
    metrics: Metrics
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    request_timeout: float = 600.0
    draining: bool = False  # set on SIGTERM: new requests get 503, running ones finish
    created: int = field(default_factory=now)  # the model card's `created`: when this server started
    # Tokenization and chat templating run here, off the event loop: a megabyte prompt takes
    # the tokenizer a second or more, which on the loop would stall every stream and /health.
    tokenizer_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=2, thread_name_prefix="woq-tokenize"))

    def __post_init__(self):
        self.text_encoder = text_encoder(self.tokenizer)

    async def tokenize(self, fn: Callable, req) -> list[int]:
        """``fn(self, req)`` (a prompt's token ids) in the tokenizer pool, once the request's
        text is known to be Unicode (``_check_unicode``: a pass over the whole body, so
        there too)."""
        def run() -> list[int]:
            _check_unicode(req)
            return fn(self, req)

        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, run)


def text_encoder(tokenizer) -> Callable[[str], list[int]]:
    """Token ids of a text whose special-token strings stay text (a chat message's content).
    A fast tokenizer gets its own copy of the backend with that switch on for good:
    transformers sets the switch on the shared backend for each call that asks for it, so
    the tokenizer pool's threads would race on it (one thread's template markup split as
    text)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # (a slow tokenizer: the switch is an argument, nothing shared)
        return lambda text: tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    from tokenizers import Tokenizer

    own = Tokenizer.from_str(backend.to_str())
    own.encode_special_tokens = True
    return lambda text: own.encode(text, add_special_tokens=False).ids


class BodyLimit:
    """ASGI middleware: 413 for bodies above ``limit`` bytes, declared or streamed.

    A streamed (chunked) body is cut at the limit and the app's response, whatever it is
    (it saw truncated JSON), is replaced by the 413."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    def _reply(self) -> tuple[dict, dict]:
        body = json.dumps(error_body(f"request body larger than {self.limit} bytes", "invalid_request_error",
                                     code="body_too_large")).encode()
        start = {"type": "http.response.start", "status": 413,
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
        return start, {"type": "http.response.body", "body": body}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            for message in self._reply():
                await send(message)
            return
        seen, overflow, replied = 0, False, False

        async def limited():
            nonlocal seen, overflow
            if overflow:
                return {"type": "http.request", "body": b"", "more_body": False}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    overflow = True
                    return {"type": "http.request", "body": b"", "more_body": False}
            return message

        async def guarded_send(message):
            nonlocal replied
            if not overflow:
                return await send(message)
            if not replied:
                replied = True
                for m in self._reply():
                    await send(m)

        return await self.app(scope, limited, guarded_send)


class RequestContext:
    """ASGI middleware: the request id (kept from X-Request-ID or made up) in the log context
    and the response headers, the API key check of ``/v1/`` routes, one access-log line and
    the request counter per request.

    Plain ASGI rather than ``@app.middleware("http")``: that one relays a streamed body
    through an extra task and memory stream, a cost paid for every token of every stream."""

    def __init__(self, app, state: ServerState, routes: list):
        self.app, self.state, self.routes = app, state, routes

    def _endpoint(self, scope) -> str:
        """The route's path template: the one the router matched, else the one the path would
        match (a 401 or 413 is answered before routing); "other" for no route."""
        route = scope.get("route")
        if route is None:
            route = next((r for r in self.routes if r.matches(scope)[0] == Match.FULL), None)
        return getattr(route, "path", "other")

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        if self.state.api_key is None:
            return True
        given = headers.get(b"authorization", b"")
        return hmac.compare_digest(given, f"Bearer {self.state.api_key}".encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", []))
        rid = headers.get(b"x-request-id", b"").decode("latin-1") or uuid.uuid4().hex[:16]
        token = request_id.set(rid)
        t0, status = time.perf_counter(), 500

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            if scope["path"].startswith("/v1/") and not self._authorized(headers):
                response = error_response(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                          "authentication_error", code="invalid_api_key",
                                          headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send_with_id)
            else:
                await self.app(scope, receive, send_with_id)
        finally:
            request_id.reset(token)
            self.state.metrics.requests.labels(self._endpoint(scope), str(status)).inc()
            access_log.info("request", extra={"request_id": rid, "method": scope["method"], "path": scope["path"],
                                              "status": status, "ms": round(1e3 * (time.perf_counter() - t0), 1)})


# -- request → engine ------------------------------------------------------------------


def _check_unicode(req) -> None:
    """400 for text that is not Unicode: JSON's escapes can carry a lone surrogate
    (``\\ud800``), which no tokenizer can encode."""
    try:
        json.dumps(req.model_dump(), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "the request holds invalid Unicode: a lone surrogate (such as \\ud800) that is not "
                            "part of a pair; send valid UTF-8 text", code="invalid_unicode") from None


def _check_model(state: ServerState, requested: str | None) -> None:
    if requested is not None and requested != state.model_name:
        raise APIError(404, f"the model '{requested}' does not exist; this server serves '{state.model_name}'",
                       param="model", code="model_not_found")


def _sampling(state: ServerState, req, prompt_len: int) -> SamplingParams:
    room = state.engine.max_seq_len - prompt_len
    if room < 1:
        prompt = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        raise APIError(400, f"the prompt ({prompt_len} tokens) fills the context length of "
                            f"{state.engine.max_seq_len} tokens", param=prompt, code="context_length_exceeded")
    wanted = req.wanted_max_tokens()
    max_tokens = wanted if wanted is not None else room
    if max_tokens > room:
        raise APIError(400, f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context length "
                            f"of {state.engine.max_seq_len} tokens", param="max_tokens", code="context_length_exceeded")
    vocab = state.engine.model.cfg.vocab_size
    bias = tuple((int(k), v) for k, v in req.logit_bias.items())
    if any(t >= vocab for t, _ in bias):
        raise APIError(400, f"logit_bias keys must be token ids below {vocab}", param="logit_bias")
    if any(not 0 <= t < vocab for t in req.stop_token_ids):
        raise APIError(400, f"stop_token_ids must be token ids in [0, {vocab})", param="stop_token_ids")
    if req.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({req.min_tokens}) exceeds max_tokens ({max_tokens})", param="min_tokens")
    return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                          seed=req.seed, stop=tuple(req.stop), ignore_eos=req.ignore_eos,
                          logprobs=req.wanted_logprobs(), presence_penalty=req.presence_penalty,
                          frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                          logit_bias=bias, min_tokens=req.min_tokens, stop_token_ids=tuple(req.stop_token_ids),
                          grammar=_tool_grammar(state, req) or _grammar(getattr(req, "response_format", None)))


def _tool_grammar(state: ServerState, req) -> str | None:
    """The grammar that makes the reply a tool call (``tool_choice`` "required" or a named
    function); None where the model decides ("auto") or there is no tool calling."""
    if not isinstance(req, ChatCompletionRequest) or req.called_tools() is None:
        return None
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        functions = [f for f in req.called_tools() if f["name"] == choice.function.name]
    elif choice == "required":
        functions = req.called_tools()
    else:
        return None
    tok = state.tokenizer
    fmt, _ = detect(tok.chat_template)
    marker = tok.convert_tokens_to_ids(fmt.marker) if fmt.marker in tok.get_added_vocab() else None
    try:
        return lark_grammar(fmt.grammar(functions, req.parallel_tool_calls, marker))
    except ValueError as e:
        raise APIError(400, f"a tool's parameters are no usable JSON schema: {e}", param="tools") from e


def _grammar(fmt) -> str | None:
    """The llguidance grammar a ``response_format`` asks for (None: free text)."""
    if fmt is None or fmt.type == "text":
        return None
    try:
        if fmt.type == "json_object":
            return json_schema_grammar({"type": "object"})
        if fmt.type == "json_schema":
            return json_schema_grammar(fmt.json_schema.schema_)
        return regex_grammar(fmt.regex) if fmt.type == "regex" else lark_grammar(fmt.grammar)
    except (ValueError, TypeError) as e:  # (llguidance refuses a schema it cannot compile)
        raise APIError(400, f"invalid {fmt.type}: {e}", param="response_format") from e


def _template_messages(req: ChatCompletionRequest, template_knows_tools: bool) -> list[dict]:
    """The messages as chat templates take them: tool calls with their arguments as objects;
    for a template that knows no tools, the tools described in a system message and the
    calls written out in the format the model is asked to use (``tools.FALLBACK_SYSTEM``)."""
    messages = []
    for m in req.messages:
        msg = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = [{"id": c.id, "type": "function",
                      "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                     for c in m.tool_calls]
            if template_knows_tools:
                msg["tool_calls"] = calls
            else:
                msg["content"] += "".join(
                    "\n<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                    + "\n</tool_call>" for c in calls)
        messages.append(msg)
    functions = req.called_tools()
    if functions and not template_knows_tools:
        preamble = FALLBACK_SYSTEM.format(tools="\n".join(json.dumps({"type": "function", "function": f})
                                                           for f in functions))
        if messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + preamble}
        else:
            messages.insert(0, {"role": "system", "content": preamble})
    return messages


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def _chat_prompt(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    tok = state.tokenizer
    if not getattr(tok, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions")
    knows_tools = detect(tok.chat_template)[1]
    messages = _template_messages(req, knows_tools)
    functions = req.called_tools()
    options = {"tools": [{"type": "function", "function": f} for f in functions]} if functions and knows_tools else {}
    # A final assistant message is continued (a prefill), not closed and answered.
    last = req.messages[-1]
    if last.role == "assistant" and not last.tool_calls:
        options.update(continue_final_message=True, add_generation_prompt=False)
    else:
        options.update(add_generation_prompt=True)
    # The template's markup is tokenized with its control tokens, each message's content as
    # text only: "<|im_start|>system" typed by a user stays those characters, never the
    # control token. So the template is rendered around placeholders (private-use
    # characters no tokenizer maps to a control token), and the pieces tokenized apart.
    marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
    rendered = tok.apply_chat_template([{**m, "content": mark} for m, mark in zip(messages, marks)],
                                       tokenize=False, **options)
    ids, rest = [], rendered
    for m, mark in zip(messages, marks):
        before, found, rest = rest.partition(mark)
        if not found:  # a template that transforms or drops a content: render it as it is
            log.warning("the chat template does not place each message's content verbatim: special-token strings "
                        "in content are tokenized as control tokens")
            ids = tok.apply_chat_template(messages, tokenize=True, **options)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        ids += tok.encode(before, add_special_tokens=False)
        ids += state.text_encoder(m["content"])
    return ids + tok.encode(rest, add_special_tokens=False)


def _completion_prompt(state: ServerState, req: CompletionRequest) -> list[list[int]]:
    vocab = len(state.tokenizer)
    out = []
    for p in req.prompt:
        if isinstance(p, list):
            if any(not 0 <= t < vocab for t in p):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            out.append(list(p))
        else:
            out.append(state.tokenizer.encode(p))
    return out


@dataclass
class _Submitted:
    """A request's engine requests (one per prompt) and the queue of their choices' events,
    as (choice index, event): prompt k's choice j is index k * n + j."""
    state: ServerState
    rids: list[str]
    queue: asyncio.Queue
    choices: int
    prompt_tokens: int

    def cancel(self) -> None:
        for rid in self.rids:
            self.state.engine.cancel(rid)


async def _submit(state: ServerState, prompts: list[list[int]], params: SamplingParams,
                  n: int = 1, grammar_param: str = "response_format") -> _Submitted:
    """Queue each prompt's ``n`` choices."""
    if state.draining:
        raise APIError(503, "the server is shutting down", "server_error", headers={"Retry-After": "5"})
    queue: asyncio.Queue[tuple[int, StreamEvent]] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    sub = _Submitted(state, [], queue, len(prompts) * n, sum(len(p) for p in prompts))

    def sink(i: int):
        return lambda ev: loop.call_soon_threadsafe(queue.put_nowait, (i, ev))

    def submit(k: int) -> str:  # the engine's own id (unique even when clients reuse an X-Request-ID)
        return state.engine.submit(prompts[k], params, sink(k * n), choices=[sink(k * n + i) for i in range(1, n)])

    try:
        try:
            for k in range(len(prompts)):
                # (a grammar is compiled as the request is submitted, and its first one builds
                # the tokenizer's index: seconds, off the event loop)
                sub.rids.append(await loop.run_in_executor(state.tokenizer_pool, submit, k)
                                if params.grammar is not None else submit(k))
        except BaseException:
            sub.cancel()  # (the prompts queued before the one refused)
            raise
    except QueueFullError as e:
        raise APIError(429, f"{e}; retry later", "rate_limit_error", headers={"Retry-After": "1"}) from e
    except RequestTooLongError as e:
        raise APIError(400, str(e), code="context_length_exceeded") from e
    except EngineStoppedError as e:
        raise APIError(503, str(e), "server_error") from e
    except ValueError as e:  # (a grammar the engine cannot use; n above the batch)
        raise APIError(400, str(e), param=grammar_param if params.grammar is not None else "n") from e
    return sub


class _TimedOut(Exception):
    pass


async def _next_event(queue: asyncio.Queue, gone: asyncio.Task | None, deadline: float) -> StreamEvent | None:
    """The next engine event; None once ``gone`` (the client's disconnect) has come first;
    _TimedOut past the deadline."""
    if not queue.empty():  # while streaming, an event is often already there
        return queue.get_nowait()
    get = asyncio.ensure_future(queue.get())
    waits = {get} if gone is None else {get, gone}
    done, _ = await asyncio.wait(waits, timeout=max(0.0, deadline - time.monotonic()),
                                 return_when=asyncio.FIRST_COMPLETED)
    if get in done:
        return get.result()
    get.cancel()
    if gone is not None and gone in done:
        return None
    raise _TimedOut


async def _disconnect(request: Request) -> None:
    """Returns when the client disconnects: the body has been read, so the next ASGI message
    is the disconnect (a non-streaming request's only way to learn that its client left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(state: ServerState, sub: _Submitted, request: Request) -> list[StreamEvent]:
    """Each choice's whole completion: its text, token ids and log-probabilities joined into
    its last event."""
    queue, n = sub.queue, sub.choices
    parts: list[list[StreamEvent]] = [[] for _ in range(n)]
    finished: list[StreamEvent | None] = [None] * n
    deadline = time.monotonic() + state.request_timeout
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        while True:
            try:
                ev = await _next_event(queue, gone, deadline)
            except _TimedOut:
                sub.cancel()
                raise APIError(504, f"the request did not finish within {state.request_timeout:g} s", "timeout_error",
                               code="timeout") from None
            if ev is None:  # freed at the engine's next step
                sub.cancel()
                raise APIError(499, "client closed the request")
            i, ev = ev
            parts[i].append(ev)
            if ev.finish_reason:
                if ev.error:
                    sub.cancel()
                    raise APIError(500, ev.error, "server_error")
                finished[i] = StreamEvent("".join(e.text for e in parts[i]), [t for e in parts[i] for t in e.token_ids],
                                          ev.finish_reason, ev.prompt_tokens, ev.completion_tokens,
                                          logprobs=[lp for e in parts[i] for lp in (e.logprobs or [])])
                if all(f is not None for f in finished):
                    return finished
    finally:
        gone.cancel()


Render = Callable[[int, StreamEvent], dict]  # a choice's chunk of a stream


def _chat_logprobs(tok, lps: list[TokenLogprob]) -> dict:
    """OpenAI's chat ``logprobs``: each token's text, bytes, log-probability and top list."""
    def entry(token: int, logprob: float) -> dict:
        text = tok.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps]}


def _completion_logprobs(tok, lps: list[TokenLogprob], offset: int) -> dict:
    """OpenAI's legacy completions ``logprobs``; ``offset``: the text's length before them."""
    tokens = [tok.decode([lp.token]) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{tok.decode([t]): v for t, v in lp.top} for lp in lps], "text_offset": offsets}


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def _stream(state: ServerState, sub: _Submitted, chunk: Render, first: list[dict],
                  usage_chunk: Callable[[Usage], dict] | None) -> AsyncIterator[str]:
    finished = False
    queue = sub.queue
    open_choices, completion_tokens = set(range(sub.choices)), 0
    deadline = time.monotonic() + state.request_timeout
    try:
        for f in first:
            yield _sse(f)
        while not finished:
            try:
                ev = await _next_event(queue, None, deadline)
            except _TimedOut:
                yield _sse({"error": {"message": f"the request did not finish within {state.request_timeout:g} s",
                                      "type": "timeout_error", "param": None, "code": "timeout"}})
                break
            i, ev = ev
            if ev.error:
                yield _sse({"error": {"message": ev.error, "type": "server_error", "param": None, "code": None}})
                break
            if ev.finish_reason is not None:
                open_choices.discard(i)
                completion_tokens += ev.completion_tokens
            finished = not open_choices
            if ev.text or ev.logprobs or ev.finish_reason is not None:
                yield _sse(chunk(i, ev))
            if finished and usage_chunk is not None:
                yield _sse(usage_chunk(Usage.of(sub.prompt_tokens, completion_tokens)))
        yield _sse("[DONE]")
    finally:
        if not finished:  # client went away mid-stream: free the slot
            sub.cancel()


# -- app -------------------------------------------------------------------------------


def _errors(statuses: dict[int, str]) -> dict:
    """The OpenAPI responses of a /v1 route's errors, all in OpenAI's error JSON. Declaring
    "default" also keeps FastAPI from declaring its 422, which this server never sends (a bad
    request is a 400: errors.py)."""
    described = {**statuses, 401: "invalid or missing API key (when the server has one)",
                 "default": "any other error (such as a 500), in the same JSON"}
    return {status: {"model": ErrorResponse, "description": d} for status, d in described.items()}


_GENERATE_ERRORS = _errors({
    400: "an invalid request: a malformed or unsupported parameter (named by `param`), a body that is not a JSON "
         "object, or a prompt that does not fit the context",
    404: "the model is not the one served", 413: "the body is larger than the server's limit",
    429: "the queue is full (see Retry-After)", 503: "the server is shutting down", 504: "the request timed out"})
# A generation's 200: its JSON body, or with "stream": true server-sent events of chunks.
_GENERATED = {200: {"description": "the completion; with `stream`, server-sent events of chunks ending in "
                                   "`data: [DONE]`",
                    "content": {"application/json": {}, "text/event-stream": {}}}}


def create_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # uvicorn has drained the in-flight requests (or hit --drain-timeout): stop the engine
        state.engine.shutdown()
        log.info("stopped")

    app = FastAPI(title="woq", version=__version__, description="Weight-only int8/int4 LLM inference server",
                  lifespan=lifespan)
    app.state.woq = state
    install_handlers(app)
    metrics = state.metrics

    # (added last, RequestContext runs first: it also counts the 413s that BodyLimit sends)
    app.add_middleware(BodyLimit, limit=state.max_body_bytes)
    app.add_middleware(RequestContext, state=state, routes=app.router.routes)

    @app.get("/health")
    async def health():
        if state.draining:
            return JSONResponse({"status": "draining", "model": state.model_name}, status_code=503)
        return {"status": "ok", "model": state.model_name}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus' text exposition format"}})
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=_errors({}))
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=state.model_name, created=state.created)])

    @app.get("/v1/models/{model_id:path}", responses=_errors({404: "the model is not the one served"}))
    async def model(model_id: str) -> ModelCard:
        _check_model(state, model_id)
        return ModelCard(id=state.model_name, created=state.created)

    @app.post("/v1/chat/completions", responses={**_GENERATE_ERRORS, **_GENERATED})
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        _check_model(state, req.model)
        prompt = await state.tokenize(_chat_prompt, req)
        params = _sampling(state, req, len(prompt))
        n = req.n
        tools = req.called_tools()
        fmt = detect(state.tokenizer.chat_template)[0] if tools else None
        sub = await _submit(state, [prompt], params, n,
                            "tools" if tools and req.tool_choice not in (None, "auto") else "response_format")
        cid, created = new_id("chatcmpl"), now()
        base = {"id": cid, "created": created, "model": state.model_name}
        tok = state.tokenizer
        if req.stream:
            held = [ToolStream(fmt) for _ in range(n)] if fmt is not None else None

            def chunk(i: int, ev: StreamEvent) -> dict:
                text, delta, reason = ev.text, {}, ev.finish_reason
                if held is not None:  # (an output that starts as a call is held back and parsed at its end)
                    text = held[i].feed(text)
                    if reason is not None:
                        rest, calls = held[i].finish()
                        text += rest
                        if calls:
                            delta["tool_calls"] = [c.openai(j) for j, c in enumerate(calls)]
                            reason = "tool_calls"
                if text:
                    delta["content"] = text
                choice = {"index": i, "delta": delta, "finish_reason": reason}
                if params.logprobs is not None:
                    choice["logprobs"] = _chat_logprobs(tok, ev.logprobs or [])
                return {**base, "object": "chat.completion.chunk", "choices": [choice]}

            first = [{**base, "object": "chat.completion.chunk",
                      "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
                     for i in range(n)]
            usage = None
            if req.stream_options and req.stream_options.include_usage:
                def usage(u: Usage) -> dict:
                    return {**base, "object": "chat.completion.chunk", "choices": [], "usage": u.model_dump()}
            return StreamingResponse(_stream(state, sub, chunk, first, usage), media_type="text/event-stream")
        evs = await _collect(state, sub, request)

        def message(ev: StreamEvent) -> tuple[dict, str]:
            if fmt is not None:
                content, calls = fmt.parse(ev.text)
                if calls:
                    return ({"role": "assistant", "content": content,
                             "tool_calls": [c.openai() for c in calls]}, "tool_calls")
            return {"role": "assistant", "content": ev.text}, ev.finish_reason

        choices = []
        for i, ev in enumerate(evs):
            msg, reason = message(ev)
            choices.append({"index": i, "message": msg, "finish_reason": reason,
                            "logprobs": _chat_logprobs(tok, ev.logprobs) if params.logprobs is not None else None})
        return JSONResponse({
            **base, "object": "chat.completion", "choices": choices,
            "usage": Usage.of(sub.prompt_tokens, sum(ev.completion_tokens for ev in evs)).model_dump(),
        })

    @app.post("/v1/completions", responses={**_GENERATE_ERRORS, **_GENERATED})
    async def completions(req: CompletionRequest, request: Request):
        _check_model(state, req.model)
        prompts = await state.tokenize(_completion_prompt, req)
        params = _sampling(state, req, max(len(p) for p in prompts))
        n = req.n
        sub = await _submit(state, prompts, params, n)
        base = {"id": new_id("cmpl"), "object": "text_completion", "created": now(), "model": state.model_name}
        tok = state.tokenizer
        # each choice's echo: its prompt as text (token-id prompts too); choice i is prompt i // n's
        echoes = [""] * sub.choices
        if req.echo:
            echoes = [p if isinstance(p, str) else tok.decode(p) for p in req.prompt for _ in range(n)]
        if req.stream:
            offsets = [len(e) for e in echoes]

            def chunk(i: int, ev: StreamEvent) -> dict:
                lp = None
                if params.logprobs is not None:
                    lp = _completion_logprobs(tok, ev.logprobs or [], offsets[i])
                offsets[i] += len(ev.text)
                return {**base, "choices": [{"index": i, "text": ev.text, "logprobs": lp,
                                             "finish_reason": ev.finish_reason}]}

            first = [{**base, "choices": [{"index": i, "text": e, "logprobs": None, "finish_reason": None}]}
                     for i, e in enumerate(echoes) if e]
            usage = None
            if req.stream_options and req.stream_options.include_usage:
                def usage(u: Usage) -> dict:
                    return {**base, "choices": [], "usage": u.model_dump()}
            return StreamingResponse(_stream(state, sub, chunk, first, usage), media_type="text/event-stream")
        evs = await _collect(state, sub, request)
        return JSONResponse({
            **base,
            "choices": [{"index": i, "text": echoes[i] + ev.text,
                         "logprobs": _completion_logprobs(tok, ev.logprobs, len(echoes[i]))
                         if params.logprobs is not None else None,
                         "finish_reason": ev.finish_reason} for i, ev in enumerate(evs)],
            "usage": Usage.of(sub.prompt_tokens, sum(ev.completion_tokens for ev in evs)).model_dump(),
        })

    return app
