"""Print the tuning tables on this machine (shipped in kernels/tuned/ and measured in the
cache): per weight shape, the GEMV's launch at each tuned M, the mixed GEMM's launch per M
range, the largest M the GEMV serves and the crossover to dequantize + cuBLAS.

    python benchmarks/dispatch_table.py [--cache DIR]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from woq.kernels.limits import GEMV_STREAM
from woq.kernels.options import RuntimeOptions, default_cache_dir
from woq.kernels.tuning import all_tables


def gemv_cell(launch: list[int]) -> str:
    """A GEMV launch as "k-warps x grid", with "s" before it for the register stream."""
    k_warps, blocks, pipeline = launch
    return ("s" if pipeline == GEMV_STREAM else "") + f"{k_warps}x{blocks}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, default=default_cache_dir())
    args = ap.parse_args()
    options = RuntimeOptions(cache_dir=args.cache)
    measured = sorted(options.tuning_dir().glob("*.json")) if options.tuning_dir().exists() else []
    print("measured on this machine: " + (", ".join(p.stem for p in measured) if measured else
                                          "nothing yet (a GPU measures new shapes at their first load)"))
    for name, table in all_tables(options).items():
        origin = "measured here" if any(p.stem == name for p in measured) else "shipped (kernels/tuned/)"
        print(f"\n{name}: {origin}\n(GEMV: k-warps x grid size, 's': the register-stream pipeline; mixed GEMM: "
              "tile config x split-K, 0: stream-K over one wave; per M range)")
        gemv_ms = sorted({int(m) for e in table.values() for m in e["grids"]})
        ms = sorted({int(m) for e in table.values() for m in e["gemm"]})
        print("| weight (NxK, format, dtype) | " + " | ".join(f"GEMV M<={m}" for m in gemv_ms) + " | "
              + " | ".join(f"GEMM M<={m}" for m in ms) + " | GEMV up to M | kernels up to M |")
        print("|---" * (3 + len(gemv_ms) + len(ms)) + "|")
        for key, e in sorted(table.items()):
            g, p = e["grids"], e["gemm"]
            cells = [gemv_cell(g[str(m)]) if str(m) in g else "-" for m in gemv_ms]
            cells += ["c{}x{}".format(*p[str(m)]) if str(m) in p else "-" for m in ms]
            print(f"| {key} | " + " | ".join(cells) + f" | {e['gemv_max_m']} | {e['max_kernel_m']} |")


if __name__ == "__main__":
    main()
