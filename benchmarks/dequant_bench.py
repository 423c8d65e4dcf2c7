"""The dequantize + cuBLAS path taken apart, at one prefill M: the dequantize kernel alone
(µs, and its bytes read + written over the measured copy bandwidth), cuBLAS fp16 on a dense
weight, and the two together as the dispatch runs them. Weights rotate past L2.

cuBLAS at M = 4096 is compute-bound and its clock follows the card's power and heat, which
drift over a run by more than the dequantize costs; so the path and cuBLAS are timed in
alternating rounds and compared per round (the median of the rounds' ratios).
python benchmarks/dequant_bench.py [--shapes 14336x4096,...] [--m 4096] [--rounds 5] [--out DIR]"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("WOQ_TUNE", "0")  # the dequantize path needs no plan
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from common import copies_to_defeat_l2, copy_bandwidth, gpu_info, markdown_table, time_calls, write_json  # noqa: E402
from kernels import FORMATS, ours  # noqa: E402

from woq.kernels import ops  # noqa: E402


def measure_shape(N: int, K: int, M: int, rounds: int, bw: float) -> list[dict]:
    torch.manual_seed(0)
    w = torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    dense = [w.clone() for _ in range(copies_to_defeat_l2(N * K * 2))]
    # What torch's own elementwise kernels reach on the same traffic: a write of the dense
    # weight alone, and an int8 -> fp16 cast (int8 dequantize's 1 : 2 read : write mix).
    fill = time_calls([lambda d=d: d.fill_(1.0) for d in dense])
    q8 = [torch.randint(-128, 127, (N, K), device="cuda", dtype=torch.int8) for _ in dense]
    cast = time_calls([lambda d=d, q=q: d.copy_(q) for d, q in zip(dense, q8)])
    del q8
    weights = {fmt: ours(w, spec, torch.float16, copies_to_defeat_l2(N * K * spec.bits // 8))[0]
               for fmt, spec in FORMATS.items()}
    t: dict[str, list[float]] = {}
    for _ in range(rounds):  # alternate, so a drifting clock meets every variant alike
        t.setdefault("cublas", []).append(time_calls([lambda d=d: F.linear(x, d) for d in dense]))
        for fmt, gws in weights.items():
            t.setdefault(f"dequant {fmt}", []).append(time_calls([lambda g=g: ops.dequantize(g) for g in gws]))
            t.setdefault(f"path {fmt}", []).append(
                time_calls([lambda g=g: ops.run_path(ops.DEQUANT_CUBLAS, x, g, None) for g in gws]))
    rows = []
    for fmt, gws in weights.items():
        moved = gws[0].nbytes() + N * K * 2  # packed weight + scales (+ zeros) in, fp16 out
        dq = statistics.median(t[f"dequant {fmt}"])
        ratios = [p / c for p, c in zip(t[f"path {fmt}"], t["cublas"])]
        rows.append({"N": N, "K": K, "M": M, "format": fmt, "dequant_us": dq, "bytes": moved,
                     "dequant_pct_copy_bw": 100 * moved / bw / (dq * 1e-6), "torch_fill_us": fill,
                     "torch_int8_cast_us": cast, "cublas_us": statistics.median(t["cublas"]),
                     "path_us": statistics.median(t[f"path {fmt}"]), "path_vs_cublas": statistics.median(ratios),
                     "rounds": {"cublas": t["cublas"], "path": t[f"path {fmt}"], "dequant": t[f"dequant {fmt}"]}})
        r = rows[-1]
        print(f"{N}x{K} {fmt} M={M}: dequantize {dq:.1f} us ({r['dequant_pct_copy_bw']:.0f} % of copy bw; torch fill "
              f"{fill:.1f}, int8 cast {cast:.1f}); path / cuBLAS per round: " + " ".join(f"{v:.3f}" for v in ratios)
              + f"; cuBLAS " + " ".join(f"{v:.0f}" for v in t["cublas"]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default="28672x8192,21504x14336,14336x4096,4096x14336,4096x4096")
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    assert ops.available(), "the CUDA kernels failed to build"
    info, bw = gpu_info(), copy_bandwidth()
    print(f"{info['gpu']}: copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    rows = []
    for N, K in (tuple(map(int, s.split("x"))) for s in args.shapes.split(",")):
        rows += measure_shape(N, K, args.m, args.rounds, bw)
        torch.cuda.empty_cache()
    table = markdown_table(
        ["N×K", "M", "format", "dequantize µs", "% copy bw", "torch fill µs", "torch int8 cast µs", "cuBLAS fp16 µs",
         "dequantize + cuBLAS µs", "÷ cuBLAS (median of rounds)"],
        [[f"{r['N']}×{r['K']}", r["M"], r["format"], r["dequant_us"], r["dequant_pct_copy_bw"], r["torch_fill_us"],
          r["torch_int8_cast_us"], r["cublas_us"], r["path_us"], f"{r['path_vs_cublas']:.3f}"] for r in rows])
    print(table)
    if args.out:
        write_json(args.out / "dequant.json", {**info, "copy_bandwidth": bw, "rounds": args.rounds, "rows": rows})
        (args.out / "dequant.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
