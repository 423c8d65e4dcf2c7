"""A few kernel launches of one shape, for ncu:
python benchmarks/profile_gemv.py N K M BITS [BLOCKS [K_WARPS [PIPELINE]]].
M <= gw.gemv_max_m (16, or up to 32 where measured faster) runs the GEMV (BLOCKS, K_WARPS: its grid;
PIPELINE 0: the shared-memory ring, 1: the register stream);
larger M the mixed GEMM (BLOCKS, K_WARPS read as tile config and split-K; 0 0 = the measured plan).
WOQ_PROFILE_DTYPE=bfloat16: bf16 activations (default float16)."""
import os
import sys

import torch

from woq.kernels import ops
from woq.kernels.format import QuantSpec, quantize
from woq.kernels.layout import pack_for_gpu

N, K, M, bits = (int(v) for v in sys.argv[1:5])
blocks = int(sys.argv[5]) if len(sys.argv) > 5 else 0
k_warps = int(sys.argv[6]) if len(sys.argv) > 6 else None
pipeline = int(sys.argv[7]) if len(sys.argv) > 7 else None
assert ops.available()
dtype = getattr(torch, os.environ.get("WOQ_PROFILE_DTYPE", "float16"))
spec = QuantSpec(4, 128, False) if bits == 4 else QuantSpec(8, None, True)
# (an explicit launch needs no tuning, whose own launches ncu's --launch-skip would count)
gw = ops.prepare(pack_for_gpu(quantize(torch.randn(N, K, device="cuda") * 0.02, spec), dtype),
                 tune=len(sys.argv) <= 5)
x = torch.randn(M, K, device="cuda", dtype=dtype)
for _ in range(3):
    if M <= gw.gemv_max_m:
        ops.gemv(x, gw, max_blocks=blocks or None, k_warps=k_warps, pipeline=pipeline)
    else:
        ops.gemm(x, gw, config=blocks if len(sys.argv) > 5 else None, splits=k_warps)
torch.cuda.synchronize()
print("grids", gw.grids, "gemm plan", gw.gemm_plan)
