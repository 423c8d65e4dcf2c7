"""Time build-time variants of the GEMV pipeline on the big decode shapes (issue 3's
M = 1 roofline gap): each variant is a separate JIT build with WOQ_NVCC_FLAGS.

    python benchmarks/gemv_variants.py "" "-DWOQ_GEMV_STAGES=6" "-DWOQ_GEMV_STEPS=2"

Prints, per variant, case and pipeline (the shared-memory ring; up to 8 rows also the
register stream), the best (k-warps, grid) time in µs (rotated weights, CUDA-graph
replays) and the share of the copy-bandwidth roofline.
"""
import json
import os
import subprocess
import sys

CASES = [(28672, 8192, 1, 4), (21504, 14336, 1, 4), (28672, 4096, 1, 4), (4096, 14336, 1, 4), (6144, 4096, 1, 4),
         (4096, 4096, 1, 4), (28672, 8192, 16, 4), (28672, 8192, 1, 8), (4096, 4096, 1, 8)]
if os.environ.get("VARIANT_CASES"):  # "N,K,M,BITS[,bf16];...": other cases (e.g. M = 17..32, bf16)
    CASES = [tuple(int(v) if v.isdigit() else v for v in c.split(",")) for c in os.environ["VARIANT_CASES"].split(";")]

CHILD = r"""
import json, sys, torch
from woq.kernels import ops
from woq.kernels.format import QuantSpec, quantize
from woq.kernels.layout import pack_for_gpu
from woq.kernels.timing import graph_time_us
sys.path.insert(0, "benchmarks")
from common import copies_to_defeat_l2, copy_bandwidth
from woq.kernels.tuning import _stream_candidates
assert ops.available()
sms = torch.cuda.get_device_properties(0).multi_processor_count
bw = copy_bandwidth()
out = []
for N, K, M, bits, *dtype in json.loads(sys.argv[1]):
    dtype = torch.bfloat16 if dtype == ["bf16"] else torch.float16
    spec = QuantSpec(4, 128, False) if bits == 4 else QuantSpec(8, None, True)
    qw = quantize(torch.randn(N, K, device="cuda") * 0.02, spec)
    gws = [ops.prepare(pack_for_gpu(qw, dtype)) for _ in range(copies_to_defeat_l2(N * K * bits // 8))]
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    launches = {"ring": [(kw, b) for kw in ops.gemv_k_warps(M)
                         for b in sorted({0, sms, 2 * sms, 3 * sms, ops.gemv_columns(N, kw, M)})]}
    if M <= ops.STREAM_MAX_M:
        launches["stream"] = _stream_candidates(N, sms)
    roof = gws[0].nbytes() / bw * 1e6
    for name, grid in launches.items():
        pipeline = ops.GEMV_STREAM if name == "stream" else ops.GEMV_RING
        best = (float("inf"), None)
        for kw, b in grid:
            try:
                t = graph_time_us([lambda g=g: ops.gemv(x, g, max_blocks=b, k_warps=kw, pipeline=pipeline) for g in gws])
            except (RuntimeError, ValueError):  # a launch this build refuses
                continue
            best = min(best, (t, (kw, b)))
        out.append({"case": f"{N}x{K} M={M} int{bits} {str(dtype)[6:]} {name}", "us": round(best[0], 1),
                    "launch": best[1], "roofline_pct": round(100 * roof / best[0], 1)})
    del gws
print("RESULT", json.dumps(out))
"""

if __name__ == "__main__":
    for flags in sys.argv[1:] or [""]:
        env = dict(os.environ, WOQ_NVCC_FLAGS=flags)
        r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(CASES)], env=env, capture_output=True, text=True)
        line = next((l for l in r.stdout.splitlines() if l.startswith("RESULT")), None)
        if line is None:
            print(f"[{flags or 'default'}] failed:\n{r.stderr[-2000:]}", flush=True)
            continue
        for row in json.loads(line[7:]):
            print(f"[{flags or 'default'}] {row['case']}: {row['us']} us, {row['roofline_pct']} % of roofline, "
                  f"launch {row['launch']}", flush=True)
