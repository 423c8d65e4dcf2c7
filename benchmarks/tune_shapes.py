"""Measure the dispatch table (kernels/tuning.py) for the layer shapes of common models on
this GPU, to ship as defaults in kernels/tuned/ (copied from $WOQ_CACHE/tuning/).

    python benchmarks/tune_shapes.py                                   # everything
    python benchmarks/tune_shapes.py --gemv-ms 1,2,4,8 --base OLD.json # only those GEMV launches

--base: a table of an earlier kernel build whose other choices still hold (a change that
touched only the GEMV launches at --gemv-ms); its entries are kept, those launches re-timed.
"""
import argparse
import json

import torch

from woq.kernels import ops, tuning
from woq.kernels.format import QuantSpec, quantize
from woq.kernels.layout import pack_for_gpu

SHAPES = {  # (N, K) of the fused qkv, o, gate_up, down layers
    "llama3-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
    "smollm2-135m": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
    "kernel benchmark": [(28672, 8192), (21504, 14336), (14336, 4096)],  # benchmarks/kernels.py
}
FORMATS = [QuantSpec(4, 128, False), QuantSpec(8, None, True)]

parser = argparse.ArgumentParser()
parser.add_argument("--gemv-ms", type=lambda v: [int(m) for m in v.split(",")])
parser.add_argument("--base", type=argparse.FileType())
args = parser.parse_args()
base = json.load(args.base) if args.base else None
assert (base is None) == (args.gemv_ms is None), "--gemv-ms and --base go together"

assert ops.available()
for model, shapes in SHAPES.items():
    for N, K in shapes:
        for spec in FORMATS:
            for dtype in (torch.float16, torch.bfloat16):
                qw = quantize(torch.randn(N, K, device="cuda") * 0.02,
                              QuantSpec(spec.bits, spec.group_size, spec.symmetric, scale_dtype=dtype))
                gw = ops.prepare(pack_for_gpu(qw, dtype), tune=base is None)
                if base is not None:
                    tuning.remeasure_gemv(gw, base[tuning.shape_key(gw)], args.gemv_ms)
                    tuning.apply(gw)
                print(model, N, K, spec.describe(), dtype, gw.grids, gw.gemv_max_m, gw.max_kernel_m, flush=True)
