"""What a decode GEMV costs beyond its bytes when its neighbours are GEMVs of its own shape.

Each case is a CUDA graph of back-to-back calls of one register-stream GEMV (M = 1, int4
g128 with zero points, fp16) over rotated copies of the weight (programmatic launches, as
in a decode step): the time per call, its bandwidth (weights + scales + zero points) and
the fixed cost left after the bytes' time at the measured copy bandwidth. The grids are
the tuner's for Llama-3-8B's shapes, and for gate/up-like shapes whose blocks fill the
SMs evenly (132 and 264 blocks on an H100) or not (224), with and without split-K --
whether an uneven last wave is where the time goes.

    python benchmarks/gemv_chain_cost.py --out docs/bench
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import copies_to_defeat_l2, copy_bandwidth, gpu_info, markdown_table, time_calls, write_json  # noqa: E402

# (label, N, K, k-warps, blocks; 0: the kernel's own count): Llama-3-8B's four decode GEMVs
# at the tuned launch (kernels/tuned) and at others, then N x 4096 at one column of 8
# n-tiles per block
CASES = [("qkv", 6144, 4096, 4, 0), ("o", 4096, 4096, 8, 256), ("gate/up", 28672, 4096, 1, 0),
         ("down", 4096, 14336, 2, 0),
         ("qkv, 96 blocks", 6144, 4096, 2, 96), ("qkv, 384 blocks", 6144, 4096, 8, 0),
         ("o, 128 blocks", 4096, 4096, 4, 0), ("o, 2 k-warps, 128 blocks", 4096, 4096, 2, 128),
         ("down, no split-K", 4096, 14336, 8, 0), ("down, 128 blocks", 4096, 14336, 2, 128),
         ("132 columns, 132 blocks", 16896, 4096, 1, 132), ("132 columns, split-K 2: 264 blocks", 16896, 4096, 1, 264),
         ("224 columns, 224 blocks", 28672, 4096, 1, 224), ("224 columns, split-K 2: 448 blocks", 28672, 4096, 1, 448),
         ("264 columns, 264 blocks", 33792, 4096, 1, 264), ("264 columns, split-K 2: 528 blocks", 33792, 4096, 1, 528)]


def main() -> None:
    from woq.kernels import ops
    from woq.kernels.format import QuantSpec, quantize
    from woq.kernels.layout import pack_for_gpu

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("docs/bench"))
    args = ap.parse_args()
    assert ops.available(), "the CUDA kernels did not build"
    bw = copy_bandwidth()
    torch.manual_seed(0)
    rows = []
    for label, n, k, k_warps, blocks in CASES:
        qw = quantize(torch.randn(n, k, device="cuda") * 0.05, QuantSpec(4, 128, False, scale_dtype=torch.float16))
        first = ops.prepare(pack_for_gpu(qw, torch.float16))
        gws = [first] + [ops.prepare(pack_for_gpu(qw, torch.float16)) for _ in range(copies_to_defeat_l2(first.nbytes()) - 1)]
        x = torch.randn(1, k, device="cuda", dtype=torch.float16)
        us = time_calls([lambda g=g: ops.gemv(x, g, k_warps=k_warps, max_blocks=blocks, pipeline=ops.GEMV_STREAM)
                         for g in gws], calls_per_graph=4 * len(gws))
        nbytes = first.nbytes()
        rows.append(dict(case=label, n=n, k=k, k_warps=k_warps, max_blocks=blocks, us=us, bytes=nbytes,
                         tb_per_s=nbytes / us / 1e6, fixed_us=us - nbytes / bw * 1e6))
        print(rows[-1], flush=True)
        del gws, first
    result = dict(gpu_info(), bandwidth_bytes_per_s=bw, rows=rows)
    write_json(args.out / "gemv_chain_cost.json", result)
    table = markdown_table(["case", "N x K", "k-warps", "blocks asked (0: own)", "µs per call", "TB/s",
                            "µs beyond the bytes' time"],
                           [[r["case"], f"{r['n']} x {r['k']}", r["k_warps"], r["max_blocks"], r["us"],
                             f"{r['tb_per_s']:.2f}", r["fixed_us"]] for r in rows])
    (args.out / "gemv_chain_cost.md").write_text(
        f"GPU: {result['gpu']}, torch {result['torch']}; copy bandwidth {bw / 1e12:.2f} TB/s. Register-stream GEMV, "
        "int4 g128 with zero points, fp16, M = 1. Per call: a CUDA graph of back-to-back calls of the one GEMV over "
        "copies of its weight rotated past L2 (4 rounds, programmatic launches), median of 15 replays; bytes: weights, "
        "scales and zero points; beyond the bytes' time: µs per call - bytes / copy bandwidth. "
        "`python benchmarks/gemv_chain_cost.py`\n\n" + table + "\n")


if __name__ == "__main__":
    main()
