"""Every mixed-GEMM tile configuration x split-K on a few shapes and M, against cuBLAS fp16
(what kernels/tuning.py chooses from, shown whole): python benchmarks/gemm_configs.py
[--shapes 28672x8192,...] [--ms 32,64,128,256] [--configs 2,4] [--formats int4_g128]."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("WOQ_TUNE", "0")  # time every launch explicitly, no plan
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from common import copies_to_defeat_l2, time_calls  # noqa: E402
from kernels import FORMATS, ours  # noqa: E402

from woq.kernels import ops  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default="28672x8192,21504x14336,14336x4096,4096x4096")
    ap.add_argument("--ms", default="32,64,128,256")
    ap.add_argument("--splits", default="1,0")
    ap.add_argument("--configs", default="", help="comma-separated tile configurations (default: all)")
    ap.add_argument("--formats", default="", help="comma-separated formats of benchmarks/kernels.py (default: all)")
    args = ap.parse_args()
    configs = args.configs.split(",") if args.configs else list(map(str, ops.gemm_configs()))
    formats = args.formats.split(",") if args.formats else list(FORMATS)
    if not set(configs) <= set(map(str, ops.GEMM_TILES)) or not set(formats) <= set(FORMATS):
        ap.error(f"formats are {', '.join(FORMATS)}; configs are {', '.join(map(str, ops.GEMM_TILES))}")
    configs, formats = [int(c) for c in configs], {f: FORMATS[f] for f in formats}
    assert ops.available(), "the CUDA kernels failed to build"
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    ms = [int(m) for m in args.ms.split(",")]
    for N, K in shapes:
        w = torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02
        dense = [w.clone() for _ in range(copies_to_defeat_l2(N * K * 2))]
        for fmt, spec in formats.items():
            gws, _ = ours(w, spec, torch.float16, copies_to_defeat_l2(N * K * spec.bits // 8))
            for M in ms:
                x = torch.randn(M, K, device="cuda", dtype=torch.float16)
                cublas = time_calls([lambda d=d: F.linear(x, d) for d in dense])
                res = {}
                for c in configs:
                    for s in map(int, args.splits.split(",")):
                        res[c, s] = time_calls([lambda g=g: ops.gemm(x, g, config=c, splits=s) for g in gws])
                best = min(res, key=res.get)
                print(f"CFG {N}x{K} {fmt} M={M}: cuBLAS {cublas:.1f} best {best} {res[best]:.1f} "
                      f"({cublas / res[best]:.2f}x) | " + " ".join(f"{c}/{s}:{v:.1f}" for (c, s), v in res.items()),
                      flush=True)
        del gws, dense
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
