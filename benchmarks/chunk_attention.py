"""The chunk-attention kernel (``kernels/chunk_attention.py``) with and without key splits
(``SPLITS``, every tile's in a launch of up to ``SPLIT_ALL_TOKENS`` rows, else the small tiles'),
on the packed steps of an 8B model (32 query heads, 8 KV heads, head_dim 128, blocks of
16): B decode tokens and a prompt chunk of T tokens, every sequence after ``past`` cached
positions, the packed rows padded to the graph's bucket as ``PackedGraphs`` pads them.

Each call reads another layer's cache of 32 (their keys together are well past L2, as in a
step); µs per call are the median of a CUDA graph of calls (``kernels.timing``). The
memory time is the keys and values the tiles read (each tile its own, a KV head's once for
its query heads) at the measured copy bandwidth. Unsplit launches are also timed under
each of ``WALKS``' keys a step and pipeline stages (``RuntimeOptions.chunk_attention``).

A setting that wins alone still has to win in the step: ``--step`` also times the packed
steps of an 8B int4 g128 model (random weights, packed-graph replays with programmatic
launches, as the engine runs its mixed steps; ``step_budget.packed_rig``) under each
setting of the unsplit launches' walk, alternating them in rounds in one process.

    python benchmarks/chunk_attention.py --out docs/bench
    python benchmarks/chunk_attention.py --step 64/3,64/2,32/3 --out docs/bench
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import alternating_ms, copy_bandwidth, markdown_table, save_results, settings_table  # noqa: E402
from step_budget import packed_rig  # noqa: E402

from woq.engine.cuda_graphs import PackedGraphs, prefill_buckets  # noqa: E402
from woq.kernels.chunk_attention import SPLITS, chunk_attention  # noqa: E402
from woq.kernels.options import ChunkAttentionOptions  # noqa: E402
from woq.kernels.timing import graph_time_us  # noqa: E402
from woq.models.batches import TILE_TOKENS, Chunk, query_tiles  # noqa: E402
from woq.models.builder import bind_kernels  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK, LAYERS = 32, 8, 128, 16, 32
# (decode tokens, prompt tokens, cached positions before each)
CASES = [(0, 16, 1024), (16, 112, 1024), (0, 128, 1024), (64, 64, 1024), (16, 448, 1024), (64, 448, 1024),
         (0, 512, 1024), (16, 0, 1024), (64, 0, 1024), (0, 512, 6144), (16, 112, 6144)]
_DEFAULT_WALK = (ChunkAttentionOptions().keys_per_step, ChunkAttentionOptions().stages)
# (keys a step, stages) of an unsplit launch's walk over the keys; the first, the default's, is the reference
WALKS = [_DEFAULT_WALK] + [w for w in [(64, 2), (64, 3), (32, 3), (32, 2), (128, 2)] if w != _DEFAULT_WALK]
STEP_CASES = ["16+112", "16+448", "64+64", "64+448", "0+128", "0+512"]  # packed steps: B decode + T prompt tokens


def case(decode: int, prompt: int, past: int) -> dict:
    rows = decode + (1 if prompt else 0)
    per_row = -(-(past + max(prompt, 1)) // BLOCK)
    dev, dt = "cuda", torch.float16
    blocks = 1 + rows * per_row
    caches = [(torch.randn(blocks, KV_HEADS, BLOCK, DIM, device=dev, dtype=dt),
               torch.randn(blocks, KV_HEADS, BLOCK, DIM, device=dev, dtype=dt)) for _ in range(LAYERS)]
    table = (torch.randperm(blocks - 1, device=dev)[:rows * per_row] + 1).view(rows, per_row).to(torch.int32)
    chunks = [Chunk(i, 1, i, past) for i in range(decode)]
    if prompt:
        chunks.append(Chunk(decode, prompt, decode, past))
    tokens = decode + prompt
    padded = next(b for b in prefill_buckets(512) if b >= tokens) if tokens <= 512 else tokens
    tiles = query_tiles(chunks, TILE_TOKENS)
    tiles = torch.tensor(tiles + [(padded, 0, 0, 0)] * (padded // TILE_TOKENS + min(padded, 256) - len(tiles)),
                         dtype=torch.int32, device=dev)
    q = torch.randn(padded, HEADS, DIM, device=dev, dtype=dt)
    out = torch.empty_like(q)
    # bytes the tiles read: each tile its sequence's keys and values up to its last token, per KV head
    read = sum((c.start + min(TILE_TOKENS * (j + 1), c.tokens)) for c in chunks
               for j in range(-(-c.tokens // TILE_TOKENS))) * KV_HEADS * DIM * 2 * 2
    us = {}
    launches = [("split", SPLITS, ChunkAttentionOptions())]
    launches += [("unsplit" if i == 0 else f"unsplit {keys}/{stages}", 1, ChunkAttentionOptions(keys, stages))
                 for i, (keys, stages) in enumerate(WALKS)]
    for label, splits, walk in launches:
        calls = [lambda k=k, v=v, s=splits, w=walk: chunk_attention(q, k, v, table, tiles, TILE_TOKENS, out,
                                                                    splits=s, walk=w) for k, v in caches]
        us[label] = graph_time_us(calls, calls=LAYERS, reps=15)
    return {"decode": decode, "prompt": prompt, "past": past, "padded": padded, "bytes": read, "us": us}


def step_ms(settings: list[str], rounds: int = 2) -> dict:
    """{setting: {"B+T": median ms of the packed step}}: the 8B int4 model's packed graphs
    replayed with B decode tokens and a T-token chunk after 1,024 cached positions, the
    unsplit launches' walk set by each setting ("keys/stages") in turn, ``rounds`` times
    over (medians across rounds). Every setting sees the same inputs."""
    model, engine, fill, step = packed_rig(128, 1024 + 512 + 16)
    g = engine.packed_graphs
    base = model.options
    with torch.inference_mode():
        fill()
        inputs = {key: step(*map(int, key.split("+"))) for key in STEP_CASES}
        assert all(g.fits(len(tokens), len(lens)) for tokens, lens, _, _ in inputs.values()), "a step past the graphs"

        def prepare(setting: str) -> dict:
            keys, stages = map(int, setting.split("/"))
            bind_kernels(model, replace(base, chunk_attention=ChunkAttentionOptions(keys, stages)))
            # (new graphs for every setting: a graph keeps the launches it captured)
            graphs = engine.packed_graphs = PackedGraphs(model, engine.cache, g.max_tokens, g.max_chunks,
                                                         g.scratch_slot)
            graphs.capture()
            return {key: lambda a=args: graphs.run(*a) for key, args in inputs.items()}

        return alternating_ms(settings, prepare, rounds)


def run(kernel: bool, step: list[str]) -> dict:
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    if kernel:
        bandwidth = copy_bandwidth()
        results = []
        for decode, prompt, past in CASES:
            r = case(decode, prompt, past)
            r["memory_us"] = r["bytes"] / bandwidth * 1e6
            results.append(r)
            print(r, flush=True)
            torch.cuda.empty_cache()
        out.update(copy_bandwidth=bandwidth, cases=results)
    if step:
        out["step_ms"] = step_ms(step)
    return out


def summary(r: dict) -> str:
    text = kernel_summary(r) if "cases" in r else ""
    if "step_ms" in r:
        text += (f"\nPacked steps, {r['gpu']}: 8B int4 g128 (random weights), fp16, packed-graph replays with "
                 "programmatic launches, B decode tokens and a T-token chunk after 1,024 cached positions; "
                 "settings: keys a step / stages of the unsplit launches. " + settings_table(r["step_ms"], "B+T")
                 + "\n")
    return text


def kernel_summary(r: dict) -> str:
    walks = [f"unsplit {keys}/{stages}" for keys, stages in WALKS[1:]]
    rows = [[c["decode"], c["prompt"], c["past"], c["padded"], f"{c['us']['unsplit']:.1f}", f"{c['us']['split']:.1f}",
             f"{c['us']['unsplit'] / c['us']['split']:.2f}", f"{c['memory_us']:.1f}"]
            + [f"{c['us'][w] / c['us']['unsplit']:.2f}" for w in walks] for c in r["cases"]]
    return (f"GPU: {r['gpu']}, torch {r['torch']}; copy bandwidth {r['copy_bandwidth'] / 1e12:.2f} TB/s. "
            f"Chunk attention of one layer ({HEADS} query heads, {KV_HEADS} KV heads, head_dim {DIM}, blocks of "
            f"{BLOCK}), fp16; µs per call, median of a CUDA graph of {LAYERS} calls over {LAYERS} layers' caches. "
            f"`split`: {SPLITS} key splits of every tile in a launch of up to 128 rows, of the tiles of up "
            "to 4 tokens in a larger one (kernels/chunk_attention.py); memory µs: the keys and values the tiles "
            f"read, at the copy bandwidth. Unsplit launches walk the keys {_DEFAULT_WALK[0]} a step in "
            f"{_DEFAULT_WALK[1]} stages (the default); the last columns: other walks (keys / stages), their time "
            "over that.\n\n"
            + markdown_table(["B decode", "T prompt", "cached", "padded rows", "unsplit µs", "split µs",
                              "speed-up", "memory µs"] + [f"{k}/{st}" for k, st in WALKS[1:]], rows) + "\n")


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "cases" not in r:
        return
    labels = [f"{c['decode']}+{c['prompt']}\n@{c['past']}" for c in r["cases"]]
    x = range(len(labels))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([i - 0.27 for i in x], [c["us"]["unsplit"] for c in r["cases"]], 0.27, label="unsplit")
    ax.bar(list(x), [c["us"]["split"] for c in r["cases"]], 0.27, label="split")
    ax.bar([i + 0.27 for i in x], [c["memory_us"] for c in r["cases"]], 0.27, label="memory time")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("µs per layer")
    ax.set_title(f"{r['gpu']}: chunk attention, B decode + T prompt tokens @ cached positions", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("docs/bench"))
    ap.add_argument("--step", default="", help="keys/stages walks of the unsplit launches to time in the packed "
                    "steps, the first the reference (e.g. 64/3,64/2,32/3)")
    ap.add_argument("--no-kernel", action="store_true", help="skip the kernel's cases")
    args = ap.parse_args()
    step = [s for s in args.step.split(",") if s]
    save_results(args.out, "chunk_attention", run(not args.no_kernel, step), summary, plot)


if __name__ == "__main__":
    main()
