"""The request lifecycle a client cannot break: how long it may take to send a request,
which framings are refused, and what a draining server answers.

uvicorn on its own waits forever for a request's headers (its keep-alive timeout runs
only between requests, and not at all on a fresh connection) and for a body shorter than
its Content-Length, and h11 accepts Content-Length together with Transfer-Encoding. Two
small pieces close those gaps:

- ``GuardedH11Protocol`` (the connection): a header timeout, and refusals in OpenAI's
  error JSON for requests that h11 cannot parse;
- ``HttpGuard`` (ASGI, around the app): Content-Length with Transfer-Encoding refused, a
  body idle timeout, and ``Connection: close`` on every response while draining.
"""
from __future__ import annotations

import asyncio
import http
import json
import logging

import h11
from fastapi import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_body

log = logging.getLogger("woq.service")


def _json_error(message: str, code: str) -> bytes:
    return json.dumps(error_body(message, "invalid_request_error", code=code)).encode()


def _closing_headers(body: bytes) -> list[tuple[bytes, bytes]]:
    """The headers of an error reply (``body``) after which the connection closes."""
    return [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")]


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 connection, with a header timeout: from the moment the connection
    waits for a request (it opened, or the previous response was sent), the client has
    ``header_timeout`` seconds to send the request's headers in full. Trickling them byte
    by byte does not extend it (a timer from the start of the wait, not an idle timer). The
    body is not covered: ``HttpGuard`` times it while the app waits for it.

    On timeout the connection closes: with a 408 if the client had begun a request, at
    once if it sent nothing (an idle connection, as uvicorn's keep-alive timeout closes
    one)."""

    header_timeout: float = 10.0

    def connection_made(self, transport) -> None:
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._wait_for_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._wait_for_headers()  # (the next request's wait starts; a pipelined one may have begun)

    def connection_lost(self, exc) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _wait_for_headers(self) -> None:
        self._stop_header_timer()
        if not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_timed_out)

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        # h11's client state leaves IDLE with a request's complete headers: any other state
        # means they came in time (the request may well still be running: no concern here).
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        started = bool(self.conn.trailing_data[0])  # (bytes received but not yet a whole event)
        if started:
            log.info("closing a connection whose request headers did not arrive within %g s", self.header_timeout)
            self._reply_and_close(408, _json_error(
                f"the request's headers did not arrive within {self.header_timeout:g} s", "request_timeout"))
        else:
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 refuses (a malformed or negative Content-Length,
        conflicting Content-Lengths, an unsupported Transfer-Encoding, oversized headers), in
        OpenAI's error JSON rather than plain text. The connection closes: what follows the
        bad request cannot be framed."""
        self._reply_and_close(400, _json_error(
            "malformed HTTP request (for example a bad Content-Length or Transfer-Encoding header)",
            "invalid_http_request"))

    def _reply_and_close(self, status: int, body: bytes) -> None:
        try:  # (through h11, which tracks the connection's state: it refuses if a response had begun)
            out = self.conn.send(h11.Response(status_code=status, headers=_closing_headers(body),
                                              reason=http.HTTPStatus(status).phrase.encode()))
            out += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
            self.transport.write(out)
        except h11.LocalProtocolError:
            pass
        self.transport.close()


def h11_protocol(header_timeout: float) -> type[H11Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)``: uvicorn builds one per
    connection, so the setting travels as a class attribute."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout": header_timeout})


class HttpGuard:
    """ASGI middleware, outermost:

    - a request with both Content-Length and Transfer-Encoding gets 400 and the connection
      closes (RFC 9112 §6.1: such a message may be an attempt at request smuggling, since a
      proxy in front may frame it by the other header; h11 would read it as chunked);
    - while the app waits for more of the body, ``body_timeout`` seconds without a byte
      end the request with a 408 (raised as an HTTPException from ``receive``: FastAPI
      re-raises it from the body read, so the app's error handler writes OpenAI's JSON and
      the request is logged and counted as a 408), and the connection closes: the rest of
      the body would otherwise be read as the next request;
    - while the server drains, every response says ``Connection: close``, so that clients
      open their next connection elsewhere (new generation requests get 503 from the app,
      /health 503)."""

    def __init__(self, app, state, body_timeout: float):
        self.app, self.state, self.body_timeout = app, state, body_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        names = {name.lower() for name, _ in scope.get("headers", [])}
        if b"content-length" in names and b"transfer-encoding" in names:
            log.warning("refused a request with both Content-Length and Transfer-Encoding from %s",
                        (scope.get("client") or ("?",))[0])
            body = _json_error("a request may not carry both Content-Length and Transfer-Encoding", "invalid_framing")
            await send({"type": "http.response.start", "status": 400, "headers": _closing_headers(body)})
            await send({"type": "http.response.body", "body": body})
            return
        body_done, timed_out = False, False

        async def timed_receive():
            nonlocal body_done, timed_out
            if body_done:  # (later calls wait for the client's disconnect: no deadline on that)
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout)
            except asyncio.TimeoutError:
                timed_out = True
                raise HTTPException(408, f"the request body stalled: no bytes for {self.body_timeout:g} s") from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def closing_send(message):
            if message["type"] == "http.response.start" and (timed_out or self.state.draining):
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, timed_receive, closing_send)
