"""The kernels of one batch-1 decode step as a CUDA graph replays it (GPU): each kernel's
start and duration, against the step's roofline (where the time outside the layers goes).

Llama-3-8B-shaped int4 g128 random weights (an fp16 LM head), the engine's step (the model,
then its greedy pick: ``engine/sampling.py``'s greedy) captured once per position; µs of the step:
median of CUDA-event-timed replays; its kernels: torch.profiler over the last of 5 replays.

    python benchmarks/step_kernels.py --out docs/bench [--positions 128,192]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_bandwidth, gpu_info, markdown_table, write_json  # noqa: E402
from engine import CONTEXT, bytes_per_token, configs, random_state, weight_bytes  # noqa: E402
from profile_decode import step_inputs  # noqa: E402

from woq.engine.sampling import greedy  # noqa: E402
from woq.models.builder import QuantConfig, build_model  # noqa: E402
from woq.models.kv_cache import KVCache  # noqa: E402
from woq.models.llama import Batch  # noqa: E402


def replay_us(graph: torch.cuda.CUDAGraph, n: int = 50) -> float:
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def step_kernels(model, cache, position: int) -> dict:
    ids, pos, slots = step_inputs(model, cache, position)
    batch = Batch(pos, slots, lengths=pos[:, 0] + 1)
    model(ids, batch, cache, last_only=True)  # (eager first: builds the persistent step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        greedy(model(ids, batch, cache, last_only=True))
    graph.replay()
    torch.cuda.synchronize()
    step = replay_us(graph)
    replays = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    last = events[-(len(events) // replays):]  # (the last replay's kernels)
    t0 = last[0].time_range.start
    kernels = [{"kernel": e.name, "start_us": e.time_range.start - t0, "us": e.time_range.elapsed_us()} for e in last]
    return {"position": position, "graph_step_us": step, "kernels": kernels,
            "span_us": last[-1].time_range.end - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("docs/bench"))
    ap.add_argument("--positions", default="128,192")
    args = ap.parse_args()
    bw = copy_bandwidth()
    config = configs()["llama3-8b"]
    model = build_model(config, random_state(config), QuantConfig("int4", 128), torch.float16, "cuda", CONTEXT,
                        progress=False)
    cfg = model.cfg
    per_token = bytes_per_token(config, weight_bytes(model))
    cache = KVCache(cfg.num_layers, 2, cfg.num_kv_heads, CONTEXT, cfg.head_dim, model.dtype, "cuda")
    results = [step_kernels(model, cache, int(p)) for p in args.positions.split(",")]
    roofline = per_token / bw * 1e6
    text = [f"GPU: {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s: the roofline of a step "
            f"({per_token / 1e9:.3f} GB, engine.md's) is {roofline:.0f} µs. Llama-3-8B-shaped int4 g128 random weights, "
            "fp16 LM head, batch 1 (benchmarks/step_kernels.py)."]
    for r in results:
        rows = [[k["kernel"][:80], k["start_us"], k["us"]] for k in r["kernels"]]
        text.append(f"\n**Position {r['position']}**: graph step {r['graph_step_us']:.1f} µs (median of 50 replays), "
                    f"{100 * roofline / r['graph_step_us']:.1f} % of roofline; one replay's kernels (torch.profiler, "
                    f"span {r['span_us']:.1f} µs):\n\n" + markdown_table(["kernel", "start µs", "µs"], rows))
    write_json(args.out / "step_kernels.json", dict(gpu_info(), copy_bandwidth=bw, roofline_us=roofline,
                                                    results=results))
    (args.out / "step_kernels.md").write_text("\n".join(text) + "\n")
    print("\n".join(text))


if __name__ == "__main__":
    main()
