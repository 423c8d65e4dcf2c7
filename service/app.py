"""The HTTP surface: OpenAI-compatible completions and chat completions, streaming or not."""
from __future__ import annotations

import asyncio
import codecs
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
from ..engine.detokenizer import token_bytes
from ..engine.engine import Engine, EngineStoppedError, QueueFullError, RequestTooLongError, StreamEvent
from ..engine.grammar import GrammarError
from ..engine.logits import TokenLogprob
from ..engine.sampling import SamplingParams
from .errors import APIError, error_body, error_response, install_handlers
from .logs import request_id
from .metrics import Metrics
from .requests import chat_prompt, completion_prompt, grammar_refusal, sampling_params, text_encoder
from .schemas import (ChatCompletionRequest, CompletionRequest, ErrorResponse, ModelCard, ModelList, Usage, new_id,
                      now)
from .tools import ToolStream, template_tools

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
        self.tools = template_tools(self.tokenizer)  # (the template is fixed once the server starts)

    async def tokenize(self, fn: Callable, req) -> list[int]:
        """``fn(self, req)`` (a prompt's token ids) in the tokenizer pool, once the request's
        text is known to be Unicode (``_check_unicode``: a pass over the whole body, so
        there too)."""
        def run() -> list[int]:
            _check_unicode(req)
            return fn(self, req)

        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, run)


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


def _card(state: ServerState) -> ModelCard:
    return ModelCard(id=state.model_name, created=state.created, max_model_len=state.engine.context_len)


def _check_model(state: ServerState, requested: str | None) -> None:
    if requested is not None and requested != state.model_name:
        raise APIError(404, f"the model '{requested}' does not exist; this server serves '{state.model_name}'",
                       param="model", code="model_not_found")


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


async def _submit(state: ServerState, req, prompts: list[list[int]], params: SamplingParams,
                  n: int = 1) -> _Submitted:
    """Queue each prompt's ``n`` choices (of ``req``, which names the field of a refused grammar)."""
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
    except GrammarError as e:  # (naming the field may compile the forced tools' schemas: off the loop too)
        raise await loop.run_in_executor(state.tokenizer_pool, grammar_refusal, req, e) from e
    except ValueError as e:  # (n above the batch)
        raise APIError(400, str(e), param="n") from e
    return sub


class _TimedOut(Exception):
    pass


async def _next_event(queue: asyncio.Queue, gone: asyncio.Task | None, deadline: float) -> StreamEvent | None:
    """The next engine event; None once ``gone`` (the client's disconnect) has come first;
    _TimedOut past the deadline."""
    if not queue.empty():  # while streaming, an event is often already there
        return queue.get_nowait()
    if gone is None:  # (the common case, a stream: no task and no wait set per token)
        try:
            async with asyncio.timeout_at(asyncio.get_running_loop().time() + deadline - time.monotonic()):
                return await queue.get()
        except TimeoutError:
            raise _TimedOut from None
    get = asyncio.ensure_future(queue.get())
    done, _ = await asyncio.wait({get, gone}, timeout=max(0.0, deadline - time.monotonic()),
                                 return_when=asyncio.FIRST_COMPLETED)
    if get in done:
        return get.result()
    get.cancel()
    if gone in done:
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


def _calls_reason(reason: str) -> str:
    """The finish reason of an output that parsed as calls: "tool_calls", but "length" where
    ``max_tokens`` ended it (as OpenAI's), so that a client can tell it was cut off."""
    return "length" if reason == "length" else "tool_calls"


def _chat_logprobs(tok, lps: list[TokenLogprob]) -> dict:
    """OpenAI's chat ``logprobs``: each token's text, bytes, log-probability and top list."""
    def entry(token: int, logprob: float) -> dict:
        text = tok.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(token_bytes(tok, token, text))}

    return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps]}


def _completion_logprobs(tok, lps: list[TokenLogprob], offset: int) -> dict:
    """OpenAI's legacy completions ``logprobs``; ``offset``: the text's length before them.
    A token's ``text_offset`` is where its text begins in the choice's text, in characters:
    the tokens' bytes are decoded in turn, so the pieces of one multi-byte character (each
    U+FFFD alone) all begin where that character does, as in a stream of them."""
    tokens = [tok.decode([lp.token]) for lp in lps]
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offsets = []
    for lp, text in zip(lps, tokens):
        offsets.append(offset)
        offset += len(utf8.decode(token_bytes(tok, lp.token, text)))
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
            # A chunk per generated token, its text empty while the token is held back (a
            # character's bytes incomplete, a possible stop string's start), as vLLM streams:
            # clients see each token's arrival, and their inter-token latency is per token.
            if ev.text or ev.token_ids or ev.logprobs or ev.finish_reason is not None:
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
        return ModelList(data=[_card(state)])

    @app.get("/v1/models/{model_id:path}", responses=_errors({404: "the model is not the one served"}))
    async def model(model_id: str) -> ModelCard:
        _check_model(state, model_id)
        return _card(state)

    @app.post("/v1/chat/completions", responses={**_GENERATE_ERRORS, **_GENERATED})
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        _check_model(state, req.model)
        prompt = await state.tokenize(chat_prompt, req)
        params = sampling_params(state, req, len(prompt))
        n = req.n
        tools = req.called_tools()
        fmt = state.tools.fmt if tools else None
        sub = await _submit(state, req, [prompt], params, n)
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
                            reason = _calls_reason(reason)
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
                             "tool_calls": [c.openai() for c in calls]}, _calls_reason(ev.finish_reason))
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
        prompts = await state.tokenize(completion_prompt, req)
        params = sampling_params(state, req, max(len(p) for p in prompts))
        n = req.n
        sub = await _submit(state, req, prompts, params, n)
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
