"""Kernel benchmark on the GPU: the woq kernels against their peers, in one run.

For each weight shape W[N, K] (nn.Linear layout) and M: what a layer's kernel plan runs
(``kernels/plans.py``: its path and measured launch from the tuning table; int4 g128 with
zeros, int8 per-channel; fp16 and bf16 activations), cuBLAS fp16/bf16 (F.linear), torch
tinygemm int4 g128 (bf16), and gemlite / bitsandbytes when installed. Each figure is the
median microseconds per call of a CUDA graph of 20 calls rotating over enough weight
copies to exceed 4x L2. Roofline = bytes that must move (weights + scales/zeros + x + y) /
the measured copy bandwidth.

    python benchmarks/linear_kernels.py --out docs/bench             # M = 1..16: kernels.*
    python benchmarks/linear_kernels.py --m-sweep --out docs/bench   # every path over M: kernels_msweep.*
    python benchmarks/linear_kernels.py --merge-msweeps A.json B.json --out docs/bench
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import copies_to_defeat_l2, copy_bandwidth, gpu_info, markdown_table, time_calls, write_json  # noqa: E402

from woq.kernels import build, ops, plans  # noqa: E402
from woq.kernels.format import QuantSpec, quantize  # noqa: E402
from woq.kernels.options import RuntimeOptions  # noqa: E402
from woq.kernels.plans import KernelPlan  # noqa: E402

SHAPES = [(28672, 8192), (21504, 14336), (14336, 4096), (4096, 14336), (4096, 4096)]
MS = [1, 2, 4, 8, 16]
FORMATS = {"int4_g128": QuantSpec(4, 128, False), "int8_channel": QuantSpec(8, None, True)}


def io_bytes(M: int, N: int, K: int) -> int:
    return 2 * M * K + 2 * M * N


class Peers:
    """The alternatives a user could run instead, built once per shape."""

    def __init__(self, w: torch.Tensor, copies: int):
        N, K = w.shape
        self.dense16 = [w.clone() for _ in range(max(2, min(copies, copies_to_defeat_l2(N * K * 2))))]
        self.dense_bf16 = [t.to(torch.bfloat16) for t in self.dense16]
        self.tiny = self._tinygemm(w, copies)
        self.gl4, self.gl8 = self._gemlite(w, copies)
        self.bnb = self._bnb(w, copies)

    @staticmethod
    def _tinygemm(w, copies):
        try:
            N, K = w.shape
            g = 128
            wf = w.float().reshape(N, K // g, g)
            mx, mn = wf.amax(-1, keepdim=True), wf.amin(-1, keepdim=True)
            sc = (mx - mn).clamp(min=1e-6) / 15
            q = ((wf - mn) / sc).round().clamp(0, 15).to(torch.int32).reshape(N, K)
            zeros = mn + 8 * sc  # tinygemm: w = (q - 8) * scale + zero
            sz = torch.cat([sc.reshape(N, K // g, 1), zeros.reshape(N, K // g, 1)], -1)
            sz = sz.transpose(0, 1).contiguous().to(torch.bfloat16)
            packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), 8)
            return [(packed.clone(), sz) for _ in range(copies)]
        except Exception as exc:
            print("tinygemm unavailable:", repr(exc)[:200])
            return []

    @staticmethod
    def _gemlite(w, copies):
        try:
            from gemlite.helper import A16W8_INT8, A16Wn
        except Exception as exc:
            print("gemlite unavailable:", repr(exc)[:200])
            return [], []
        N, K = w.shape
        g = 128
        wf = w.float().reshape(N, K // g, g)
        mx, mn = wf.amax(-1, keepdim=True), wf.amin(-1, keepdim=True)
        sc = (mx - mn).clamp(min=1e-6) / 15
        zq = -mn / sc
        q = (wf / sc + zq).round().clamp(0, 15).to(torch.uint8).reshape(N, K)
        n = min(copies, 16)
        gl4 = [A16Wn(device="cuda", dtype=torch.float16).from_weights(q.clone(), sc.reshape(N, -1).half(),
                                                                      zq.reshape(N, -1).half(), 4, g) for _ in range(n)]
        gl8 = [A16W8_INT8(device="cuda", dtype=torch.float16).from_weights(w.clone()) for _ in range(n)]
        return gl4, gl8

    @staticmethod
    def _bnb(w, copies):
        try:
            import bitsandbytes as bnb
            import bitsandbytes.functional as bnbF
        except Exception as exc:
            print("bitsandbytes unavailable:", repr(exc)[:200])
            return []
        return [(bnb, *bnbF.quantize_4bit(w.clone(), quant_type="nf4", blocksize=64)) for _ in range(min(copies, 16))]

    def timings(self, x16: torch.Tensor, others: bool = True) -> dict[str, float]:
        """µs per call of cuBLAS fp16/bf16 and, with ``others``, of every installed peer."""
        xb = x16.to(torch.bfloat16)
        out = {
            "cublas_fp16": time_calls([lambda W=W: F.linear(x16, W) for W in self.dense16]),
            "cublas_bf16": time_calls([lambda W=W: F.linear(xb, W) for W in self.dense_bf16]),
        }
        if not others:
            return out
        if self.tiny:
            out["tinygemm_int4_bf16"] = time_calls(
                [lambda p=p, z=z: torch._weight_int4pack_mm(xb, p, 128, z) for p, z in self.tiny])
        peers = {"gemlite_w4_fp16": [lambda L=L: L(x16) for L in self.gl4],
                 "gemlite_w8_fp16": [lambda L=L: L(x16) for L in self.gl8],
                 "bnb_nf4_fp16": [lambda b=b, q=q, s=s: b.matmul_4bit(x16, q.t(), quant_state=s) for b, q, s in self.bnb]}
        for name, calls in peers.items():
            if not calls:
                continue
            try:  # a peer that cannot run (or be captured in a graph) at this M is left out, with why
                out[name] = time_calls(calls)
            except Exception as exc:
                print(f"{name} M={x16.shape[0]} failed:", repr(exc)[:200])
        return out


def ours(w: torch.Tensor, spec: QuantSpec, dtype: torch.dtype, copies: int,
         options: RuntimeOptions) -> list[KernelPlan]:
    """``copies`` kernel plans of ``w`` quantized as ``spec`` (for rotation), each with the
    launches measured for its shape (the tuning table; measured now if new)."""
    qw = quantize(w.float(), QuantSpec(spec.bits, spec.group_size, spec.symmetric))
    return [plans.kernel_plan(qw, None, dtype, False, options) for _ in range(copies)]


def gemv_calls(x: torch.Tensor, kps: list[KernelPlan]) -> list:
    """The GEMV at the launch the plans measured for ``x``'s rows, whichever path they serve there."""
    k_warps, blocks, pipeline = plans.measured_gemv(kps[0].grids, x.shape[0], ops.limits().stream_max_m)
    return [lambda p=p: ops.gemv(x, p.gw, None, blocks, k_warps, pipeline) for p in kps]


def time_plain(calls, options: RuntimeOptions) -> float:
    """``time_calls`` with our kernels launched plainly, as the peers are (the library's
    launch attribute is process-wide; a graph keeps the launches it captured)."""
    build.load(replace(options, programmatic_launch=False))
    try:
        return time_calls(calls)
    finally:
        build.load(options)


def run(shapes, ms, out_dir: Path, dtypes, options: RuntimeOptions) -> dict:
    info = gpu_info()
    bw = copy_bandwidth()
    print(f"{info['gpu']}: copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    rows = []
    for N, K in shapes:
        torch.manual_seed(0)
        w = torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02
        copies = copies_to_defeat_l2(N * K // 2)
        peers = Peers(w, copies)
        packs = {}
        for fmt, spec in FORMATS.items():
            for dtype in dtypes:
                c = copies_to_defeat_l2(N * K * spec.bits // 8)
                packs[(fmt, dtype)] = ours(w, spec, dtype, c, options)
        for M in ms:
            x16 = torch.randn(M, K, device="cuda", dtype=torch.float16)
            t = peers.timings(x16)
            for (fmt, dtype), kps in packs.items():
                x = x16.to(dtype)
                name = f"woq_{fmt}_{str(dtype).split('.')[-1]}"
                wbytes = kps[0].gw.nbytes()
                roof = (wbytes + io_bytes(M, N, K)) / bw * 1e6
                # What a layer serves: its plan's path and launch at M rows (the GEMV, or the
                # mixed GEMM where the tuning table gives it these rows); then also the GEMV
                # itself where it is not the one served.
                path = kps[0].path(M)
                calls = [lambda p=p: p(x) for p in kps]
                t[name] = time_calls(calls)
                rows.append(dict(N=N, K=K, M=M, impl=name, us=t[name], roof_us=roof, bytes=wbytes, path=path))
                if path != plans.GEMV and M <= ops.gemv_rows_limit(kps[0].gw):
                    t[name + "_gemv"] = time_calls(gemv_calls(x, kps))
                    rows.append(dict(N=N, K=K, M=M, impl=name + "_gemv", us=t[name + "_gemv"], roof_us=roof,
                                     bytes=wbytes, path=plans.GEMV))
                if dtype == torch.float16:  # the same calls without programmatic launches
                    t[name + "_plain"] = time_plain(calls, options)
                    rows.append(dict(N=N, K=K, M=M, impl=name + "_plain", us=t[name + "_plain"], roof_us=roof,
                                     bytes=wbytes))
            for name in [k for k in t if not k.startswith("woq_")]:
                rows.append(dict(N=N, K=K, M=M, impl=name, us=t[name]))
            line = "  ".join(f"{k}={v:.1f}" for k, v in t.items())
            print(f"N={N} K={K} M={M}: {line}", flush=True)
        del peers, packs
        torch.cuda.empty_cache()
    result = dict(info, bandwidth_bytes_per_s=bw, rows=rows)
    write_json(out_dir / "kernels.json", result)
    (out_dir / "kernels.md").write_text(summary(result))
    plot(result, out_dir / "kernels.png")
    return result


def _get(rows, N, K, M, impl):
    r = [x for x in rows if (x["N"], x["K"], x["M"], x["impl"]) == (N, K, M, impl)]
    return r[0] if r else None


def peer_margins(margins: dict[str, list[tuple[float, str]]]) -> str:
    """One line per peer: its closest call, (peer time / ours, case), over all cases."""
    return "".join(f"- {peer}: its time ÷ ours is at least {min(m)[0]:.2f}× ({min(m)[1]}) over {len(m)} cases\n"
                   for peer, m in margins.items())


def summary(result: dict) -> str:
    rows = result["rows"]
    shapes = sorted({(r["N"], r["K"]) for r in rows}, key=lambda s: -s[0] * s[1])
    ms = sorted({r["M"] for r in rows})
    head = ["N×K", "M", "path int4/int8", "int4 µs", "int4 % roof", "int4 plain µs", "int4 bf16 µs", "int4 GEMV µs",
            "int8 µs", "int8 % roof", "int8 plain µs", "int8 bf16 µs", "int8 GEMV µs", "cuBLAS fp16 µs", "tinygemm µs",
            "gemlite w4 µs", "gemlite w8 µs", "bnb nf4 µs", "int4 vs cuBLAS"]
    table = []
    for N, K in shapes:
        for M in ms:
            g = lambda impl: _get(rows, N, K, M, impl)  # noqa: E731
            i4, i4b, i8, i8b = g("woq_int4_g128_float16"), g("woq_int4_g128_bfloat16"), g("woq_int8_channel_float16"), g("woq_int8_channel_bfloat16")
            cb = g("cublas_fp16")
            opt = lambda r: r["us"] if r else "-"  # noqa: E731
            short = {plans.GEMV: "GEMV", plans.MIXED_GEMM: "GEMM", plans.DEQUANT_CUBLAS: "deq+cuBLAS"}
            paths = "/".join(short.get((r or {}).get("path", "gemv"), "?") for r in (i4, i8))
            table.append([f"{N}×{K}", M, paths, opt(i4), 100 * i4["roof_us"] / i4["us"] if i4 else "-",
                          opt(g("woq_int4_g128_float16_plain")), opt(i4b), opt(g("woq_int4_g128_float16_gemv")),
                          opt(i8), 100 * i8["roof_us"] / i8["us"] if i8 else "-",
                          opt(g("woq_int8_channel_float16_plain")), opt(i8b), opt(g("woq_int8_channel_float16_gemv")),
                          opt(cb), opt(g("tinygemm_int4_bf16")),
                          opt(g("gemlite_w4_fp16")), opt(g("gemlite_w8_fp16")), opt(g("bnb_nf4_fp16")),
                          f"{cb['us'] / i4['us']:.2f}×" if (cb and i4) else "-"])
    # the closest call per peer (its time over ours; above 1: we are faster)
    margins = {}
    for N, K in shapes:
        for M in ms:
            g = lambda impl: _get(rows, N, K, M, impl)  # noqa: E731
            for ours_impl, peer in [("woq_int4_g128_float16", "tinygemm_int4_bf16"), ("woq_int4_g128_float16", "gemlite_w4_fp16"),
                                    ("woq_int4_g128_float16", "bnb_nf4_fp16"), ("woq_int8_channel_float16", "gemlite_w8_fp16")]:
                o, q = g(ours_impl), g(peer)
                if o and q:
                    margins.setdefault(peer, []).append((q["us"] / o["us"], f"{N}×{K} M={M}"))
    bw = result["bandwidth_bytes_per_s"] / 1e12
    hdr = (f"GPU: {result['gpu']} ({result['sms']} SMs), torch {result['torch']}, CUDA {result['cuda']}; "
           f"copy bandwidth {bw:.2f} TB/s (read+write). Median µs per call, CUDA graph of 20 calls, weights "
           f"rotated past 4× L2. % roof = (weight+scale+zero bytes + x + y) / bandwidth ÷ time. "
           f"Our kernels launch programmatically on sm_90+ (RuntimeOptions.programmatic_launch, kernels/pdl.py: a "
           f"call's weight stream overlaps the previous call's tail); \"plain\": the same calls launched plainly, "
           f"as the peers are. "
           f"int4/int8 µs: what a layer's kernel plan serves (kernels/plans.py; path: the GEMV, or the mixed "
           f"GEMM's 16-row tile where the tuning table gives it 9..16 rows), at its measured launch; GEMV µs: "
           f"the GEMV kernel itself, at its measured launch, where it is not the one served.\n\n")
    return (hdr + markdown_table(head, table) + "\n\n" + ratio_lines(rows, shapes)
            + "\nAgainst the peers (int4 vs the int4 peers, int8 vs gemlite w8):\n\n" + peer_margins(margins))


def ratio_lines(rows, shapes) -> str:
    """Per shape: M = 16 over M = 1 (served, and the GEMV's own), and the largest
    bf16-vs-fp16 difference over the Ms."""
    out = []
    for N, K in shapes:
        for fmt in FORMATS:
            g = lambda M, impl: _get(rows, N, K, M, impl)  # noqa: E731
            one, sixteen = g(1, f"woq_{fmt}_float16"), g(16, f"woq_{fmt}_float16")
            if not (one and sixteen):
                continue
            own = g(16, f"woq_{fmt}_float16_gemv") or sixteen
            diffs = [abs(b["us"] / a["us"] - 1) for M in sorted({r["M"] for r in rows})
                     if (a := g(M, f"woq_{fmt}_float16")) and (b := g(M, f"woq_{fmt}_bfloat16"))]
            dtypes = f"; bf16 vs fp16 at most {100 * max(diffs):.1f} %" if diffs else ""  # (both dtypes run)
            out.append(f"- {N}×{K} {fmt}: M=16 ÷ M=1 {sixteen['us'] / one['us']:.2f} served, "
                       f"{own['us'] / one['us']:.2f} GEMV{dtypes}\n")
    return "".join(out)


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        print("matplotlib unavailable, no plot:", exc)
        return
    rows = result["rows"]
    shapes = sorted({(r["N"], r["K"]) for r in rows}, key=lambda s: -s[0] * s[1])
    impls = ["woq_int4_g128_float16", "woq_int8_channel_float16", "cublas_fp16", "tinygemm_int4_bf16",
             "gemlite_w4_fp16", "gemlite_w8_fp16", "bnb_nf4_fp16"]
    fig, axes = plt.subplots(1, len(shapes), figsize=(4 * len(shapes), 3.6), sharey=False)
    for ax, (N, K) in zip(list(axes) if len(shapes) > 1 else [axes], shapes):
        for impl in impls:
            pts = sorted((r["M"], r["us"]) for r in rows if (r["N"], r["K"], r["impl"]) == (N, K, impl))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl.replace("_float16", "").replace("woq_", "woq "))
        roof = sorted((r["M"], r["roof_us"]) for r in rows if (r["N"], r["K"], r["impl"]) == (N, K, "woq_int4_g128_float16"))
        if roof:
            ax.plot(*zip(*roof), "k--", label="int4 roofline")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{N}×{K}")
        ax.set_xlabel("M")
        ax.set_ylabel("µs")
    (axes[0] if len(shapes) > 1 else axes).legend(fontsize=7)
    fig.suptitle(f"weight-only GEMV on {result['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


M_SWEEP = [1, 4, 16, 17, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 4096]
# From this M on, the paths and cuBLAS fp16 are compute-bound and run at the card's power cap
# (700 W on the H100 SXM; nvidia-smi read SM clocks from ~1.1 to ~1.4 GHz seconds apart), so two
# timings taken seconds apart differ by up to ~10 %. There every path and cuBLAS fp16 are timed
# in turn over rounds and compared round by round.
PAIRED_FROM_M, PAIRED_ROUNDS = 512, 9


def m_sweep(shapes, ms, out_dir: Path, options: RuntimeOptions) -> dict:
    """Every path over M: GEMV / mixed GEMM, dequantize + cuBLAS (each at the launch the plan
    measured), what the plan serves ("dispatched", timed through the plan), cuBLAS fp16 and
    the peers."""
    info = gpu_info()
    rows = []
    for N, K in shapes:
        torch.manual_seed(0)
        w = torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02
        peers = Peers(w, copies_to_defeat_l2(N * K // 2))
        for fmt, spec in FORMATS.items():
            kps = ours(w, spec, torch.float16, copies_to_defeat_l2(N * K * spec.bits // 8), options)
            plan = kps[0]
            crossover, gemv_reach = plan.max_kernel_m, plan.gemv_max_m
            for M in ms:
                x = torch.randn(M, K, device="cuda", dtype=torch.float16)
                calls = {}
                if M <= ops.gemv_rows_limit(plan.gw):
                    calls[plans.GEMV] = gemv_calls(x, kps)
                if M > min(ops.limits().gemv_max_m, gemv_reach) and plan.mixed_gemm:
                    config, splits = plan.gemm_launch(M)
                    calls[plans.MIXED_GEMM] = [lambda p=p: ops.gemm(x, p.gw, None, config, splits) for p in kps]
                calls[plans.DEQUANT_CUBLAS] = [lambda p=p: F.linear(x, ops.dequantize(p.gw)) for p in kps]
                # what a layer runs: the GEMV up to its measured reach, the mixed GEMM up to the
                # crossover, dequantize + cuBLAS beyond -- timed through the plan itself
                served = plan.path(M)
                calls[served] = [lambda p=p: p(x) for p in kps]
                rounds = None
                if M < PAIRED_FROM_M:
                    t = {path: time_calls(fns) for path, fns in calls.items()}
                else:  # every path and cuBLAS fp16 in turn, round after round; each one's median
                    calls["cublas_paired"] = [lambda W=W: F.linear(x, W) for W in peers.dense16]
                    rounds = [{path: time_calls(fns) for path, fns in calls.items()} for _ in range(PAIRED_ROUNDS)]
                    t = {path: statistics.median(r[path] for r in rounds) for path in calls}
                    del t["cublas_paired"]
                paths = [p for p in t if p in (plans.GEMV, plans.MIXED_GEMM, plans.DEQUANT_CUBLAS)]
                t["dispatched"] = t[served]
                # Peers with the int4 rows; beyond M = 256 cuBLAS only: tinygemm alone takes
                # milliseconds a call there.
                if fmt == "int4_g128":
                    t.update(peers.timings(x, others=M <= 256))
                cell = {impl: dict(N=N, K=K, M=M, fmt=fmt, impl=impl, us=us, crossover=crossover, gemv_max_m=gemv_reach)
                        for impl, us in t.items()}
                rows += cell.values()
                vs_fastest = t[served] / min(t[p] for p in paths)  # (the summary derives it from the µs)
                if rounds:  # round by round instead, kept with the dispatched row
                    vs_fastest = statistics.median(r[served] / min(r[p] for p in paths) for r in rounds)
                    cell["dispatched"].update(
                        rounds=rounds, vs_fastest=vs_fastest,
                        paired_speedup=statistics.median(r["cublas_paired"] / r[served] for r in rounds))
                print(f"MSWEEP {N}x{K} {fmt} M={M} (GEMV to {gemv_reach}, crossover {crossover}): "
                      + "  ".join(f"{k}={v:.1f}" for k, v in t.items()) + f"  dispatched / fastest {vs_fastest:.3f}"
                      + ("  vs cuBLAS fp16 per round: " + " ".join(f"{r['cublas_paired'] / r[served]:.3f}" for r in rounds)
                         if rounds else ""), flush=True)
            # what is measured so far survives a run cut short (the GPU machine's time limit)
            write_json(out_dir / "kernels_msweep.json", dict(info, rows=rows, complete=False))
        del peers, kps, plan
        torch.cuda.empty_cache()
    result = dict(info, rows=rows, complete=True)
    write_json(out_dir / "kernels_msweep.json", result)
    (out_dir / "kernels_msweep.md").write_text(msweep_summary(result))
    plot_msweep(result, out_dir / "kernels_msweep.png")
    return result


def msweep_summary(result: dict) -> str:
    def ratio(a, b):  # "-" where a run cut short left a cell unmeasured
        return f"{a / b:.2f}×" if isinstance(a, float) and isinstance(b, float) else "-"

    rows = result["rows"]
    head = ["N×K", "M", "int4 dispatched", "int4 GEMV", "int4 GEMM", "int4 deq+cuBLAS", "int8 dispatched", "int8 GEMV",
            "int8 GEMM", "int8 deq+cuBLAS", "cuBLAS fp16", "tinygemm", "gemlite w4", "gemlite w8", "bnb nf4",
            "int4 vs cuBLAS", "int8 vs cuBLAS", "int4 ÷ fastest path", "int8 ÷ fastest path"]
    table = []
    margins = {}
    for N, K in sorted({(r["N"], r["K"]) for r in rows}, key=lambda s: -s[0] * s[1]):
        for M in sorted({r["M"] for r in rows}):
            def row(fmt, impl):
                r = [x for x in rows if (x["N"], x["K"], x["M"], x["fmt"], x["impl"]) == (N, K, M, fmt, impl)]
                return r[0] if r else {}

            def g(fmt, impl):
                return row(fmt, impl).get("us", "-")

            def vs_cublas(fmt):  # the paired rounds' median where measured, else one timing each
                p = row(fmt, "dispatched").get("paired_speedup")
                return f"{p:.2f}× ‡" if p else ratio(cb, g(fmt, "dispatched"))

            def vs_fastest(fmt):  # stored where timed in rounds, else from the paths' own timings
                d = row(fmt, "dispatched")
                paths = [v for v in (g(fmt, p) for p in ("gemv", "mixed_gemm", "dequant_cublas")) if v != "-"]
                v = d.get("vs_fastest") or (d["us"] / min(paths) if d and paths else None)
                return f"{v:.3f}" + (" ‡" if "rounds" in d else "") if v else "-"

            rounds = row("int4_g128", "dispatched").get("rounds")  # cuBLAS: the rounds' median where timed so
            cb = statistics.median(r["cublas_paired"] for r in rounds) if rounds else g("int4_g128", "cublas_fp16")
            d4, d8 = g("int4_g128", "dispatched"), g("int8_channel", "dispatched")
            table.append([f"{N}×{K}", M, d4, g("int4_g128", "gemv"), g("int4_g128", "mixed_gemm"),
                          g("int4_g128", "dequant_cublas"), d8, g("int8_channel", "gemv"), g("int8_channel", "mixed_gemm"),
                          g("int8_channel", "dequant_cublas"), cb,
                          g("int4_g128", "tinygemm_int4_bf16"), g("int4_g128", "gemlite_w4_fp16"),
                          g("int4_g128", "gemlite_w8_fp16"), g("int4_g128", "bnb_nf4_fp16"), vs_cublas("int4_g128"),
                          vs_cublas("int8_channel"), vs_fastest("int4_g128"), vs_fastest("int8_channel")])
            if 17 <= M <= 256:  # past the decode batches, where every peer is timed
                for ours_us, peer in [(d4, "tinygemm_int4_bf16"), (d4, "gemlite_w4_fp16"), (d4, "bnb_nf4_fp16"),
                                      (d8, "gemlite_w8_fp16")]:
                    q = g("int4_g128", peer)
                    if q != "-" and ours_us != "-":
                        margins.setdefault(peer, []).append((q / ours_us, f"{N}×{K} M={M}"))
    cross = sorted({(r["N"], r["K"], r["fmt"], r["gemv_max_m"], r["crossover"]) for r in rows})
    notes = "; ".join(f"{n}×{k} {f}: GEMV up to M={v}, kernels up to M={c}" for n, k, f, v, c in cross)
    note = result.get("note", "")
    if not result.get("complete", True):
        note = f"**Incomplete run** ({note or 'cut short'})."
    return ((note + "\n\n" if note else "") + f"GPU: {result['gpu']}, torch {result['torch']}. µs per call (CUDA graph of 20, weights rotated past L2), "
            f"fp16 activations. Measured crossovers: {notes}.\n\n" + markdown_table(head, table) + "\n"
            + (f"\n‡ M ≥ {PAIRED_FROM_M}: cuBLAS fp16 runs at the card's power cap there and its clock drifts, so every "
               f"path there and cuBLAS fp16 were timed in turn over {PAIRED_ROUNDS} rounds, once per format: µs are each "
               "one's median (cuBLAS: int4's rounds), the ratios the median of the rounds' ratios (each round in the "
               "JSON: rounds).\n"
               if any("rounds" in r for r in rows) else "")
            + "\nAgainst the peers at M = 17..256 (dispatched int4 vs the int4 peers, int8 vs gemlite w8):\n\n"
            + peer_margins(margins))


def merge_msweeps(paths: list[Path], out_dir: Path) -> dict:
    """One M-sweep table from several runs on the same GPU (a device call is too short for all
    five shapes), each run's JSON complete. A later run's cells (N, K, M, format) replace an
    earlier run's: a re-measured subset lands in the whole table."""
    runs = [json.loads(p.read_text()) for p in paths]
    for r, p in zip(runs, paths):
        assert r.get("complete") and r["gpu"] == runs[0]["gpu"], f"{p}: incomplete or another GPU"
    cell = lambda x: (x["N"], x["K"], x["M"], x["fmt"])  # noqa: E731
    merged: dict[tuple, list] = {}
    for r in runs:
        for key in {cell(x) for x in r["rows"]}:
            merged[key] = [x for x in r["rows"] if cell(x) == key]
    groups = [",".join(sorted({f"{x['N']}x{x['K']}" for x in r["rows"]})) + " M=" + ",".join(
        map(str, sorted({x["M"] for x in r["rows"]}))) for r in runs]
    note = (f"Measured in {len(runs)} runs on {runs[0]['gpu']}, one device call each ({'; '.join(groups)}; "
            "`MSWEEP_ARGS=\"--shapes ... [--ms ...]\" bash benchmarks/gpu_check.sh build msweep`; a later run's "
            "cells replace an earlier one's), merged with `python benchmarks/linear_kernels.py --merge-msweeps A.json B.json`.")
    result = dict(runs[0], rows=[x for rows in merged.values() for x in rows], complete=True, note=note)
    write_json(out_dir / "kernels_msweep.json", result)
    (out_dir / "kernels_msweep.md").write_text(msweep_summary(result))
    plot_msweep(result, out_dir / "kernels_msweep.png")
    return result


def plot_msweep(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    shapes = sorted({(r["N"], r["K"]) for r in rows}, key=lambda s: -s[0] * s[1])
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.5 * len(shapes), 3.8), squeeze=False)
    for ax, (N, K) in zip(axes[0], shapes):
        for fmt, impl, style in [("int4_g128", "dispatched", "-o"), ("int4_g128", "dequant_cublas", "--"),
                                 ("int8_channel", "dispatched", "-s"), ("int8_channel", "dequant_cublas", ":"),
                                 ("int4_g128", "cublas_fp16", "-k"), ("int4_g128", "tinygemm_int4_bf16", "-x"),
                                 ("int4_g128", "gemlite_w4_fp16", "-^"), ("int4_g128", "gemlite_w8_fp16", "-v"),
                                 ("int4_g128", "bnb_nf4_fp16", "-d")]:
            pts = sorted((r["M"], r["us"]) for r in rows if (r["N"], r["K"], r["fmt"], r["impl"]) == (N, K, fmt, impl))
            if pts:
                ax.plot(*zip(*pts), style, label=f"{fmt.split('_')[0]} {impl}" if impl in ("dispatched", "dequant_cublas") else impl, ms=3)
        for fmt, color in (("int4_g128", "C0"), ("int8_channel", "C2")):
            c = [r for r in rows if (r["N"], r["K"], r["fmt"]) == (N, K, fmt)]
            if c:  # solid: kernels -> dequantize + cuBLAS; dotted: GEMV -> mixed GEMM
                ax.axvline(c[0]["crossover"], color=color, alpha=0.4, lw=1)
                ax.axvline(c[0]["gemv_max_m"], color=color, alpha=0.4, lw=1, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{N}×{K} (crossovers: dotted GEMV→GEMM, solid →deq+cuBLAS)", fontsize=8)
        ax.set_xlabel("M")
        ax.set_ylabel("µs")
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    ap.add_argument("--ms", help=f"default {','.join(map(str, MS))}; with --m-sweep {','.join(map(str, M_SWEEP))}")
    ap.add_argument("--out", type=Path, default=Path("docs/bench"))
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument("--m-sweep", action="store_true", help="every path over M up to 4096 (crossovers)")
    ap.add_argument("--merge-msweeps", nargs="+", type=Path, metavar="JSON",
                    help="write one M-sweep table (--out) from runs over disjoint shape groups")
    a = ap.parse_args()
    if a.merge_msweeps:  # (no GPU needed)
        print(msweep_summary(merge_msweeps(a.merge_msweeps, a.out)))
        return
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    ms = [int(m) for m in a.ms.split(",")] if a.ms else (M_SWEEP if a.m_sweep else MS)
    options = RuntimeOptions()
    assert build.load(options), "woq CUDA kernels unavailable"
    if a.m_sweep:
        print(msweep_summary(m_sweep(shapes, ms, a.out, options)))
        return
    res = run(shapes, ms, a.out, [getattr(torch, d) for d in a.dtypes.split(",")], options)
    print(summary(res))


if __name__ == "__main__":
    main()
