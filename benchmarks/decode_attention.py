"""The decode-attention kernel's launch settings (``kernels/decode_attention.py``: tokens per
tile, software-pipeline stages, key splits) at the batches where it is bandwidth-bound.

The kernel as a decode step runs it (``rope_cache_attention``: q and the new k and v taken
from the qkv projection's row and rotated, the new position cached), with an 8B model's
heads (32 query heads, 8 KV heads, head_dim 128), fp16, blocks of 16 tokens in a shuffled
block table, every sequence ``L`` positions, the last of them the new token's.
For each batch and length, every setting of the grid and the launch's default
(``decode_attention.tiles`` and its split count) is timed; µs per call are the median of a
CUDA graph of calls that rotate over copies of the cache (together past L2, as a step's
32 layers are). The memory time is the keys and values read at the measured copy
bandwidth. Batches of a few sequences are not here: there the kernel sits between two
GEMVs and what it costs is the latency it adds to the step (``profile_decode.py``).

A setting that wins alone still has to win in the decode step: ``--step`` also times the
step of an 8B int4 g128 model (random weights, CUDA graph replays with programmatic
launches, as the engine runs it) at 16-128 sequences of 576 and 1,024 positions under each
setting of the large batches' tiles (``RuntimeOptions.decode_attention``), alternating them
in rounds in one process.

    python benchmarks/decode_attention.py --out docs/bench
    python benchmarks/decode_attention.py --step 32/3,64/3,32/2,128/2 --out docs/bench
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (alternating_ms, copies_to_defeat_l2, copy_bandwidth, markdown_table,  # noqa: E402
                    save_results, settings_table)
from engine import configs, random_state  # noqa: E402

from woq.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from woq.engine.decode import DecodeRunner  # noqa: E402
from woq.kernels.decode_attention import default_launch, rope_cache_attention  # noqa: E402
from woq.kernels.options import DecodeAttentionOptions  # noqa: E402
from woq.kernels.timing import graph_time_us  # noqa: E402
from woq.models.builder import bind_kernels, build_model  # noqa: E402
from woq.models.kv_cache import KVCache  # noqa: E402
from woq.models.quant_config import QuantConfig  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK_SIZE = 32, 8, 128, 16
BATCHES = [8, 16, 32, 64, 128, 256]
LENGTHS = [256, 1024, 4096]
GRID = list(itertools.product([32, 64, 128], [1, 2, 3], [1, 2, 4, 8]))  # (tile tokens, stages, splits)
STEP_BATCHES = [16, 32, 64, 128]
STEP_POSITIONS = [576, 1024]


def case(batch: int, length: int, bandwidth: float) -> dict:
    dev, dt = "cuda", torch.float16
    per_row = math.ceil(length / BLOCK_SIZE)
    kv_bytes = batch * length * KV_HEADS * DIM * 2 * 2
    copies = copies_to_defeat_l2(kv_bytes, cap=8)
    # one pool; each copy's table points at blocks of its own, shuffled
    blocks = 1 + copies * batch * per_row
    k = torch.randn(blocks, KV_HEADS, BLOCK_SIZE, DIM, device=dev, dtype=dt)
    v = torch.randn(blocks, KV_HEADS, BLOCK_SIZE, DIM, device=dev, dtype=dt)
    order = (torch.randperm(blocks - 1, device=dev) + 1).to(torch.int32)
    tables = [order[i * batch * per_row:(i + 1) * batch * per_row].view(batch, per_row).contiguous()
              for i in range(copies)]
    # the step's kernel: q and the new k, v from a qkv row, rotated, the new position cached
    qkv = torch.randn(batch, (HEADS + 2 * KV_HEADS) * DIM, device=dev, dtype=dt)
    slots = torch.arange(batch, device=dev)
    lengths = torch.full((batch,), length, device=dev)
    positions = lengths - 1
    angles = torch.arange(length, device=dev)[:, None] * torch.rand(DIM, device=dev)[None, :]
    cos, sin = angles.cos(), angles.sin()

    def attend(table, **launch):
        return rope_cache_attention(qkv, positions, slots, lengths, cos, sin, k, v, table, HEADS, DIM, **launch)

    def timed(**launch) -> float:
        calls = [lambda t=t: attend(t, **launch) for t in tables]
        return graph_time_us(calls, calls=max(16, copies), reps=15)

    ref = attend(tables[0]).float()
    grid = {}
    for block, stages, splits in GRID:
        out = attend(tables[0], splits=splits, block=block, stages=stages)
        assert (out.float() - ref).abs().max().item() < 1e-2, (batch, length, block, stages, splits)
        grid[f"{block}/{stages}/{splits}"] = timed(splits=splits, block=block, stages=stages)
    block, stages, splits = default_launch(batch, KV_HEADS, qkv.device)
    best = min(grid, key=grid.get)
    return {"batch": batch, "length": length, "memory_us": kv_bytes / bandwidth * 1e6,
            "default": f"{block}/{stages}/{splits}", "default_us": timed(), "best": best, "best_us": grid[best],
            "grid_us": grid}


def step_ms(settings: list[str], rounds: int = 2) -> dict:
    """{setting: {"B@positions": median ms of the decode step}}: the 8B int4 model's step
    replayed as a CUDA graph, the large batches' attention tiles set by each setting
    ("tiles/stages") in turn, ``rounds`` times over (medians across rounds)."""
    config = configs()["llama3-8b"]
    model = build_model(config, random_state(config), QuantConfig("int4", 128), torch.float16, "cuda",
                        max(STEP_POSITIONS) + 16, progress=False)
    torch.cuda.empty_cache()
    rows = max(STEP_BATCHES) + 1  # (the last: the graphs' padding rows)
    cache = KVCache(config.num_hidden_layers, rows, config.num_key_value_heads, max(STEP_POSITIONS) + 16,
                    config.hidden_size // config.num_attention_heads, model.dtype, model.device)
    base = model.options

    def prepare(setting: str) -> dict:
        tile, stages = map(int, setting.split("/"))
        bind_kernels(model, replace(base, decode_attention=DecodeAttentionOptions(tile, stages)))
        graphs = DecodeGraphs(DecodeRunner(model, cache), max(STEP_BATCHES), scratch_slot=rows - 1)
        graphs.capture()
        calls = {}
        for past in STEP_POSITIONS:
            for b in STEP_BATCHES:
                ids = torch.zeros(b, 1, dtype=torch.long, device="cuda")
                positions = torch.full((b, 1), past, dtype=torch.long, device="cuda")
                slots = torch.arange(b, device="cuda")
                calls[f"{b}@{past}"] = lambda a=(ids, positions, slots): graphs.run(*a)
        return calls

    with torch.inference_mode():
        return alternating_ms(settings, prepare, rounds)


def run(kernel: bool, step: list[str]) -> dict:
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    if kernel:
        bandwidth = copy_bandwidth()
        cases = []
        for batch in BATCHES:
            for length in LENGTHS:
                c = case(batch, length, bandwidth)
                print({k: v for k, v in c.items() if k != "grid_us"}, flush=True)
                cases.append(c)
                torch.cuda.empty_cache()
        out.update(copy_bandwidth=bandwidth, cases=cases)
    if step:
        out["step_ms"] = step_ms(step)
    return out


def summary(r: dict) -> str:
    text = ""
    if "cases" in r:
        text += kernel_summary(r)
    if "step_ms" in r:
        text += (f"\nDecode step, {r['gpu']}: 8B int4 g128 (random weights), fp16, CUDA graph replays with "
                 "programmatic launches; settings: tiles / stages of the large batches' attention; rows: B "
                 "sequences @ positions. " + settings_table(r["step_ms"], "B@positions") + "\n")
    return text


def kernel_summary(r: dict) -> str:
    rows = [[c["batch"], c["length"], f"{c['memory_us']:.1f}", c["default"], f"{c['default_us']:.1f}",
             f"{c['memory_us'] / c['default_us']:.2f}", c["best"], f"{c['best_us']:.1f}",
             f"{c['default_us'] / c['best_us']:.2f}"] for c in r["cases"]]
    return (f"GPU: {r['gpu']}, torch {r['torch']}; copy bandwidth {r['copy_bandwidth'] / 1e12:.2f} TB/s. "
            f"Decode attention of one layer ({HEADS} query heads, {KV_HEADS} KV heads, head_dim {DIM}, blocks of "
            f"{BLOCK_SIZE}), fp16, as the decode step runs it (RoPE and the cache write fused), B sequences of L "
            "positions (the last the new token's); µs per call, median of a CUDA graph of calls "
            "over copies of the cache past L2. Settings are tile tokens / stages / splits; `default` is the "
            "launch's own (`decode_attention.default_launch`), `best` the fastest of the grid (tiles 32, 64, "
            "128; stages 1-3; splits 1-8; every setting per case in the JSON). Memory µs: the keys and values "
            "at the copy bandwidth.\n\n"
            + markdown_table(["B", "L", "memory µs", "default", "default µs", "of memory", "best", "best µs",
                              "default / best"], rows) + "\n")


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "cases" not in r:
        return
    fig, axes = plt.subplots(1, len(LENGTHS), figsize=(11, 3.6))
    for ax, length in zip(axes, LENGTHS):
        cs = [c for c in r["cases"] if c["length"] == length]
        x = range(len(cs))
        ax.bar([i - 0.27 for i in x], [c["default_us"] for c in cs], 0.27, label="default")
        ax.bar(list(x), [c["best_us"] for c in cs], 0.27, label="best of the grid")
        ax.bar([i + 0.27 for i in x], [c["memory_us"] for c in cs], 0.27, label="memory time")
        ax.set_xticks(list(x), [str(c["batch"]) for c in cs])
        ax.set_xlabel("batch")
        ax.set_yscale("log")
        ax.set_title(f"L = {length}", fontsize=9)
    axes[0].set_ylabel("µs per layer")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{r['gpu']}: decode attention, 8B heads", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("docs/bench"))
    ap.add_argument("--step", default="", help="tiles/stages settings to time in the decode step, the first the "
                    "reference (e.g. 32/3,64/3)")
    ap.add_argument("--no-kernel", action="store_true", help="skip the kernel's grid")
    args = ap.parse_args()
    step = [s for s in args.step.split(",") if s]
    save_results(args.out, "decode_attention", run(not args.no_kernel, step), summary, plot)


if __name__ == "__main__":
    main()
