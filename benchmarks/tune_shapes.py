"""Measure the tuning table for common models' layer shapes on this GPU (kernels/tuned/).

Every shape is measured afresh (kernels/tuning.py, ``measure``), whether a table already
has it or not, and written to <cache>/tuning/<tuning.table_name()>.json, the table to ship
in kernels/tuned/ (entries already there for other shapes are kept).

    python benchmarks/tune_shapes.py [--models llama3-8b,smollm2-135m]
"""
import argparse
import json

import torch

from woq.kernels import build, ops, tuning
from woq.kernels.format import QuantSpec, quantize
from woq.kernels.layout import pack_for_gpu
from woq.kernels.options import RuntimeOptions

SHAPES = {  # (N, K) of the fused qkv, o, gate_up, down layers
    "llama3-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
    "smollm2-135m": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
    "kernel-benchmark": [(28672, 8192), (21504, 14336), (14336, 4096)],  # benchmarks/linear_kernels.py
}
FORMATS = [QuantSpec(4, 128, False), QuantSpec(8, None, True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    args = ap.parse_args()
    options = RuntimeOptions()
    assert build.load(options), "woq CUDA kernels unavailable"
    path = options.tuning_dir() / f"{tuning.table_name()}.json"
    table = json.loads(path.read_text()) if path.exists() else {}
    for model in args.models.split(","):
        for N, K in SHAPES[model]:
            for spec in FORMATS:
                for dtype in (torch.float16, torch.bfloat16):
                    qw = quantize(torch.randn(N, K, device="cuda") * 0.02,
                                  QuantSpec(spec.bits, spec.group_size, spec.symmetric))
                    gw = ops.prepare(pack_for_gpu(qw, dtype))
                    entry = table[tuning.shape_key(gw)] = tuning.measure(gw)
                    print(model, N, K, spec.describe(), dtype, entry, flush=True)
                    # (after each shape: a run cut short keeps what it measured)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(json.dumps(table, indent=1, sort_keys=True))
    print("wrote", path)


if __name__ == "__main__":
    main()
