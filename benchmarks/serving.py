"""Serving benchmark over HTTP: a bounded load generator on loopback, streaming requests.

For each concurrency level, ``--requests`` streaming completions with a fixed prompt
length and a fixed number of output tokens (``ignore_eos``) are sent by that many
concurrent clients. Reported: TTFT and inter-token latency p50/p99, output tokens/s,
requests/s, errors. Writes JSON, a markdown table and a PNG plot.

With ``--spawn ... --offline``, the same model and settings are then also loaded in this
process, and the concurrency-1 requests run in pairs: each prompt once over HTTP and once
straight through the in-process engine (no HTTP, tokenization included), alternating, so
that drift between runs falls on both sides alike; the HTTP layer's cost is the ratio of
the two medians.

    python benchmarks/serving.py --spawn "--quant int4" --concurrency 1,8 --out docs/bench
    python benchmarks/serving.py --url http://127.0.0.1:8000 --concurrency 1,4,16,64
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown_table, write_json  # noqa: E402
from sse_client import Client, StreamError  # noqa: E402

WORDS = ("the quick brown fox jumps over the lazy dog while a curious cat watches from the warm windowsill "
         "and the city hums with distant traffic").split()


def prompt_of(tokens: int, i: int) -> str:
    """A distinct prompt of roughly ``tokens`` tokens (one word ~ one token here)."""
    words = [WORDS[(i * 7 + j) % len(WORDS)] for j in range(tokens)]
    return f"Request {i}: " + " ".join(words)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


async def one_request(client: Client, model: str, prompt: str, out_tokens: int) -> dict:
    """One streamed completion: its TTFT, its gaps between tokens (each token's chunk stamped
    on arrival: ``sse_client.py``), its tokens and latency."""
    body = {"model": model, "prompt": prompt, "max_tokens": out_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps, tokens = [], 0
    try:
        events = await client.stream("/v1/completions", body)
    except StreamError as exc:
        return {"error": str(exc)}
    end = time.perf_counter()
    for stamp, chunk in events:
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        elif chunk["choices"]:  # (a chunk per token, its text maybe empty: service/app.py)
            stamps.append(stamp)
    if not stamps:
        return {"error": "no tokens"}
    itl = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"ttft": stamps[0] - t0, "itl": itl, "tokens": tokens, "latency": end - t0, "stamps": stamps}


async def send_all(url: str, model: str, clients: int, prompts: list[str], out_tokens: int,
                   timeout: float = 600) -> tuple[list[dict], float]:
    """Stream a completion of each prompt, ``clients`` at a time: each request's result
    (``one_request``) and the wall time of them all."""
    todo = list(prompts)
    results: list[dict] = []

    async def worker():
        client = Client(url, timeout)  # (a client's own connection, kept alive between its requests)
        try:
            while todo:
                results.append(await one_request(client, model, todo.pop(0), out_tokens))
        finally:
            client.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return results, time.perf_counter() - t0


def _send_share(url: str, model: str, clients: int, prompts: list[str], out_tokens: int, timeout: float,
                start, results) -> None:
    """One process of ``send_processes``: waits at ``start`` (a barrier), then sends its share."""
    start.wait()
    results.put(asyncio.run(send_all(url, model, clients, prompts, out_tokens, timeout))[0])


def send_processes(url: str, model: str, clients: int, prompts: list[str], out_tokens: int, processes: int,
                   timeout: float = 600) -> tuple[list[dict], float]:
    """``send_all`` with the clients spread over ``processes`` processes started together,
    each with its share of the clients and every ``processes``-th prompt. One process
    reading 16 streams of ~3 ms steps parses ~5,000 chunks a second, and a chunk that
    arrives while the others are parsed is stamped late: the gaps it measures then hold
    its own backlog, which separate users' clients would not see (``kv_cache.md``). The
    stamps are ``perf_counter``'s, the one monotonic clock of every process here."""
    import multiprocessing

    processes = max(1, min(processes, clients))
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Barrier(processes + 1), ctx.Queue()
    shares = [clients // processes + (i < clients % processes) for i in range(processes)]
    procs = [ctx.Process(target=_send_share, args=(url, model, shares[i], prompts[i::processes], out_tokens,
                                                   timeout, start, results)) for i in range(processes)]
    for p in procs:
        p.start()
    start.wait(timeout=120)  # (every process has imported what it needs)
    t0 = time.perf_counter()
    out = [r for _ in procs for r in results.get(timeout=timeout)]
    wall = time.perf_counter() - t0
    for p in procs:
        p.join()
    return out, wall


async def run_level(url: str, model: str, concurrency: int, requests: int, prompt_tokens: int, out_tokens: int) -> dict:
    prompts = [prompt_of(prompt_tokens, i) for i in range(requests)]
    results, wall = await send_all(url, model, concurrency, prompts, out_tokens)
    ok = [r for r in results if "error" not in r]
    return {"concurrency": concurrency, "requests": requests, "errors": len(results) - len(ok),
            "prompt_tokens": prompt_tokens, "output_tokens": out_tokens, **level_stats(ok, wall)}


def level_stats(ok: list[dict], wall: float) -> dict:
    """Latency percentiles and rates of the successful requests of one level."""
    itl = [x for r in ok for x in r["itl"]]
    ttft = [r["ttft"] for r in ok]
    return {
        "wall_s": wall,
        "ttft_p50_ms": 1e3 * pct(ttft, 0.5), "ttft_p99_ms": 1e3 * pct(ttft, 0.99),
        "itl_p50_ms": 1e3 * pct(itl, 0.5), "itl_p99_ms": 1e3 * pct(itl, 0.99),
        "output_tok_per_s": sum(r["tokens"] for r in ok) / wall, "req_per_s": len(ok) / wall,
        "per_request_tok_per_s": statistics.median(r["tokens"] / r["latency"] for r in ok) if ok else 0.0,
    }


def free_port() -> int:
    """A loopback port free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: list[str], log: Path | None = None, polls: int = 2400) -> tuple[subprocess.Popen, str]:
    """``woq serve`` with ``args`` on a free loopback port, its output to ``log`` (or
    dropped); returns once /health answers (``polls`` tries, 4 a second)."""
    port = free_port()
    out = log.open("w") if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, "-m", "woq", "serve", "--port", str(port), *args], stdout=out,
                            stderr=subprocess.STDOUT, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    where = f": {log}" if log is not None else ""
    for _ in range(polls):
        if proc.poll() is not None:
            raise RuntimeError(f"server exited during start-up{where}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"server did not start{where}")


def spawn(args: str) -> tuple[subprocess.Popen, str]:
    return start_server(shlex.split(args), polls=1200)


def paired_level(url: str, model: str, spawn_args: str, requests: int, prompt_tokens: int,
                 out_tokens: int) -> tuple[dict, dict]:
    """Concurrency 1 over HTTP and without it, alternating request by request: the server's
    settings rebuilt in this process (as ``woq serve`` builds them) serve the offline side."""
    import threading

    from woq.engine.sampling import SamplingParams
    from woq.service.config import ServeSettings
    from woq.service.server import build_state

    state = build_state(ServeSettings(_cli_parse_args=shlex.split(spawn_args)))
    tok = state.tokenizer

    def offline(prompt: str) -> dict:
        stamps, last, done = [], [], threading.Event()

        def sink(ev):
            if ev.text:
                stamps.append(time.perf_counter())
            if ev.finish_reason:
                last.append(ev)
                done.set()

        t0 = time.perf_counter()
        state.engine.submit(tok.encode(prompt), SamplingParams(max_tokens=out_tokens, temperature=0,
                                                               ignore_eos=True), sink)
        done.wait()
        end = time.perf_counter()
        return {"ttft": stamps[0] - t0, "itl": [b - a for a, b in zip(stamps, stamps[1:])],
                "tokens": last[0].completion_tokens, "latency": end - t0}

    async def http(prompt: str) -> dict:
        client = Client(url)
        try:
            return await one_request(client, model, prompt, out_tokens)
        finally:
            client.close()

    sides: dict[str, list[dict]] = {"http": [], "offline": []}
    try:
        for i in range(requests):  # the server has served these prompts already: so has the offline engine
            offline(prompt_of(prompt_tokens, i))
        for i in range(requests):
            sides["http"].append(asyncio.run(http(prompt_of(prompt_tokens, i))))
            sides["offline"].append(offline(prompt_of(prompt_tokens, i)))
    finally:
        state.engine.shutdown()
    out = []
    for name, results in sides.items():
        ok = [r for r in results if "error" not in r]
        # one request at a time: the level's wall time is the sum of the requests' latencies
        out.append({"concurrency": f"1 ({'HTTP' if name == 'http' else 'offline, no HTTP'}, paired)",
                    "requests": requests, "errors": len(results) - len(ok), "prompt_tokens": prompt_tokens,
                    "output_tokens": out_tokens, **level_stats(ok, sum(r["latency"] for r in ok))})
    return out[0], out[1]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = [r["concurrency"] for r in rows]
    fig, ax = plt.subplots(1, 3, figsize=(12, 3.4))
    ax[0].plot(c, [r["output_tok_per_s"] for r in rows], "o-")
    ax[0].set_title("output tokens/s")
    ax[1].plot(c, [r["ttft_p50_ms"] for r in rows], "o-", label="p50")
    ax[1].plot(c, [r["ttft_p99_ms"] for r in rows], "s--", label="p99")
    ax[1].set_title("time to first token (ms)")
    ax[2].plot(c, [r["itl_p50_ms"] for r in rows], "o-", label="p50")
    ax[2].plot(c, [r["itl_p99_ms"] for r in rows], "s--", label="p99")
    ax[2].set_title("inter-token latency (ms)")
    for a in ax:
        a.set_xscale("log", base=2)
        a.set_xlabel("concurrent clients")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url")
    ap.add_argument("--spawn", help="start `woq serve` with these arguments")
    ap.add_argument("--model", default=None, help="model name to send (default: the server's)")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--min-requests", type=int, default=16,
                    help="at least this many requests per level (concurrency 1 and offline: a steadier median)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path("docs/bench"))
    ap.add_argument("--name", default="serving")
    ap.add_argument("--offline", action="store_true", help="with --spawn: also run concurrency 1 in-process")
    a = ap.parse_args()
    proc = None
    url = a.url
    if a.spawn is not None:
        proc, url = spawn(a.spawn)
    paired = None
    try:
        model = a.model or httpx.get(url + "/v1/models").json()["data"][0]["id"]
        # one request first (not measured): lazy initialisation is not a serving cost
        asyncio.run(run_level(url, model, 1, 1, a.prompt_tokens, a.output_tokens))
        rows = []
        for c in [int(v) for v in a.concurrency.split(",")]:
            n = max(c * a.requests_per_client, a.min_requests)
            r = asyncio.run(run_level(url, model, c, n, a.prompt_tokens, a.output_tokens))
            rows.append(r)
            print(json.dumps(r), flush=True)
        if a.offline and a.spawn is not None:
            paired = paired_level(url, model, a.spawn, max(a.requests_per_client, a.min_requests), a.prompt_tokens,
                                  a.output_tokens)
            print(json.dumps(paired), flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    head = ["clients", "requests", "errors", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
            "output tok/s", "req/s", "tok/s per request"]
    table = markdown_table(head, [[r["concurrency"], r["requests"], r["errors"], r["ttft_p50_ms"], r["ttft_p99_ms"],
                                   r["itl_p50_ms"], r["itl_p99_ms"], r["output_tok_per_s"], r["req_per_s"],
                                   r["per_request_tok_per_s"]] for r in rows + list(paired or [])])
    note = (f"model {model}, server args: {a.spawn or url}; prompt ~{a.prompt_tokens} tokens, "
            f"{a.output_tokens} output tokens per request (ignore_eos), streaming over HTTP on loopback.\n\n")
    if paired:
        h, o = (r["per_request_tok_per_s"] for r in paired)
        note += (f"HTTP vs offline at concurrency 1 ({paired[0]['requests']} prompts, each over HTTP and "
                 f"in-process in turn; median tok/s per request incl. TTFT): {h:.1f} vs {o:.1f} = "
                 f"{100 * (h / o - 1):+.1f} %.\n\n")
    write_json(a.out / f"{a.name}.json", {"server": a.spawn or url, "model": model, "rows": rows,
                                          "paired_concurrency_1": paired})
    (a.out / f"{a.name}.md").write_text(note + table + "\n")
    plot(rows, a.out / f"{a.name}.png")
    print(note + table)


if __name__ == "__main__":
    main()
