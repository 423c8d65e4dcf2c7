"""A request's lifecycle no client can break, shown with raw sockets against a real `woq serve`
(SmolLM2 on loopback): header and body timeouts, refused framings, and a SIGTERM drain that
keeps the port answering."""
import json
import signal
import socket
import time

import httpx
import pytest

from conftest import LiveServer

pytestmark = pytest.mark.slow
MODEL = "smollm2"
TIMEOUT = 1.0  # the server's --header-timeout and --body-timeout here


def _server(smollm2_dir, *args):
    return LiveServer("--model", str(smollm2_dir), "--served-model-name", MODEL, "--quant", "int4",
                      "--max-seq-len", "1024", *args)


@pytest.fixture(scope="module")
def server(smollm2_dir):
    s = _server(smollm2_dir, "--header-timeout", str(TIMEOUT), "--body-timeout", str(TIMEOUT))
    yield s
    s.stop()


def _completion(**kw):
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2, "temperature": 0, **kw}


def _connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a hang fails: the socket's
    10 s timeout raises)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:  # (it closed with bytes of ours unread: the kernel then resets, after its reply)
        pass
    return data


def _read_response(sock: socket.socket) -> bytes:
    """One whole response (its headers and Content-Length bytes of body), the connection left open."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < int(_parse(data)[1]["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, f"closed mid-response: {data!r}"
        data += chunk
    return data


def _parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def _error(raw: bytes, status: int, code: str | None = None) -> dict:
    """The one response in ``raw``: ``status``, OpenAI's error JSON, ``Connection: close``."""
    got, headers, body = _parse(raw)
    assert got == status, raw
    assert headers["connection"] == "close" and headers["content-type"] == "application/json"
    error = json.loads(body[: int(headers["content-length"])])["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert code is None or error["code"] == code, error
    assert raw.count(b"HTTP/1.1 ") == 1, raw  # nothing after it: the connection closed
    return error


def _body(**kw) -> bytes:
    return json.dumps(_completion(**kw)).encode()


def _post_head(length: int | None = None, *extra: str) -> bytes:
    lines = ["POST /v1/completions HTTP/1.1", "Host: test", "Content-Type: application/json", *extra]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


# -- headers ---------------------------------------------------------------------------


def test_trickled_headers_get_408_at_the_header_timeout(server):
    """A slowloris client: header bytes keep coming, but not the end of the headers. The
    timeout runs from the connection's start, so the trickle does not extend it."""
    head = _post_head(10)[:-2]  # (all but the blank line that ends the headers)
    with _connect(server) as sock:
        t0 = time.monotonic()
        sock.settimeout(0.2)
        raw = b""
        for byte in head:
            try:
                sock.sendall(bytes([byte]))
                raw = sock.recv(65536)  # (a 0.2 s pause between bytes)
                break  # the server answered (or closed: b"")
            except TimeoutError:
                continue
            except OSError:  # (closed while we were still sending)
                break
        elapsed = time.monotonic() - t0
        sock.settimeout(10)
        raw += _read_until_closed(sock)
    assert TIMEOUT * 0.8 < elapsed < TIMEOUT + 2, elapsed
    _error(raw, 408, "request_timeout")


def test_a_connection_that_sends_nothing_is_closed_without_a_reply(server):
    with _connect(server) as sock:
        t0 = time.monotonic()
        assert _read_until_closed(sock) == b""
        assert TIMEOUT * 0.8 < time.monotonic() - t0 < TIMEOUT + 2


def test_a_slow_body_within_its_idle_timeout_is_served_and_the_connection_kept(server):
    """Headers at once, then the body in three parts 0.6 s apart: 1.2 s in all, longer than
    the header timeout (which no longer applies once the headers are in) but never 1 s
    without a byte. The connection then serves a second request."""
    body = _body()
    with _connect(server) as sock:
        sock.sendall(_post_head(len(body)))
        for part in (body[:10], body[10:20], body[20:]):
            time.sleep(0.6)
            sock.sendall(part)
        first = _read_response(sock)
        assert _parse(first)[0] == 200, first
        sock.sendall(_post_head(len(body), "Connection: close") + body)
        second = _read_until_closed(sock)
    status, _, data = _parse(second)
    assert status == 200 and json.loads(data)["choices"][0]["text"], second


# -- body ------------------------------------------------------------------------------


def test_a_body_shorter_than_its_content_length_gets_408_not_a_hang(server):
    body = _body()
    with _connect(server) as sock:
        sock.sendall(_post_head(len(body) + 100) + body)
        t0 = time.monotonic()
        raw = _read_until_closed(sock)
        elapsed = time.monotonic() - t0
    assert TIMEOUT * 0.8 < elapsed < TIMEOUT + 2, elapsed
    assert "stalled" in _error(raw, 408)["message"]
    metrics = httpx.get(server.url + "/metrics").text  # logged and counted as what it was
    assert 'woq_requests_total{endpoint="/v1/completions",status="408"}' in metrics


def test_a_stalled_chunked_body_gets_408(server):
    with _connect(server) as sock:
        sock.sendall(_post_head(None, "Transfer-Encoding: chunked") + b"5\r\n{\"mod\r\n")
        _error(_read_until_closed(sock), 408)


# -- framing ---------------------------------------------------------------------------


def test_content_length_with_transfer_encoding_is_refused_and_nothing_smuggled(server):
    """A body framed both ways, carrying a second request for whoever reads it as chunked:
    400 at once, the connection closed, the second request never answered."""
    smuggled = b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n"
    chunked = b"0\r\n\r\n" + smuggled
    with _connect(server) as sock:
        t0 = time.monotonic()
        sock.sendall(_post_head(len(chunked), "Transfer-Encoding: chunked") + chunked)
        raw = _read_until_closed(sock)
        assert time.monotonic() - t0 < TIMEOUT * 0.8  # closed by the refusal, not by a timeout
    _error(raw, 400, "invalid_framing")


@pytest.mark.parametrize("lengths", [["-5"], ["12abc"], ["+7"], ["5", "6"]])
def test_a_malformed_content_length_is_refused(server, lengths):
    head = _post_head(None, *(f"Content-Length: {v}" for v in lengths))
    with _connect(server) as sock:
        sock.sendall(head + b"hello")
        _error(_read_until_closed(sock), 400, "invalid_http_request")


# -- SIGTERM ---------------------------------------------------------------------------


def _stream(server, max_tokens: int):
    body = _completion(max_tokens=max_tokens, ignore_eos=True, stream=True, stream_options={"include_usage": True})
    return httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120)


def test_sigterm_drains_with_the_port_open_then_exits(smollm2_dir):
    """Mid-stream SIGTERM: new connections are accepted and get 503 (not "connection
    refused"), /health says 503, the stream runs to its end, and the process then exits by
    the signal -- as soon as the stream is done, not at the 60 s drain timeout."""
    server = _server(smollm2_dir, "--drain-timeout", "60")
    try:
        events, seen_at_drain, refused = [], None, None
        with _stream(server, 96) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 2:
                    server.proc.send_signal(signal.SIGTERM)
                    t0 = time.monotonic()
                    while (health := httpx.get(server.url + "/health", timeout=5)).status_code == 200:
                        assert time.monotonic() - t0 < 5, "the server did not start draining"
                        time.sleep(0.02)  # (each probe a new connection: httpx.get opens its own)
                    assert health.status_code == 503 and health.json()["status"] == "draining"
                    assert health.headers["connection"] == "close"
                    refused = httpx.post(server.url + "/v1/completions", json=_completion(), timeout=30)
                    seen_at_drain = len(events)
        stream_done = time.monotonic()
        assert refused.status_code == 503 and refused.headers["connection"] == "close"
        assert refused.json()["error"]["type"] == "server_error"
        assert events[-1] == "[DONE]" and len(events) > seen_at_drain  # (the checks ran mid-stream)
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 96
        assert server.proc.wait(30) == -signal.SIGTERM  # (uvicorn re-raises the signal once stopped)
        assert time.monotonic() - stream_done < 10
        with pytest.raises(httpx.ConnectError):  # gone now
            httpx.get(server.url + "/health", timeout=2)
        out = server.output()
        assert "draining" in out and '"msg": "stopped"' in out
    finally:
        server.stop()


def test_the_drain_timeout_cuts_off_what_is_still_running(smollm2_dir):
    server = _server(smollm2_dir, "--drain-timeout", "1")
    try:
        events, cut = [], False
        with _stream(server, 1000) as r:  # (a minute of tokens on a CPU)
            try:
                for line in r.iter_lines():
                    events += [line] if line.startswith("data: ") else []
                    if len(events) == 2 and line.startswith("data: "):
                        server.proc.send_signal(signal.SIGTERM)
                        t0 = time.monotonic()
            except httpx.HTTPError:  # the server closed the connection mid-stream
                cut = True
        assert cut and "data: [DONE]" not in events
        assert server.proc.wait(30) == -signal.SIGTERM
        assert time.monotonic() - t0 < 1 + 5
        assert "drain timeout" in server.output()
    finally:
        server.stop()
