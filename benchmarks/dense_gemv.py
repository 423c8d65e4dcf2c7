"""The dense (unquantized) GEMV against cuBLAS (F.linear) at decode rows (GPU).

Shapes: Llama-3-8B's LM head (128256 x 4096) and fp16 layers, SmolLM2's tied LM head
(49152 x 576). Per shape and M: µs a call (median CUDA-graph replays, weights rotated past
L2: common.time_calls), the read bandwidth (weight bytes / time) and its share of the run's
copy bandwidth (the roofline's ceiling), both kernels in the same run.

    python benchmarks/dense_gemv.py --out docs/bench
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import copies_to_defeat_l2, copy_bandwidth, gpu_info, markdown_table, time_calls, write_json  # noqa: E402

from woq.kernels import ops  # noqa: E402

SHAPES = {  # name: (N, K)
    "llama3-8b lm_head": (128256, 4096),
    "smollm2 lm_head (tied)": (49152, 576),
    "llama3-8b qkv": (6144, 4096),
    "llama3-8b o": (4096, 4096),
    "llama3-8b gate/up": (28672, 4096),
    "llama3-8b down": (4096, 14336),
}


def measure(n: int, k: int, m: int, dtype: torch.dtype) -> dict:
    nbytes = n * k * dtype.itemsize
    ws = [torch.randn(n, k, device="cuda", dtype=dtype) for _ in range(copies_to_defeat_l2(nbytes))]
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    ref = F.linear(x.double(), ws[0].double())
    err = ((ops.dense_gemv(x, ws[0]).double() - ref).norm() / ref.norm()).item()  # (a sanity check, not a test)
    us = {"cublas": time_calls([lambda w=w: F.linear(x, w) for w in ws]),
          "dense_gemv": time_calls([lambda w=w: ops.dense_gemv(x, w) for w in ws])}
    return {"us": us, "tbps": {k_: nbytes / t / 1e6 for k_, t in us.items()}, "rel_err": err}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("docs/bench"))
    ap.add_argument("--rows", default="1,2,4")
    args = ap.parse_args()
    if not ops.available():
        raise SystemExit("the woq CUDA kernels did not load")
    bw = copy_bandwidth()
    dtype = torch.float16
    results, lines = [], []
    for name, (n, k) in SHAPES.items():
        for m in (int(r) for r in args.rows.split(",")):
            if m * k * 4 > ops.DENSE_GEMV_MAX_X_BYTES:
                continue
            r = dict(shape=name, n=n, k=k, m=m, **measure(n, k, m, dtype))
            results.append(r)
            us, tb = r["us"], r["tbps"]
            lines.append([name, m, us["cublas"], us["dense_gemv"], f"{us['cublas'] / us['dense_gemv']:.2f}",
                          f"{tb['cublas']:.2f} ({100 * tb['cublas'] * 1e12 / bw:.0f} %)",
                          f"{tb['dense_gemv']:.2f} ({100 * tb['dense_gemv'] * 1e12 / bw:.0f} %)"])
            print(lines[-1], flush=True)
    info = dict(gpu_info(), copy_bandwidth=bw, dtype=str(dtype), results=results)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "dense_gemv.json", info)
    table = markdown_table(["shape", "M", "cuBLAS µs", "dense GEMV µs", "speed-up",
                            "cuBLAS TB/s (of copy bw)", "dense GEMV TB/s (of copy bw)"], lines)
    (args.out / "dense_gemv.md").write_text(
        f"GPU: {info['gpu']}, torch {info['torch']}, copy bandwidth {bw / 1e12:.2f} TB/s. fp16 weights, µs a call: "
        "median of CUDA-graph replays, weights rotated past L2 (benchmarks/dense_gemv.py).\n\n" + table + "\n")
    plot(results, bw, args.out / "dense_gemv.png")
    print(table)


def plot(results: list[dict], bw: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['shape']}\nM={r['m']}" for r in results]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(results)), 4))
    xs = range(len(results))
    ax.bar([i - 0.2 for i in xs], [r["tbps"]["cublas"] for r in results], 0.4, label="cuBLAS (F.linear)")
    ax.bar([i + 0.2 for i in xs], [r["tbps"]["dense_gemv"] for r in results], 0.4, label="dense GEMV")
    ax.axhline(bw / 1e12, color="k", linestyle="--", linewidth=1, label="copy bandwidth")
    ax.set_xticks(list(xs), labels, fontsize=6, rotation=60, ha="right")
    ax.set_ylabel("weight bytes read, TB/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
