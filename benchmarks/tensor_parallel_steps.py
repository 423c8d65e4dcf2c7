"""Tensor-parallel decode steps on the GPUs alone: a rank's CUDA-graph decode step timed in
lockstep on every rank, at TP 1, 2, 4, with the all-reduces through the peer buffers, through
NCCL, and skipped (each rank summing nothing: wrong results, the step's time without its
collectives).

Each rank loads its shard of ``--model`` (int4 g128), captures the engine's decode graphs
(``engine.cuda_graphs.DecodeGraphs``; at batch 1 the persistent step, as served: on one GPU,
and across the ranks with the peer buffers) and replays the graph of each batch size 50
times in a row, 7 times; the median per step. Batch 1 is also timed through a kernel per op
(``--decode-step off``'s step, the peer all-reduces between them).
Every row decodes at position ``--context`` of its own KV blocks. Reported per TP size and
batch: tokens/s, the speed-up over TP 1, the scaling efficiency, the fraction of the
per-GPU weight roofline (a rank's weight bytes -- its quantized layers' codes, scales and
zero points and its LM head rows -- / step time / the measured copy bandwidth), and the
collectives' share of the kernel-per-op step ((per-op or peer - skipped) / the same: the
persistent step has no variant without them).

    python benchmarks/tensor_parallel_steps.py --model /tmp/llama3-8b --sizes 1,2,4 --out docs/bench
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from common import gpu_info, markdown_table, on_ranks, save_results  # noqa: E402

REPLAYS, REPS = 50, 7


def _timed(graph, group) -> float:
    """Median seconds per replay of ``graph``, every rank replaying in lockstep."""
    times = []
    for _ in range(REPS):
        dist.barrier(group=group)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPLAYS):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / REPLAYS)
    return statistics.median(times)


def _rank(rank: int, size: int, dev: torch.device, control, a) -> dict:
    from engine import weight_bytes

    from woq.engine.cuda_graphs import DecodeGraphs
    from woq.engine.decode import DecodeRunner
    from woq.kernels import build
    from woq.kernels.options import DecodeStepOptions, RuntimeOptions
    from woq.kernels.peer_all_reduce import PeerAllReduce
    from woq.kernels.timing import measure_copy_bandwidth
    from woq.models.kv_cache import KVCache
    from woq.models.loader import load_model
    from woq.models.quant_config import QuantConfig
    from woq.models.sharding import TensorParallel

    class Skipped(TensorParallel):  # (the step's shapes, no communication)
        def all_reduce(self, y):
            return y

        def all_gather_last(self, x):
            return torch.cat([x] * self.size, dim=-1)

    options = RuntimeOptions()
    peer = PeerAllReduce.open(rank, size, dev, build.load(options), control) if size > 1 else None
    tp = TensorParallel(rank, size, peer=peer) if size > 1 else None
    model = load_model(a.model, QuantConfig("int4"), torch.float16, dev, a.context + 64, progress=False,
                       options=options, tp=tp).model
    bandwidth = measure_copy_bandwidth(dev)
    cfg, batches = model.cfg, [int(b) for b in a.batches.split(",")]
    top = max(batches)
    cache = KVCache(cfg.num_layers, top + 1, cfg.num_kv_heads, a.context + 64, cfg.head_dim, torch.float16, dev)
    g = torch.Generator().manual_seed(0)
    variants = {"peer": tp, "nccl": dataclasses.replace(tp, peer=None), "skipped": Skipped(rank, size)} \
        if size > 1 else {"single": None}
    per_op = dataclasses.replace(options, decode_step=DecodeStepOptions(enabled=False))
    rows = {}
    for name, t in [*variants.items(), ("per-op", variants.get("peer"))]:
        model.tp = t
        model.options = per_op if name == "per-op" else options  # (the step the runner takes at batch 1)
        timed = [1] if name == "per-op" else batches
        graphs = DecodeGraphs(DecodeRunner(model, cache), max(timed), scratch_slot=top)
        graphs.capture()  # (its warm-up builds the persistent step, which batch 1 replays)
        for b in timed:
            ids = torch.randint(0, cfg.vocab_size, (b, 1), generator=g)
            graphs.run(ids.to(dev), torch.full((b, 1), a.context, device=dev), torch.arange(b, device=dev))
            rows[f"{name}/{b}"] = _timed(graphs.graphs[b].graph, control)
        del graphs
        torch.cuda.synchronize()
    return {"steps": rows, "weight_bytes": weight_bytes(model), "bandwidth": bandwidth}


def summary(r: dict) -> str:
    lines = [f"# Tensor-parallel decode steps, {r['model']}, int4 g128, fp16, {r['gpu']}", "",
             f"Median step time of a CUDA-graph decode step replayed {REPLAYS} times in a row on every rank "
             f"({REPS} runs), context {r['context']} a row. At batch 1 the peer column is the persistent step "
             f"(across the ranks at TP > 1), beside the kernel-per-op step. Command: `{r['command']}`.", ""]
    base = r["sizes"].get("1")
    rows = []
    for size, m in r["sizes"].items():
        for b in r["batches"]:
            step = m["steps"][f"peer/{b}" if size != "1" else f"single/{b}"]
            tps = b / step
            speedup = base and tps / (b / base["steps"][f"single/{b}"])
            op = m["steps"].get(f"per-op/{b}")
            per_op = op or step  # (the collectives' share of the kernel-per-op step: "skipped" is one)
            share = (f"{100 * (per_op - m['steps'][f'skipped/{b}']) / per_op:.0f} %" if size != "1" else "")
            nccl = f"{1e3 * m['steps'][f'nccl/{b}']:.3f}" if size != "1" else ""
            rows.append([size, b, f"{1e3 * step:.3f}", f"{1e3 * op:.3f}" if op else "", nccl, f"{tps:.0f}",
                         f"{speedup:.2f}" if speedup else "", f"{speedup / int(size):.2f}" if speedup else "",
                         f"{100 * m['weight_bytes'] / step / m['bandwidth']:.0f} %", share])
    lines.append(markdown_table(["TP", "batch", "step ms (peer)", "kernel per op", "step ms (NCCL)", "tokens/s",
                                 "speed-up", "efficiency", "per-GPU weight roofline",
                                 "collectives' share (kernel per op)"], rows))
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for size, m in r["sizes"].items():
        key = "single" if size == "1" else "peer"
        ax.plot(r["batches"], [b / m["steps"][f"{key}/{b}"] for b in r["batches"]], "o-", label=f"TP {size}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch")
    ax.set_ylabel("decode tokens/s (GPU steps alone)")
    ax.set_title(f"Tensor-parallel decode steps, {r['gpu']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--sizes", default="1,2,4")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--out", type=Path, default=Path("docs/bench"))
    p.add_argument("--name", default="tensor_parallel_steps")
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes.split(",") if int(s) <= torch.cuda.device_count()]
    result = {**gpu_info(), "model": Path(a.model).name, "context": a.context,
              "batches": [int(b) for b in a.batches.split(",")],
              "command": "python benchmarks/tensor_parallel_steps.py " + " ".join(sys.argv[1:]),
              "sizes": {str(s): on_ranks(_rank, s, a) for s in sizes}}
    save_results(a.out, a.name, result, summary, plot)


if __name__ == "__main__":
    main()
