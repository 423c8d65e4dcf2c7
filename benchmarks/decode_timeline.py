"""What a decode step's GEMVs lose at their boundaries: a block-level timeline (GPU).

Runs on a build with the block trace compiled in (``kernels/csrc/trace.cuh``; the script
asks for it: ``WOQ_NVCC_FLAGS=-DWOQ_TRACE=1``, a JIT build of its own). Every
register-stream GEMV block records, on the GPU's global clock, when it started, when its
wait on the previous kernel returned and when it exited. For the Llama-3-8B-shaped int4
model at batch 1, position 128, replays of the decode step's CUDA graph and of the chain
of its linear layers alone (``profile_decode.linears_alone_us``), each GEMV launch is set
against the GEMV launch before it (per kind, the median over the replays of the median
over the 32 layers):

* span: from the previous GEMV's last block exit to this one's: what it adds to the chain
  (in the step, the norm or attention kernels between the two included);
* its bytes at the measured copy bandwidth (the roofline of that span);
* early: the share of its blocks that started before the previous GEMV ended, i.e. that
  were resident in time to load their first weight chunks before their wait;
* release: from the previous GEMV's last exit to this one's first returned wait;
* body: from its first returned wait to its last exit; tail: last exit - median exit.

    python benchmarks/decode_timeline.py --out docs/bench [--variants "LABEL|LABEL"]

``--variants``: labels of ``profile_decode.ABLATIONS`` to trace the step under too.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("WOQ_NVCC_FLAGS", "-DWOQ_TRACE=1")  # before the kernels load

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_bandwidth, gpu_info, markdown_table, write_json  # noqa: E402
from engine import CONTEXT, configs, random_state  # noqa: E402
from profile_decode import (ABLATIONS, LINEAR_KINDS, decoder_linears, kernel_per_op_step, linear_chain,  # noqa: E402
                            step_inputs)

from woq.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from woq.kernels import ops  # noqa: E402
from woq.models.builder import QuantConfig, build_model  # noqa: E402
from woq.models.kv_cache import KVCache  # noqa: E402

RECORDS = 1 << 17
FIELDS = ("weight", "block", "sm", "grid", "start", "waited", "end")


def linears_of(model) -> dict[int, tuple[str, int, int]]:
    """{packed weight address: (kind, layer, bytes)} of the decoder's GEMV weights."""
    return {lin.gpu.qweight.data_ptr(): (kind, i, lin.gpu.nbytes()) for kind, i, lin in decoder_linears(model)}


def traced(capture, replays: int) -> list[list[dict]]:
    """The blocks' records of each of ``replays`` replays of the graph ``capture()`` builds
    with the trace buffer set (the kernels' parameters take the buffer at capture)."""
    buffer = torch.zeros(1 + RECORDS * 8, dtype=torch.int64, device="cuda")
    if not torch.ops.woq.set_trace_buffer(buffer):
        raise SystemExit("these kernels were built without WOQ_TRACE (WOQ_NVCC_FLAGS=-DWOQ_TRACE=1)")
    try:
        replay = capture()
    finally:
        torch.ops.woq.set_trace_buffer(None)
    for _ in range(20):  # warm (clocks, L2 state like the steady state's)
        replay()
    out = []
    for _ in range(replays):
        buffer[0] = 0
        torch.cuda.synchronize()
        replay()
        torch.cuda.synchronize()
        n = int(buffer[0])
        if n > RECORDS:
            raise SystemExit(f"{n} block records, the buffer holds {RECORDS}")
        rows = buffer[1:1 + 8 * n].view(n, 8)[:, :7].cpu().tolist()
        out.append([dict(zip(FIELDS, r)) for r in rows])
    return out


def launches(records: list[dict], weights: dict[int, tuple[str, int, int]]) -> list[dict]:
    """One entry per GEMV launch, in the order they ran (ns, on the GPU's global clock)."""
    by_weight: dict[int, list[dict]] = {}
    for r in records:
        by_weight.setdefault(r["weight"], []).append(r)
    out = []
    for w, blocks in by_weight.items():
        if w not in weights:
            continue
        kind, layer, nbytes = weights[w]
        starts = sorted(b["start"] for b in blocks)
        ends = sorted(b["end"] for b in blocks)
        waits = sorted(b["waited"] for b in blocks)
        out.append({"kind": kind, "layer": layer, "bytes": nbytes, "blocks": len(blocks), "starts": starts,
                    "first_wait": waits[0], "last_end": ends[-1], "median_end": statistics.median(ends)})
    return sorted(out, key=lambda launch: launch["starts"][0])


def boundaries(launch_list: list[dict], bw: float) -> dict[str, dict]:
    """Per kind, medians over the layers of each launch set against the GEMV before it."""
    rows: dict[str, list[dict]] = {k: [] for k in LINEAR_KINDS}
    for prev, cur in zip(launch_list, launch_list[1:]):
        rows[cur["kind"]].append({
            "span_us": (cur["last_end"] - prev["last_end"]) / 1e3,
            "roofline_us": 1e6 * cur["bytes"] / bw,
            "early": sum(s < prev["last_end"] for s in cur["starts"]) / cur["blocks"],
            "release_us": (cur["first_wait"] - prev["last_end"]) / 1e3,
            "body_us": (cur["last_end"] - cur["first_wait"]) / 1e3,
            "tail_us": (cur["last_end"] - cur["median_end"]) / 1e3,
            "blocks": cur["blocks"]})
    return {k: {f: statistics.median(r[f] for r in v) for f in v[0]} | {"layers": len(v)}
            for k, v in rows.items() if v}


@torch.inference_mode()
def measure(variants: list[str], bw: float, replays: int) -> list[dict]:
    """The step's timeline under each of ``variants`` (ABLATIONS labels), and that of
    its linear layers alone: the kernel-per-op step (the traced GEMVs)."""
    with kernel_per_op_step():
        return _measure(variants, bw, replays)


def _measure(variants: list[str], bw: float, replays: int) -> list[dict]:
    config = configs()["llama3-8b"]
    model = build_model(config, random_state(config), QuantConfig("int4", 128), torch.float16, "cuda", CONTEXT,
                        progress=False)
    cfg = model.cfg
    weights = linears_of(model)
    cache = KVCache(cfg.num_layers, 2, cfg.num_kv_heads, CONTEXT, cfg.head_dim, model.dtype, "cuda")
    ids, pos, slots = step_inputs(model, cache)

    def step_graph():
        graphs = DecodeGraphs(model, cache, 1, scratch_slot=cache.num_slots - 1)
        graphs.capture()
        return lambda: graphs.run(ids, pos, slots)

    def chain_graph():
        run = linear_chain(model, [lin for _, _, lin in decoder_linears(model)])
        run()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        return graph.replay

    runs = [(f"step, {label}", step_graph, label) for label in variants] + [("linears alone", chain_graph, "full step")]
    out = []
    for name, capture, label in runs:
        with ABLATIONS[label](model):
            per_replay = [launches(records, weights) for records in traced(capture, replays)]
        kinds = [boundaries(launch_list, bw) for launch_list in per_replay]
        out.append({"name": name, "replays": replays, "gemvs": len(per_replay[0]),
                    "kinds": {k: {f: statistics.median(r[k][f] for r in kinds) for f in kinds[0][k]} for k in kinds[0]},
                    "first_start_to_last_end_us": statistics.median(
                        (ls[-1]["last_end"] - ls[0]["starts"][0]) / 1e3 for ls in per_replay),
                    "roofline_us": sum(1e6 * launch["bytes"] / bw for launch in per_replay[0])})
        print(name, {k: {f: round(v, 2) for f, v in d.items()} for k, d in out[-1]["kinds"].items()}, flush=True)
    del model, cache
    torch.cuda.empty_cache()
    return out


def summary(result: dict) -> str:
    lines = [f"GPU: {result['gpu']}, torch {result['torch']}; copy bandwidth {result['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s. "
             "Llama-3-8B-shaped int4 g128 random weights, batch 1, position 128; kernels built with the block trace "
             "(`WOQ_NVCC_FLAGS=-DWOQ_TRACE=1`, kernels/csrc/trace.cuh). Each graph traced over "
             f"{result['runs'][0]['replays']} replays; per GEMV kind, the median over the replays of the median over the "
             "layers of each launch set against the GEMV launch before it: span = previous GEMV's last block exit "
             "-> this one's; roofline = its bytes at the copy bandwidth; early = share of its blocks started before the "
             "previous GEMV ended; release = previous GEMV's last exit -> this one's first returned wait; body = first "
             "returned wait -> last exit; tail = last exit - median exit. In the step, the span of qkv and gate_up holds "
             "an add + RMSNorm kernel, that of o the attention kernel. "
             "`python benchmarks/decode_timeline.py`\n"]
    for r in result["runs"]:
        lines.append(f"\n**{r['name']}**: {r['gemvs']} GEMVs, first block start to last exit (median) "
                     f"{r['first_start_to_last_end_us']:.1f} µs, their roofline {r['roofline_us']:.1f} µs\n")
        lines.append(markdown_table(
            ["kind", "blocks", "span µs", "roofline µs", "span - roofline µs", "early %", "release µs", "body µs", "tail µs"],
            [[k, d["blocks"], d["span_us"], d["roofline_us"], d["span_us"] - d["roofline_us"], 100 * d["early"],
              d["release_us"], d["body_us"], d["tail_us"]] for k, d in r["kinds"].items()]))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("docs/bench"))
    ap.add_argument("--variants", default="full step", help="|-separated labels of profile_decode.ABLATIONS")
    ap.add_argument("--replays", type=int, default=15, help="traced replays of each graph (medians over them)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    assert ops.available(), "no CUDA kernels"
    bw = copy_bandwidth()
    result = dict(gpu_info(), bandwidth_bytes_per_s=bw,
                  runs=measure(args.variants.split("|"), bw, args.replays))
    write_json(args.out / "decode_timeline.json", result)
    (args.out / "decode_timeline.md").write_text(summary(result))
    print(summary(result))


if __name__ == "__main__":
    main()
