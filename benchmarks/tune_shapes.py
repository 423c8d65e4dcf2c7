"""Measure the dispatch table (kernels/tuning.py) for the layer shapes of common models on
this GPU, to ship as defaults in kernels/tuned/ (copied from $WOQ_CACHE/tuning/)."""
import torch

from woq.kernels import ops
from woq.kernels.format import QuantSpec, quantize
from woq.kernels.layout import pack_for_gpu

SHAPES = {  # (N, K) of the fused qkv, o, gate_up, down layers
    "llama3-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
    "smollm2-135m": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
    "kernel benchmark": [(28672, 8192), (21504, 14336), (14336, 4096)],  # benchmarks/kernels.py
}
FORMATS = [QuantSpec(4, 128, False), QuantSpec(8, None, True)]

assert ops.available()
for model, shapes in SHAPES.items():
    for N, K in shapes:
        for spec in FORMATS:
            for dtype in (torch.float16, torch.bfloat16):
                qw = quantize(torch.randn(N, K, device="cuda") * 0.02,
                              QuantSpec(spec.bits, spec.group_size, spec.symmetric, scale_dtype=dtype))
                gw = ops.prepare(pack_for_gpu(qw, dtype), tune=True)
                print(model, N, K, spec.describe(), dtype, gw.grids, gw.gemv_max_m, gw.max_kernel_m, flush=True)
