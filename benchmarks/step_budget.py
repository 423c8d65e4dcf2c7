"""How long a prefill of T tokens holds the GPU, against a decode step: the curve the
engine's prefill token budget (``engine.DEFAULT_PREFILL_TOKENS``) is chosen from.

A running stream waits, at most, for one budgeted prefill between two of its decode steps,
so its inter-token latency p99 is about a decode step plus the prefill of the budget
(chunked: a chunk of a long prompt after a cached earlier part). Measured on a
Llama-3-8B-shaped int4 g128 model (random weights): the packed prefill forward of one
chunk of T tokens that follows 1,024 cached positions, and the decode step (CUDA graph
replay) at batches 1 to 128; medians of CUDA-event timings.

    python benchmarks/step_budget.py --out docs/bench
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown_table, save_results  # noqa: E402
from engine import configs, random_state  # noqa: E402

from woq.engine.engine import Engine  # noqa: E402
from woq.models.batches import Prefill  # noqa: E402
from woq.models.builder import QuantConfig, build_model  # noqa: E402

TOKENS = [16, 32, 64, 128, 256, 384, 512, 768, 1024, 2048, 4096]
BATCHES = [1, 16, 64, 128]
PAST = 1024  # cached positions before the timed chunk


def timed(fn, repeats: int = 7) -> float:
    """Median milliseconds of ``fn`` (CUDA events)."""
    fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def run() -> dict:
    config = configs()["llama3-8b"]
    state = random_state(config)
    context = PAST + max(TOKENS) + 16
    model = build_model(config, state, QuantConfig("int4", 128), torch.float16, "cuda", context, progress=False)
    del state
    torch.cuda.empty_cache()
    engine = Engine(model, None, set(), max_num_seqs=max(BATCHES), max_seq_len=context, max_prefill_tokens=max(TOKENS),
                    prefill_graphs=False)
    cache = engine.cache
    row = 0
    cache.assign(row, 0, list(range(1, 1 + cache.blocks_per_row)))
    per_row = PAST // cache.block_size + 1  # (the decode rows: blocks of their own for PAST + 1 positions)
    first = 1 + cache.blocks_per_row
    assert first + per_row * max(BATCHES) <= cache.num_blocks, "the KV pool is too small for the decode rows"
    for r in range(1, max(BATCHES)):
        cache.assign(r, 0, list(range(first + (r - 1) * per_row, first + r * per_row)))
    gen = torch.Generator().manual_seed(0)
    prefill = {}
    with torch.inference_mode():
        past = torch.randint(0, config.vocab_size, (1, PAST), generator=gen).cuda()
        model(past, Prefill.pack([PAST], [row], "cuda"), cache, last_only=True)
        for t in TOKENS:
            ids = torch.randint(0, config.vocab_size, (1, t), generator=gen).cuda()
            batch = Prefill.pack([t], [row], "cuda", [PAST])
            prefill[t] = timed(lambda: model(ids, batch, cache, last_only=True))
        decode = {}
        for b in BATCHES:
            ids = torch.zeros(b, 1, dtype=torch.long, device="cuda")
            positions = torch.full((b, 1), PAST, dtype=torch.long, device="cuda")
            slots = torch.arange(b, device="cuda")
            decode[b] = timed(lambda: engine.graphs.run(ids, positions, slots))
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "past": PAST,
            "prefill_ms": prefill, "decode_ms": decode}


def summary(r: dict) -> str:
    rows = [[t, f"{ms:.2f}", f"{int(t) / ms:.1f}"] for t, ms in r["prefill_ms"].items()]
    dec = [[b, f"{ms:.2f}"] for b, ms in r["decode_ms"].items()]
    return (f"GPU: {r['gpu']}, torch {r['torch']}. 8B int4 g128 (random weights), fp16. Prefill of one chunk of T "
            f"tokens after {r['past']} cached positions (packed forward, no graph); median of 7, CUDA events.\n\n"
            + markdown_table(["T tokens", "prefill ms", "tokens/ms"], rows) + "\n\nDecode step (graph replay):\n\n"
            + markdown_table(["batch", "step ms"], dec) + "\n")


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ts = [int(t) for t in r["prefill_ms"]]
    ax.plot(ts, list(r["prefill_ms"].values()), marker="o", label="prefill chunk")
    for b, ms in r["decode_ms"].items():
        ax.axhline(ms, ls="--", lw=0.8, label=f"decode step, batch {b}", color=f"C{1 + list(r['decode_ms']).index(b)}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prefill tokens in the step")
    ax.set_ylabel("ms")
    ax.set_title(f"{r['gpu']}: 8B int4, prefill chunk vs decode step", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("docs/bench"))
    args = ap.parse_args()
    save_results(args.out, "step_budget", run(), summary, plot)


if __name__ == "__main__":
    main()
