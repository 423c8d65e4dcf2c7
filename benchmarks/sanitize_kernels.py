"""A few kernel launches for compute-sanitizer (memcheck): odd shapes, every format,
columns cut between blocks or not, 1, 2 or 4 k-warps, M = 1..32 (1 to 4 row blocks); the register-stream GEMV
(M <= 8) at 1, 2, 4, 8 k-warps with K whole or cut between blocks; both with the SwiGLU
epilogue; the mixed GEMM's mma tile
configurations and, where built (an H100's sm_90a), its wgmma ones, with and without split-K,
tiles cut between blocks, M tails; shallower rings under smaller GPUs' shared memory.
Run by benchmarks/gpu_check.sh under the sanitizer.

    --gemm-only: the mixed GEMM's launches of the first shape alone -- few enough launches
    for racecheck / synccheck, which serialise every access (gpu_check.sh racecheck)."""
import argparse
import itertools

import torch

from woq.kernels import build, ops
from woq.kernels.format import QuantSpec, quantize
from woq.kernels.layout import pack_for_gpu
from woq.kernels.options import RuntimeOptions

parser = argparse.ArgumentParser()
parser.add_argument("--gemm-only", action="store_true")
gemm_only = parser.parse_args().gemm_only

assert build.load(RuntimeOptions()), "woq CUDA kernels unavailable"
torch.manual_seed(0)
GEMM_LAUNCHES = [(17, 0, 0), (70, 1, 3), (129, 2, 2), (33, 2, 1)]  # (M, config, splits)
if ops.wgmma_configs_available():
    GEMM_LAUNCHES += [(40, 5, 0), (17, 5, 3), (100, 6, 0), (129, 7, 2), (200, 8, 0), (129, 8, 1),
                      (16, 9, 0), (9, 9, 2), (37, 9, 0)]


def run_gemm_launches(gw, N: int, K: int, dtype: torch.dtype) -> None:
    for M, config, splits in GEMM_LAUNCHES:
        ops.gemm(torch.randn(M, K, device="cuda", dtype=dtype), gw, torch.randn(N, device="cuda", dtype=dtype),
                 config=config, splits=splits)


for (N, K), bits, group, sym, dtype in itertools.product(
    [(1000, 576)] + ([] if gemm_only else [(24, 4104)]), [4, 8], [None, 128], [True, False],
    [torch.float16, torch.bfloat16]
):
    qw = quantize(torch.randn(N, K, device="cuda"), QuantSpec(bits, group, sym))
    gw = ops.prepare(pack_for_gpu(qw, dtype))
    if gemm_only:
        run_gemm_launches(gw, N, K, dtype)
        continue
    for M, blocks, k_warps in [(1, 0, 0), (16, 0, 1), (7, 3, 2), (16, 5, 4), (3, 0, 4), (19, 0, 0), (32, 3, 2),
                               (27, 0, 1), (30, 5, 1)]:
        ops.gemv(torch.randn(M, K, device="cuda", dtype=dtype), gw, torch.randn(N, device="cuda", dtype=dtype),
                 max_blocks=blocks, k_warps=k_warps)
    for M, blocks, k_warps in [(1, 0, 0), (8, 0, 8), (3, 7, 1), (5, 1000, 4), (2, 3, 2), (1, 1000, 8)]:
        ops.gemv(torch.randn(M, K, device="cuda", dtype=dtype), gw, torch.randn(N, device="cuda", dtype=dtype),
                 max_blocks=blocks, k_warps=k_warps, pipeline=ops.GEMV_STREAM)
    # the SwiGLU epilogue (a gate/up weight: rows interleaved in eights, 2 x 504 of them)
    spec = QuantSpec(bits, group, sym)
    gate_up = ops.prepare(pack_for_gpu(quantize(torch.randn(1008, K, device="cuda"), spec), dtype, gate_up=True))
    for M, blocks, k_warps, pipeline in [(1, 0, 0, ops.GEMV_RING), (16, 5, 4, ops.GEMV_RING), (7, 3, 2, ops.GEMV_RING),
                                         (1, 0, 0, ops.GEMV_STREAM), (5, 1000, 4, ops.GEMV_STREAM),
                                         (8, 0, 8, ops.GEMV_STREAM)]:
        ops.gemv(torch.randn(M, K, device="cuda", dtype=dtype), gate_up, torch.randn(1008, device="cuda", dtype=dtype),
                 max_blocks=blocks, k_warps=k_warps, pipeline=pipeline, swiglu=True)
    run_gemm_launches(gw, N, K, dtype)
    ops.dequantize(gw)
    # the shallower rings of GPUs with less shared memory (3 and 2 stages: a T4, an RTX 30/40)
    for limit, M, k_warps in [(64 << 10, 1, 1), (64 << 10, 16, 1), (99 << 10, 16, 2), (99 << 10, 24, 1)]:
        with ops.shared_memory_limit(limit):
            ops.gemv(torch.randn(M, K, device="cuda", dtype=dtype), gw, max_blocks=0, k_warps=k_warps)
    with ops.shared_memory_limit(99 << 10):
        ops.gemm(torch.randn(70, K, device="cuda", dtype=dtype), gw, config=2 if bits == 4 else 4, splits=2)
torch.cuda.synchronize()
print(f"sanitizer workload done (wgmma configurations {'included' if ops.wgmma_configs_available() else 'not built'})")
