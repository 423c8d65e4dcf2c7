"""How long one engine step holds the GPU against the tokens in it: the curve the engine's
step token budget (``engine.DEFAULT_PREFILL_TOKENS``) is chosen from.

A step is one packed forward of the running sequences' decode tokens and prompt chunks
(``Engine._mixed_step``), or, with no prompt to prefill, a decode step. A running stream
waits one step between two tokens, so its inter-token latency under load is the time of a
budgeted step. Measured on a Llama-3-8B-shaped int4 g128 model (random weights): B decode
tokens (B = 0, 16, 64, each after 1,024 cached positions) and one chunk of T prompt
tokens after 1,024 cached positions, as a packed-graph replay (up to the graphs' 512
tokens; host preparation included, as the engine pays it) and as the eager forward; and
the decode step (CUDA graph replay) at batches 1 to 128; medians of CUDA-event timings.
For a few of those steps, the kernels of one graph replay by what they do (torch.profiler)
with programmatic launches off, so that a step's time can be split between its GEMMs, its
attention and the rest: launched programmatically, a kernel starts while its predecessor
runs and its profiled time includes that wait.

    python benchmarks/step_budget.py --out docs/bench
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import event_ms as timed, markdown_table, save_results  # noqa: E402
from engine import configs, random_state  # noqa: E402
from profile_decode import kernels_of  # noqa: E402

from woq.engine.cuda_graphs import PackedGraphs  # noqa: E402
from woq.engine.engine import Engine  # noqa: E402
from woq.models.batches import Prefill  # noqa: E402
from woq.models.builder import bind_kernels, build_model  # noqa: E402
from woq.models.quant_config import QuantConfig  # noqa: E402

TOKENS = [16, 32, 64, 112, 128, 192, 240, 256, 384, 448, 512, 1024, 2048]
DECODING = [0, 16, 64]  # decode tokens in the step beside the chunk
BATCHES = [1, 16, 64, 128]
PAST = 1024  # cached positions before every step's tokens
GRAPH_TOKENS = 512
PROFILED = ["0+16", "16+112", "16+128", "0+128", "0+256", "16+448", "64+64", "64+448"]  # kernels listed


def packed_rig(decode_rows: int, context: int):
    """An 8B int4 g128 model (random weights, fp16, CUDA) with an engine whose packed graphs
    take up to ``GRAPH_TOKENS`` tokens: (model, engine, fill, step). ``fill()``
    prefills row 0's ``PAST`` positions; ``step(b, t)`` gives the packed graphs' inputs for
    b decode tokens (rows 1..b, blocks of their own) and a t-token chunk (row 0), all after
    ``PAST`` cached positions."""
    config = configs()["llama3-8b"]
    state = random_state(config)
    model = build_model(config, state, QuantConfig("int4", 128), torch.float16, "cuda", context, progress=False)
    del state
    torch.cuda.empty_cache()
    engine = Engine(model, None, set(), max_num_seqs=decode_rows, max_seq_len=context,
                    max_prefill_tokens=GRAPH_TOKENS)
    cache = engine.cache
    row = 0
    cache.assign(row, 0, list(range(1, 1 + cache.blocks_per_row)))
    per_row = PAST // cache.block_size + 1  # (the decode rows: blocks of their own for PAST + 1 positions)
    first = 1 + cache.blocks_per_row
    assert first + per_row * decode_rows <= cache.num_blocks, "the KV pool is too small for the decode rows"
    for r in range(1, decode_rows):
        cache.assign(r, 0, list(range(first + (r - 1) * per_row, first + r * per_row)))
    gen = torch.Generator().manual_seed(0)

    def fill() -> None:
        past = torch.randint(0, config.vocab_size, (1, PAST), generator=gen).cuda()
        model(past, Prefill.pack([PAST], [row], "cuda"), cache, last_only=True)

    def step(b: int, t: int) -> tuple[list[int], list[int], list[int], list[int]]:
        tokens = torch.randint(0, config.vocab_size, (b + t,), generator=gen).tolist()
        return tokens, [1] * b + [t], list(range(1, b + 1)) + [row], [PAST] * (b + 1)

    return model, engine, fill, step


def run() -> dict:
    model, engine, fill, step = packed_rig(max(BATCHES), PAST + max(TOKENS) + 16)
    cache = engine.cache
    graph, eager = {}, {}
    with torch.inference_mode():
        fill()
        for b in DECODING:
            for t in TOKENS:
                tokens, lens, rows, starts = step(b, t)
                ids = torch.tensor([tokens], device="cuda")
                batch = Prefill.pack(lens, rows, "cuda", starts)
                eager[f"{b}+{t}"] = timed(lambda: model(ids, batch, cache, last_only=True))
                if engine.packed_graphs.fits(b + t, b + 1):
                    graph[f"{b}+{t}"] = timed(lambda: engine.packed_graphs.run(tokens, lens, rows, starts))
        decode = {}
        for b in BATCHES:
            ids = torch.zeros(b, 1, dtype=torch.long, device="cuda")
            positions = torch.full((b, 1), PAST, dtype=torch.long, device="cuda")
            slots = torch.arange(b, device="cuda")
            decode[b] = timed(lambda: engine.graphs.run(ids, positions, slots))
        bind_kernels(model, replace(model.options, programmatic_launch=False))
        # (new graphs on fresh buffers: a capture runs on whatever the buffers hold, and the
        # last replay's chunk ends lie past a smaller graph's tokens)
        g = engine.packed_graphs
        engine.packed_graphs = PackedGraphs(model, cache, g.max_tokens, g.max_chunks, g.scratch_slot)
        engine.packed_graphs.capture()
        plain, kernels = {}, {}
        for key in PROFILED:
            inputs = step(*map(int, key.split("+")))
            plain[key] = timed(lambda: engine.packed_graphs.run(*inputs))
            groups = kernels_of(lambda: engine.packed_graphs.run(*inputs))
            kernels[key] = {g: {"count": v["count"], "us": v["us"]} for g, v in groups.items()}
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "past": PAST,
            "graph_ms": graph, "eager_ms": eager, "decode_ms": decode, "kernels": kernels,
            "graph_plain_ms": plain}


def summary(r: dict) -> str:
    rows = []
    for key, ms in r["eager_ms"].items():
        b, t = key.split("+")
        g = r["graph_ms"].get(key)
        rows.append([b, t, f"{g:.2f}" if g is not None else "-", f"{ms:.2f}"])
    dec = [[b, f"{ms:.2f}"] for b, ms in r["decode_ms"].items()]
    steps = list(r.get("kernels", {}))
    groups = sorted({g for k in steps for g in r["kernels"][k]},
                    key=lambda g: -sum(r["kernels"][k].get(g, {}).get("us", 0) for k in steps))
    split = [[g] + [f"{r['kernels'][k][g]['us'] / 1e3:.2f} ({r['kernels'][k][g]['count']})" if g in r["kernels"][k]
                    else "-" for k in steps] for g in groups]
    split.append(["all kernels"] + [f"{sum(v['us'] for v in r['kernels'][k].values()) / 1e3:.2f}" for k in steps])
    split.append(["graph replay, plain launches"] + [f"{r['graph_plain_ms'][k]:.2f}" for k in steps])
    split.append(["graph replay, programmatic launches"] + [f"{r['graph_ms'][k]:.2f}" for k in steps])
    return (f"GPU: {r['gpu']}, torch {r['torch']}. 8B int4 g128 (random weights), fp16. One step: B decode tokens "
            f"and a chunk of T prompt tokens, all after {r['past']} cached positions; packed-graph replay (host "
            "preparation included) and eager forward; median of 7, CUDA events.\n\n"
            + markdown_table(["B decode", "T prompt", "graph ms", "eager ms"], rows)
            + "\n\nDecode step (graph replay):\n\n" + markdown_table(["batch", "step ms"], dec)
            + "\n\nKernels of one graph replay with plain launches (torch.profiler), ms summed "
            "(kernels), by what they do; columns B+T:\n\n" + markdown_table(["group"] + steps, split) + "\n")


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, b in enumerate(DECODING):
        for kind, style in (("graph_ms", "-"), ("eager_ms", ":")):
            pts = [(int(k.split("+")[1]), ms) for k, ms in r[kind].items() if int(k.split("+")[0]) == b]
            if pts:
                ax.plot(*zip(*pts), style, marker="o", ms=3, color=f"C{i}",
                        label=f"B={b} decode + T prompt, {kind.split('_')[0]}")
    for j, (b, ms) in enumerate(r["decode_ms"].items()):
        ax.axhline(ms, ls="--", lw=0.7, color=f"C{4 + j}", label=f"decode step only, batch {b}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens in the step (T)")
    ax.set_ylabel("step ms")
    ax.set_title(f"{r['gpu']}: 8B int4, one engine step", fontsize=9)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("docs/bench"))
    args = ap.parse_args()
    save_results(args.out, "step_budget", run(), summary, plot)


if __name__ == "__main__":
    main()
