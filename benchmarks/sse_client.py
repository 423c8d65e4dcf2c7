"""The serving benchmarks' HTTP client: one keep-alive HTTP/1.1 connection per client
(``h11`` on an asyncio protocol), which stamps each server-sent event with the time its
last bytes arrived and parses the events' JSON once the response has ended, a few at a
time between the event loop's other work (``parse_events``).

Why not httpx, which these benchmarks used before: a stream's chunk went through
httpx's and httpcore's layers, a line decoder and ``json.loads`` before its stamp, on the
one event loop that reads every client's stream. Where a step's tokens reach 16 streams
at once, the last of them waited for the others' processing and was stamped late, so a
stream's gaps carried the client's own backlog (``docs/design/kv_cache.md``, "The client's
share"). Here the stamp is taken in ``data_received``, before any parsing, and a chunk
costs h11's de-chunking only until the response ends.
"""
from __future__ import annotations

import asyncio
import json
import time
from urllib.parse import urlsplit

import h11


# Parts parsed between two yields to the event loop. A 128-token response's events take
# about a millisecond to parse; in one go, the other clients' bytes that arrive meanwhile
# would be stamped that much late (the stamp is taken when the loop gets to them).
PARSE_BETWEEN_YIELDS = 16


class StreamError(Exception):
    """A streamed request that failed: an HTTP error status, an error event, a lost
    connection or the timeout."""


class _Exchange(asyncio.Protocol):
    """The connection's protocol: feeds h11, stamps the body's bytes on arrival and
    resolves ``done`` with (status, [(stamp, bytes)]) at the response's end."""

    def __init__(self):
        self.h11 = h11.Connection(h11.CLIENT)
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future | None = None
        self.status = 0
        self.parts: list[tuple[float, bytes]] = []
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        stamp = time.perf_counter()  # (first: the bytes' arrival, whatever parsing follows)
        self.h11.receive_data(data)
        self._pump(stamp)

    def eof_received(self) -> bool:
        self.h11.receive_data(b"")
        self._pump(time.perf_counter())
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError(f"connection lost: {exc!r}"))

    def _pump(self, stamp: float) -> None:
        if self.done is None or self.done.done():
            return
        try:
            while True:
                event = self.h11.next_event()
                if event is h11.NEED_DATA or event is h11.PAUSED:
                    return
                if isinstance(event, h11.Response):
                    self.status = event.status_code
                elif isinstance(event, h11.Data):
                    self.parts.append((stamp, bytes(event.data)))
                elif isinstance(event, h11.EndOfMessage):
                    self.done.set_result((self.status, self.parts))
                    return
                elif isinstance(event, h11.ConnectionClosed):
                    raise ConnectionError("the server closed the connection mid-response")
        except (h11.RemoteProtocolError, ConnectionError) as exc:
            self.done.set_exception(exc)


async def parse_events(parts: list[tuple[float, bytes]]) -> list[tuple[float, dict]]:
    """The JSON events of a response's body ``parts`` (``data: [DONE]`` left out), each with
    the stamp of the part that completed it; ``StreamError`` on an error event. Yields to
    the event loop every ``PARSE_BETWEEN_YIELDS`` parts, so that the other clients' bytes
    are stamped as they arrive, not after this response's whole parse."""
    events, pending = [], b""
    for i, (stamp, data) in enumerate(parts):
        if i % PARSE_BETWEEN_YIELDS == PARSE_BETWEEN_YIELDS - 1:
            await asyncio.sleep(0)
        pending += data
        *complete, pending = pending.split(b"\n\n")
        for raw in complete:
            for line in raw.split(b"\n"):
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise StreamError(event["error"]["message"])
                    events.append((stamp, event))
    return events


class Client:
    """One client's connection to ``url`` (``http://host:port``), opened on first use and
    reopened where the server closed it; one request at a time."""

    def __init__(self, url: str, timeout: float = 600):
        parts = urlsplit(url)
        self.host, self.port, self.timeout = parts.hostname, parts.port or 80, timeout
        self._conn: _Exchange | None = None

    async def _connection(self) -> _Exchange:
        c = self._conn
        if c is not None and not c.lost and c.h11.our_state is h11.DONE and c.h11.their_state is h11.DONE:
            c.h11.start_next_cycle()
            return c
        if c is not None and c.transport is not None:
            c.transport.close()
        _, self._conn = await asyncio.get_running_loop().create_connection(_Exchange, self.host, self.port)
        return self._conn

    async def post(self, path: str, body: dict) -> tuple[int, list[tuple[float, bytes]]]:
        """POST ``body`` as JSON; the status and the response body's parts, each with the
        time it arrived."""
        c = await self._connection()
        payload = json.dumps(body).encode()
        c.done, c.status, c.parts = asyncio.get_running_loop().create_future(), 0, []
        head = h11.Request(method="POST", target=path,
                           headers=[("Host", f"{self.host}:{self.port}"), ("Content-Type", "application/json"),
                                    ("Accept", "text/event-stream"), ("Content-Length", str(len(payload)))])
        c.transport.write(c.h11.send(head) + c.h11.send(h11.Data(data=payload)) + c.h11.send(h11.EndOfMessage()))
        try:
            return await asyncio.wait_for(c.done, self.timeout)
        except BaseException:
            c.transport.close()  # (a response not read to its end leaves the connection unusable)
            c.lost = True
            raise

    async def stream(self, path: str, body: dict) -> list[tuple[float, dict]]:
        """A streamed OpenAI request's JSON events (``data: [DONE]`` left out), each with
        the time the bytes that completed it arrived; ``StreamError`` on an error status,
        an error event, a lost connection or the timeout."""
        try:
            status, parts = await self.post(path, body)
        except (OSError, asyncio.TimeoutError, h11.ProtocolError) as exc:
            raise StreamError(str(exc) or repr(exc)) from exc
        if status != 200:
            raise StreamError(f"HTTP {status}")
        return await parse_events(parts)

    def close(self) -> None:
        if self._conn is not None and self._conn.transport is not None:
            self._conn.transport.close()
