"""Serving workloads of the paged KV cache, against servers of other trees or settings.

Each ``--server NAME=ARGS`` (``ARGS``: ``woq serve`` arguments) is started in turn, given
every workload, and stopped; all streamed over HTTP on loopback. Results are merged into
the output's JSON, so that a server of another source tree (the code before a change,
installed in between) can be run by a second invocation on the same machine; each server's
tree (where ``woq`` imports from, as the server is spawned) is printed and recorded, so
that a server that did not run the tree installed for it shows:

* ``c1``: 128-token prompts, 128 out, one client (batch-1 inter-token latency);
* ``p515_c16`` / ``p515_c64``: 515-token prompts, 128 out, 16 / 64 clients;
* ``sustained_c64``: ``p515_c64`` over 512 requests (eight rounds of 64), whose tokens/s is
  also read over the middle half of the run, past the first prompts' ramp and the last
  streams' tail (``middle_half_tok_per_s``);
* ``p6150_c16``: 6,150-token prompts, 256 out, 16 clients;
* ``mixed_c128`` / ``mixed_c256``: prompts of 100 to 4,000 tokens (uniform, seeded), 128
  out, 128 / 256 clients;
* ``chat``: 32 conversations of 8 turns at once, each turn's prompt the whole history
  after a 1,000-token system prompt all share, 64 tokens out a turn; TTFT of the first
  turn and of the later turns (whose history an earlier request prefilled).

``NAME@P`` runs workload NAME with its clients spread over P client processes
(``p515_c16@16``: one client a process; prompts of their own), as separate users' clients
are, instead of one process stamping every stream's chunks.

Prompts of different requests differ from their first token, within a workload and across
workloads (no prefix is shared but the chat's). Writes JSON, a markdown table and a PNG (tokens/s
and ITL p99 against concurrency).

    python benchmarks/paged_serving.py --server "before=--model M --max-batch-size 64"   # (old tree)
    python benchmarks/paged_serving.py --server "after=--model M" --server "no-prefix=--model M --no-prefix-caching"
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown_table, write_json  # noqa: E402
from serving import level_stats, pct, prompt_of, send_all, send_processes, start_server  # noqa: E402
from sse_client import Client, StreamError  # noqa: E402

WORKLOADS = {  # name: (clients, requests, prompt tokens (a range: uniform), output tokens)
    "c1": (1, 8, (128, 128), 128),
    "p515_c16": (16, 48, (515, 515), 128),
    "p515_c64": (64, 128, (515, 515), 128),
    "sustained_c64": (64, 512, (515, 515), 128),
    "p6150_c16": (16, 32, (6150, 6150), 256),
    "mixed_c128": (128, 256, (100, 4000), 128),
    "mixed_c256": (256, 256, (100, 4000), 128),
}


PLOTTED = ("c1", "p515", "mixed")  # (the workloads drawn against concurrency: one prompt shape each level)


def start(name: str, args: str) -> tuple[subprocess.Popen, str]:
    return start_server(args.split(), Path(f"/tmp/paged_serving_{name}.log"))


async def workload(url: str, model: str, clients: int, requests: int, lengths: tuple[int, int], out: int,
                   first: int = 0, processes: int = 1) -> dict:
    """``first``: the number of the first request's prompt; each workload has its own range,
    so that no workload finds another's prompts in a server's prefix cache. ``processes``:
    the client processes the clients are spread over (``serving.send_processes``)."""
    rng = random.Random(0)
    prompts = [prompt_of(rng.randint(*lengths), first + i) for i in range(requests)]
    if processes > 1:
        results, wall = await asyncio.to_thread(send_processes, url, model, clients, prompts, out, processes, 900)
    else:
        results, wall = await send_all(url, model, clients, prompts, out, timeout=900)
    ok = [r for r in results if "error" not in r]
    errors = sorted({r["error"] for r in results if "error" in r})
    stats = level_stats(ok, wall)
    return {"clients": clients, "requests": requests, "client_processes": processes, "errors": len(results) - len(ok),
            "error_kinds": errors[:3], **stats, "middle_half_tok_per_s": middle_half_rate(ok),
            "itl_slow_gaps": slow_gaps(ok, 2e-3 * stats["itl_p50_ms"])}


def middle_half_rate(ok: list[dict]) -> float:
    """Output tokens/s over the middle half of the run (from the first request's first token
    to the last one's last): what a load that never starts or ends would get. The first
    quarter holds the ramp (every client's prompt arriving at once) and the last the tail
    (fewer streams left). A request's tokens are spread evenly over its chunks, since a
    server may send several tokens in one chunk (the slot cache's tree does). NaN with no
    request served, as the other rates' percentiles."""
    if not ok:
        return float("nan")
    t0, t1 = min(r["stamps"][0] for r in ok), max(r["stamps"][-1] for r in ok)
    lo, hi = t0 + (t1 - t0) / 4, t1 - (t1 - t0) / 4
    tokens = sum(r["tokens"] * sum(lo <= s < hi for s in r["stamps"]) / len(r["stamps"]) for r in ok)
    return tokens / (hi - lo) if hi > lo else 0.0


def slow_gaps(ok: list[dict], threshold: float) -> dict:
    """Where the streams' gaps longer than ``threshold`` seconds lie: a stream's first gap
    (after its first token), its last, or between; their mean length, ms; and the first 64
    of them as (gap index in its stream, ms), which shows a period if they have one."""
    slow = [(i, len(r["itl"]), x) for r in ok for i, x in enumerate(r["itl"]) if x > threshold]
    return {"threshold_ms": 1e3 * threshold, "count": len(slow), "gaps": sum(len(r["itl"]) for r in ok),
            "first": sum(1 for i, _, _ in slow if i == 0), "last": sum(1 for i, n, _ in slow if 0 < i == n - 1),
            "mean_ms": 1e3 * sum(x for _, _, x in slow) / len(slow) if slow else 0.0,
            "at": [(i, round(1e3 * x, 2)) for i, _, x in slow[:64]]}


async def chat_turn(client: Client, model: str, messages: list[dict], out: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": out, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    first, text = None, []
    try:
        events = await client.stream("/v1/chat/completions", body)
    except StreamError as exc:
        return {"error": str(exc)}
    for stamp, chunk in events:
        delta = chunk["choices"][0]["delta"] if chunk["choices"] else {"role": None}
        if "role" not in delta:  # (a chunk per token after the role's: its content maybe empty)
            first = first or stamp
            text.append(delta.get("content") or "")
    if first is None:
        return {"error": "no tokens"}
    return {"ttft": first - t0, "text": "".join(text)}


async def chat(url: str, model: str, conversations: int = 32, turns: int = 8, out: int = 64) -> dict:
    system = prompt_of(1000, 10_000)  # (one system prompt for every conversation)
    ttft: dict[int, list[float]] = {t: [] for t in range(turns)}
    errors: list[str] = []

    async def conversation(c: int):
        client = Client(url, 900)  # (a conversation's own connection)
        messages = [{"role": "system", "content": system}]
        try:
            for t in range(turns):
                messages.append({"role": "user", "content": f"Turn {t} of chat {c}: " + prompt_of(40, 100 * c + t)})
                r = await chat_turn(client, model, messages, out)
                if "error" in r:
                    errors.append(r["error"])
                    return
                ttft[t].append(r["ttft"])
                messages.append({"role": "assistant", "content": r["text"]})
        finally:
            client.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(conversation(c) for c in range(conversations)))
    wall = time.perf_counter() - t0
    later = [x for t in range(1, turns) for x in ttft[t]]
    return {"conversations": conversations, "turns": turns, "errors": len(errors), "error_kinds": sorted(set(errors))[:3],
            "wall_s": wall, "ttft_first_turn_p50_ms": 1e3 * pct(ttft[0], 0.5),
            "ttft_later_turns_p50_ms": 1e3 * pct(later, 0.5), "ttft_later_turns_p99_ms": 1e3 * pct(later, 0.99),
            "ttft_by_turn_p50_ms": [1e3 * pct(ttft[t], 0.5) for t in range(turns)]}


def metrics_text(url: str) -> str:
    try:
        return httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return ""


def metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def labelled(text: str, series: str, label: str) -> dict[str, float]:
    """Each sample of ``series`` (a metric name up to its labels) by its ``label``'s value."""
    out = {}
    for line in text.splitlines():
        if line.startswith(series + "{"):
            out[line.split(f'{label}="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    return out


def iteration_buckets(text: str) -> dict[str, dict[str, float]]:
    """``woq_engine_iteration_seconds``' cumulative buckets by kind: {kind: {le: count}}."""
    out: dict[str, dict[str, float]] = {}
    series = "woq_engine_iteration_seconds_bucket{"
    for line in text.splitlines():
        if line.startswith(series):
            labels = dict(part.split("=", 1) for part in line[len(series):line.index("}")].split(","))
            out.setdefault(labels["kind"].strip('"'), {})[labels["le"].strip('"')] = float(line.rsplit(" ", 1)[1])
    return out


def step_counters(url: str) -> dict:
    """The server's step counters so far, from one scrape: the steps that prefilled prompt
    tokens, those tokens, the steps by their prompt tokens' upper bound (cumulative:
    ``woq_step_prompt_tokens``), and the engine's iterations, their seconds and their
    cumulative buckets by kind (``woq_engine_iteration_seconds``)."""
    text = metrics_text(url)
    return {"steps": metric(text, "woq_step_prompt_tokens_count") or 0.0,
            "tokens": metric(text, "woq_step_prompt_tokens_sum") or 0.0,
            "buckets": labelled(text, "woq_step_prompt_tokens_bucket", "le"),
            "iterations": labelled(text, "woq_engine_iteration_seconds_count", "kind"),
            "iteration_seconds": labelled(text, "woq_engine_iteration_seconds_sum", "kind"),
            "iteration_buckets": iteration_buckets(text)}


def steps_by_size(before: dict[str, float], after: dict[str, float], scale: float = 1.0) -> dict[str, float]:
    """Steps between two readings of cumulative buckets, by their upper bound times
    ``scale``: "<=16" holds steps of 1-16 prompt tokens, "<=32" of 17-32, ...; with scale
    1000, iterations by milliseconds (the cumulative buckets differenced)."""
    out, below = {}, 0.0
    for le in sorted(after, key=lambda le: float(le)):
        total = after[le] - before.get(le, 0.0)
        label = "more" if le == "+Inf" else f"<={float(le) * scale:g}"
        out[label] = total - below
        below = total
    return out


def bucket_quantile(by_bucket: dict[str, float], q: float) -> str:
    """The bucket (a label of ``steps_by_size``, in its order) that holds the q-quantile of
    the counted values: an upper bound on that quantile."""
    total, seen = sum(by_bucket.values()), 0.0
    for label, n in by_bucket.items():
        seen += n
        if total and seen >= q * total:
            return label
    return "-"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, server in result["servers"].items():
        for procs in sorted({w.get("client_processes", 1) for w in server["workloads"].values()}):
            rows = [(w["clients"], w) for k, w in server["workloads"].items()
                    if k.startswith(PLOTTED) and "clients" in w and w.get("client_processes", 1) == procs]
            rows.sort(key=lambda x: x[0])
            if not rows:
                continue
            label = name if procs == 1 else f"{name}, {procs} client processes"
            a.plot([c for c, _ in rows], [w["output_tok_per_s"] for _, w in rows], marker="o", label=label)
            b.plot([c for c, _ in rows], [w["itl_p99_ms"] for _, w in rows], marker="o", label=label)
    for ax, title in ((a, "output tokens/s"), (b, "inter-token latency p99 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    ran = {k for server in result["servers"].values() for k in server["workloads"]}
    plotted = [k for k in WORKLOADS if k.startswith(PLOTTED) and any(r.partition("@")[0] == k for r in ran)]
    shapes = ", ".join(f"{'-'.join(map(str, sorted(set(WORKLOADS[k][2]))))} ({WORKLOADS[k][0]})" for k in plotted)
    fig.suptitle(f"{result['gpu']}: prompt tokens (clients): {shapes}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# The columns of the steps-by-prompt-tokens summary (woq_step_prompt_tokens's buckets)
SIZE_GROUPS = [("<=16", "<=32", "<=64"), ("<=128",), ("<=256",), ("<=512",),
               ("<=1024", "<=2048", "<=4096", "<=8192", "more")]


def workload_keys(result: dict) -> list[str]:
    """The workloads the servers ran (chat apart), in ``WORKLOADS``' order, each after its
    one-process run."""
    ran = {k for server in result["servers"].values() for k in server["workloads"] if k != "chat"}
    return sorted(ran, key=lambda k: (list(WORKLOADS).index(k.partition("@")[0]), int(k.partition("@")[2] or 1)))


def summary(result: dict) -> str:
    names = list(result["servers"])
    rows = []
    for w in workload_keys(result):
        for n in names:
            r = result["servers"][n]["workloads"].get(w)
            if r is None:
                continue
            per_step = f"{r['prompt_tokens_per_step']:.0f}" if "prompt_tokens_per_step" in r else "-"
            by = r.get("prompt_steps_by_tokens", {})
            sizes = (" / ".join(f"{sum(v for k, v in by.items() if k in group):.0f}" for group in SIZE_GROUPS)
                     if by else "-")
            it = r.get("iterations", {})
            kinds = " / ".join(f"{it[k]['count']:.0f} × {it[k]['mean_ms']:.1f}" if k in it else "-"
                               for k in ("decode", "mixed", "prefill")) if it else "-"
            decode = it.get("decode", {})
            decode_pct = f"{decode['p50_ms']} / {decode['p99_ms']}" if "p99_ms" in decode else "-"
            sg = r.get("itl_slow_gaps")
            slow = f"{sg['count']} of {sg['gaps']} ({sg['first']} / {sg['last']}), {sg['mean_ms']:.1f}" if sg else "-"
            mid = f" / {r['middle_half_tok_per_s']:.0f}" if "middle_half_tok_per_s" in r else ""
            rows.append([w, n, f"{r['output_tok_per_s']:.0f}{mid}", f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f}",
                         f"{r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f}",
                         f"{r['itl_p99_ms'] / r['itl_p50_ms']:.2f}" if r["itl_p50_ms"] else "-",
                         slow, per_step, sizes, kinds, decode_pct, str(r["errors"])])
    text = [f"GPU: {result['gpu']}. Streamed over HTTP on loopback; servers: "
            + "; ".join(f"`{n}`: `{result['servers'][n]['args']}`" for n in names) + ".\n",
            markdown_table(["workload", "server", "output tok/s (whole run / its middle half)", "TTFT p50 / p99 ms",
                            "ITL p50 / p99 ms", "ITL p99 / p50", "gaps > 2x p50 (first / last of a stream), mean ms",
                            "prompt tokens / step",
                            "steps by prompt tokens: 1-64 / 65-128 / 129-256 / 257-512 / more",
                            "iterations decode / mixed / prefill: count × mean ms",
                            "decode iterations p50 / p99: bucket, ms", "errors"], rows)]
    chats = [(n, result["servers"][n]["workloads"].get("chat")) for n in names]
    chats = [(n, c) for n, c in chats if c]
    if chats:
        text.append("\nMulti-turn chat: 32 conversations x 8 turns at once, a 1,000-token shared system prompt, "
                    "64 tokens a turn.\n")
        text.append(markdown_table(["server", "TTFT turn 1 p50 ms", "TTFT turns 2-8 p50 / p99 ms", "errors"],
                                   [[n, f"{c['ttft_first_turn_p50_ms']:.0f}",
                                     f"{c['ttft_later_turns_p50_ms']:.0f} / {c['ttft_later_turns_p99_ms']:.0f}",
                                     str(c["errors"])] for n, c in chats]))
    counters = [[n, *(str(result["servers"][n]["metrics"].get(k)) for k in ("preemptions", "hit_ratio"))]
                for n in names]
    text.append("\n" + markdown_table(["server", "preemptions", "prefix-cache hit ratio (tokens)"], counters))
    return "\n".join(text)


def served_tree() -> str:
    """The source tree a server started from here runs: where ``woq``'s kernels import from
    in a child process of this directory, as ``woq serve`` is spawned (an editable install of
    another tree has been seen not to take from a checkout's root)."""
    code = "import os, woq.kernels; print(os.path.dirname(os.path.dirname(os.path.abspath(woq.kernels.__file__))))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", action="append", required=True, help="NAME=woq serve arguments")
    ap.add_argument("--workloads", default=",".join([*WORKLOADS, "chat"]),
                    help="comma-separated; NAME@P spreads the clients of NAME over P processes")
    ap.add_argument("--model-name", default="bench")
    ap.add_argument("--out", type=Path, default=Path("docs/bench"))
    ap.add_argument("--name", default="paged_serving")
    args = ap.parse_args()
    import torch

    path = args.out / f"{args.name}.json"
    result = json.loads(path.read_text()) if path.exists() else {}
    result.setdefault("gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    result.setdefault("servers", {})
    chosen = args.workloads.split(",")
    for spec in args.server:
        name, serve_args = spec.split("=", 1)
        serve_args += f" --served-model-name {args.model_name}"
        tree = served_tree()
        print(f"[{name}] serves the tree at {tree}", flush=True)
        t0 = time.perf_counter()
        proc, url = start(name, serve_args)
        entry = result["servers"][name] = {"args": serve_args, "tree": tree, "start_s": time.perf_counter() - t0,
                                           "workloads": {}}
        try:
            for w in chosen:
                t1 = time.perf_counter()
                before = step_counters(url)
                if w == "chat":
                    r = asyncio.run(chat(url, args.model_name))
                else:
                    base, _, procs = w.partition("@")
                    processes = int(procs or 1)
                    # (each workload its own prompts; so each run of it in more processes)
                    first = 1000 * list(WORKLOADS).index(base) + (100_000 * processes if processes > 1 else 0)
                    r = asyncio.run(workload(url, args.model_name, *WORKLOADS[base], first=first,
                                             processes=processes))
                after = step_counters(url)
                # how the server cut the prompts: steps that prefilled any, their mean tokens
                # and how many took how many
                r["prompt_steps"] = after["steps"] - before["steps"]
                r["prompt_tokens_per_step"] = (after["tokens"] - before["tokens"]) / max(r["prompt_steps"], 1)
                r["prompt_steps_by_tokens"] = steps_by_size(before["buckets"], after["buckets"])
                # the engine's iterations by kind: how many, and their mean wall time
                r["iterations"] = {}
                for kind, count in after["iterations"].items():
                    n = count - before["iterations"].get(kind, 0.0)
                    seconds = after["iteration_seconds"][kind] - before["iteration_seconds"].get(kind, 0.0)
                    by_ms = steps_by_size(before["iteration_buckets"].get(kind, {}),
                                          after["iteration_buckets"].get(kind, {}), scale=1e3)
                    # (the p50 / p99 as bucket bounds: the engine's share of a stream's slow gaps)
                    r["iterations"][kind] = {"count": n, "mean_ms": 1e3 * seconds / max(n, 1), "by_ms": by_ms,
                                             "p50_ms": bucket_quantile(by_ms, 0.5),
                                             "p99_ms": bucket_quantile(by_ms, 0.99)}
                entry["workloads"][w] = r
                print(f"[{name}] {w} ({time.perf_counter() - t1:.0f} s): {json.dumps(r)[:400]}", flush=True)
            text = metrics_text(url)
            q = metric(text, "woq_prefix_cache_query_tokens_total")
            entry["metrics"] = {"preemptions": metric(text, "woq_preemptions_total"),
                                "hit_ratio": None if not q else round(metric(text, "woq_prefix_cache_hit_tokens_total") / q,
                                                                      3)}
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        write_json(path, result)  # (after each server: a later failure keeps these)
    (args.out / f"{args.name}.md").write_text(summary(result) + "\n")
    plot(result, args.out / f"{args.name}.png")
    print(summary(result))


if __name__ == "__main__":
    main()
