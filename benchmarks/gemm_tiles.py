"""The mixed GEMM at fixed tile configurations, for A/B runs of two kernel versions.

``linear_kernels.py`` times what a layer's plan serves, whose tile the tuner picks per version;
this times the wgmma tiles sized for each M (16 rows: 9 and 5; 32: 5; 64: 6; beyond: 7 and
8; a subset of what the tuner weighs) on Llama-3-8B's layer shapes, int4 g128 with zero points and, for
gate_up, int8 per-channel, fp16, with cuBLAS fp16 on a dense weight of the same shape
beside them: µs per call, the median of 3 CUDA-graph timings over weight copies past 4x L2.

One tree per run (``--tag``: the version's name, written to ``gemm_tiles_<tag>.json``);
alternate the versions on one machine (A, B, A, B: ``ab_files.sh`` or a loop swapping the
files), then ``--report a=A1.json,A2.json b=B1.json,B2.json`` writes ``NAME.md`` / ``.json``
/ ``.png``: each cell's median over a version's runs and the ratio a / b.

    python benchmarks/gemm_tiles.py --tag new --out /tmp/out
    python benchmarks/gemm_tiles.py --report new=a.json,a2.json old=b.json,b2.json --out docs/bench --name NAME
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown_table, write_json  # noqa: E402

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down
MS = [16, 32, 64, 128, 256, 384, 512, 1024]


def configs_at(m: int) -> tuple[int, ...]:
    """The wgmma configurations sized for M rows (the tuner, kernels/tuning.py, weighs these
    and more)."""
    return (9, 5) if m <= 16 else (5,) if m <= 32 else (6,) if m <= 64 else (7, 8)


def measure(tag: str, ms: list[int]) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from common import copies_to_defeat_l2, time_calls
    from woq.kernels import build, ops
    from woq.kernels.format import QuantSpec, quantize
    from woq.kernels.layout import pack_for_gpu
    from woq.kernels.options import RuntimeOptions

    assert build.load(RuntimeOptions()) and ops.wgmma_configs_available(), "needs the sm_90a build (H100/H200)"
    formats = {"int4_g128": QuantSpec(4, 128, False), "int8_pc": QuantSpec(8, None, True)}
    rows = []
    for N, K in SHAPES:
        torch.manual_seed(0)
        w = torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02
        for fmt, spec in formats.items():
            if fmt == "int8_pc" and N != 28672:
                continue
            qw = quantize(w.float(), spec)
            gws = [ops.prepare(pack_for_gpu(qw, torch.float16)) for _ in range(copies_to_defeat_l2(N * K * spec.bits // 8))]
            dense = [w.clone() for _ in range(copies_to_defeat_l2(N * K * 2))] if fmt == "int4_g128" else []
            for M in ms:
                x = torch.randn(M, K, device="cuda", dtype=torch.float16)
                t = {f"c{c}": statistics.median(time_calls([lambda g=g, c=c: ops.gemm(x, g, None, c, 0) for g in gws])
                                                for _ in range(3))
                     for c in configs_at(M)}
                if dense:
                    t["cublas"] = time_calls([lambda W=W: F.linear(x, W) for W in dense])
                rows.append(dict(tree=tag, N=N, K=K, fmt=fmt, M=M, **t))
                print(tag, f"{N}x{K}", fmt, M, "  ".join(f"{k}={v:.1f}" for k, v in t.items()), flush=True)
            del gws, dense
            torch.cuda.empty_cache()
    return rows


def report(sides: dict[str, list[Path]]) -> dict:
    """Cells (shape, format, M, configuration or cublas) with each side's runs and medians."""
    cells: dict[tuple, dict[str, list[float]]] = {}
    for side, paths in sides.items():
        for path in paths:
            for r in json.loads(path.read_text()):
                for k, v in r.items():
                    if k.startswith("c"):
                        key = (r["N"], r["K"], r["fmt"], r["M"], k)
                        cells.setdefault(key, {}).setdefault(side, []).append(v)
    a, b = list(sides)
    out = []
    for (N, K, fmt, M, impl), runs in sorted(cells.items()):
        if a in runs and b in runs:
            ma, mb = statistics.median(runs[a]), statistics.median(runs[b])
            out.append(dict(N=N, K=K, fmt=fmt, M=M, impl=impl, runs=runs, median={a: ma, b: mb}, ratio=ma / mb))
    return {"sides": {s: [p.name for p in ps] for s, ps in sides.items()}, "cells": out}


def summary(r: dict) -> str:
    a, b = list(r["sides"])
    rows = [[f"{c['N']}x{c['K']}", c["fmt"], c["M"], c["impl"],
             " / ".join(f"{v:.1f}" for v in c["runs"][a]), " / ".join(f"{v:.1f}" for v in c["runs"][b]),
             f"{c['ratio']:.3f}"] for c in r["cells"]]
    return (f"Mixed GEMM at fixed tile configurations (`benchmarks/gemm_tiles.py`): µs per call, each run's "
            f"median of 3 CUDA-graph timings over weight copies past 4x L2; `{a}` = runs {', '.join(r['sides'][a])}, "
            f"`{b}` = runs {', '.join(r['sides'][b])}, alternated on one machine. `cublas`: fp16 on a dense "
            f"weight of the same shape, in the same runs (its spread between runs is the power cap's clock).\n\n"
            + markdown_table(["N x K", "format", "M", "config", f"{a} µs", f"{b} µs", f"{a} / {b}"], rows) + "\n")


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a, b = list(r["sides"])
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    series: dict[str, list[tuple[int, float]]] = {}
    for c in r["cells"]:
        if c["impl"] != "cublas":
            series.setdefault(f"{c['N']}x{c['K']} {c['fmt']} {c['impl']}", []).append((c["M"], c["ratio"]))
    for i, (name, pts) in enumerate(sorted(series.items())):
        ax.plot(*zip(*sorted(pts)), marker="o", ms=3, color=f"C{i % 10}", label=name)
    ax.axhline(1.0, color="k", lw=0.7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("M (rows)")
    ax.set_ylabel(f"time {a} / {b}")
    ax.set_title(f"mixed GEMM, fixed tiles: {a} against {b}", fontsize=9)
    ax.legend(fontsize=5, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tag", help="measure this tree under this name")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--report", nargs=2, metavar="SIDE=RUN.json,...", help="compare two versions' runs")
    ap.add_argument("--out", type=Path, default=Path("docs/bench"))
    ap.add_argument("--name", default="gemm_tiles")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report:
        sides = {s.split("=", 1)[0]: [Path(p) for p in s.split("=", 1)[1].split(",")] for s in args.report}
        result = report(sides)
        write_json(args.out / f"{args.name}.json", result)
        (args.out / f"{args.name}.md").write_text(summary(result))
        plot(result, args.out / f"{args.name}.png")
    else:
        rows = measure(args.tag, [int(m) for m in args.ms.split(",")])
        write_json(args.out / f"gemm_tiles_{args.tag}.json", rows)


if __name__ == "__main__":
    main()
