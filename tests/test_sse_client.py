"""The serving benchmarks' streaming client (``benchmarks/sse_client.py``): against the
official ``openai`` client on the live SmolLM2 server, its error path, its kept-alive
connection, and its stamps (the arrival of the bytes that complete an event) against a
loopback server that sends an event in two writes."""
import asyncio
import json
import sys
import time
from pathlib import Path

import pytest

# (the GPU machine's image has no openai client: its GPU test runs collect this file too)
openai = pytest.importorskip("openai", reason="needs the openai client (pip install -e '.[dev]')")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from sse_client import PARSE_BETWEEN_YIELDS, Client, StreamError, parse_events  # noqa: E402


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server


def test_streamed_completions_and_chats_read_as_the_openai_client_reads_them(server):
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    body = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    chat = {"model": "smollm2", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 10,
            "temperature": 0, "stream": True}
    want = [c.choices[0].text for c in api.completions.create(**body) if c.choices]
    want_chat = [c.choices[0].delta.content for c in api.chat.completions.create(**chat) if c.choices]

    async def run():
        client = Client(server.url)
        t0 = time.perf_counter()
        first = await client.stream("/v1/completions", body)
        conn = client._conn
        second = await client.stream("/v1/chat/completions", chat)
        kept = client._conn is conn  # (one connection, kept alive between the requests)
        client.close()
        return t0, first, second, kept

    t0, events, chat_events, kept = asyncio.run(run())
    assert kept
    texts = [e["choices"][0]["text"] for _, e in events if e["choices"]]
    assert texts == want and len(texts) == 12
    assert [e["usage"]["completion_tokens"] for _, e in events if e.get("usage")] == [12]
    stamps = [s for s, _ in events]
    assert t0 < stamps[0] and stamps == sorted(stamps)
    assert [e["choices"][0]["delta"].get("content") for _, e in chat_events if e["choices"]] == want_chat


def test_an_error_status_raises_and_the_client_goes_on(server):
    async def run():
        client = Client(server.url)
        with pytest.raises(StreamError, match="HTTP 400"):
            await client.stream("/v1/completions", {"model": "smollm2", "prompt": "x", "max_tokens": -1,
                                                    "stream": True})
        events = await client.stream("/v1/completions", {"model": "smollm2", "prompt": "Hi", "max_tokens": 3,
                                                         "temperature": 0, "stream": True})
        client.close()
        return events

    assert len([e for _, e in asyncio.run(run()) if e["choices"]]) == 3


def test_an_event_is_stamped_when_its_last_bytes_arrive():
    """A server that writes one whole event, then half of the next, and its rest 50 ms
    later: the first event's stamp falls before the rest was written, the second's after."""
    written = {}

    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        one, two = b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n'
        writer.write(b"%x\r\n%s\r\n" % (len(one), one) + b"%x\r\n%s" % (len(two), two[:8]))
        await writer.drain()
        await asyncio.sleep(0.05)
        written["rest"] = time.perf_counter()
        writer.write(two[8:] + b"\r\n0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def run():
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        client = Client(f"http://127.0.0.1:{port}")
        try:
            return await client.stream("/v1/completions", {"stream": True})
        finally:
            client.close()
            srv.close()

    events = asyncio.run(run())
    assert [e["n"] for _, e in events] == [1, 2]
    assert events[0][0] < written["rest"] <= events[1][0]


def test_a_long_response_is_parsed_a_few_parts_at_a_time_between_other_work():
    """A 130-part response (a 128-token stream, its usage and [DONE], events split across
    parts) parses to its events with each part's stamp, and the event loop runs other work
    between every ``PARSE_BETWEEN_YIELDS`` parts (a task counting the loop's turns meanwhile),
    so that other clients' bytes are not stamped after the whole parse."""
    events = [{"choices": [{"index": 0, "text": f" w{i}"}]} for i in range(128)] + [{"usage": {"completion_tokens": 128}}]
    body = b"".join(b"data: %s\n\n" % json.dumps(e).encode() for e in events) + b"data: [DONE]\n\n"
    cut = len(body) // 130
    parts = [(float(i), body[i * cut:(i + 1) * cut if i < 129 else None]) for i in range(130)]

    async def run():
        turns = 0
        stop = asyncio.Event()

        async def count():
            nonlocal turns
            while not stop.is_set():
                turns += 1
                await asyncio.sleep(0)

        counter = asyncio.create_task(count())
        await asyncio.sleep(0)
        before = turns
        got = await parse_events(parts)
        during = turns - before
        stop.set()
        await counter
        return got, during

    got, during = asyncio.run(run())
    assert [e for _, e in got] == events
    # each event's stamp: that of the part holding its last byte
    ends = [body.index(b"\n\n", body.index(json.dumps(e).encode())) + 1 for e in events]
    assert [s for s, _ in got] == [float(min(end // cut, 129)) for end in ends]
    assert PARSE_BETWEEN_YIELDS <= 32 and during >= 130 // PARSE_BETWEEN_YIELDS
    with pytest.raises(StreamError, match="boom"):
        asyncio.run(parse_events([(0.0, b'data: {"error": {"message": "boom"}}\n\n')]))
