"""Does an error raised inside a torch custom op come back as a Python exception?

Checks a minimal inline extension (TORCH_CHECK(false)) and our op's C++ argument checks,
each in a child process so that a crash is reported instead of ending the run.
"""
import subprocess
import sys

MINIMAL = r'''
import torch
from torch.utils.cpp_extension import load_inline
m = load_inline("woq_throw_probe", cpp_sources="""
#include <torch/extension.h>
torch::Tensor boom(torch::Tensor x) { TORCH_CHECK(false, "expected failure"); return x; }
""", functions=["boom"])
try:
    m.boom(torch.zeros(1))
except RuntimeError as e:
    print("minimal extension raised:", str(e).splitlines()[0])
'''

OURS = r'''
import torch
from woq.kernels import ops
from woq.kernels.format import QuantSpec, quantize
from woq.kernels.layout import pack_for_gpu
assert ops.available()
gw = ops.prepare(pack_for_gpu(quantize(torch.randn(64, 128, device="cuda"), QuantSpec(4, 64, False)), torch.float16))
x = torch.randn(65, 128, device="cuda", dtype=torch.float16)
try:
    torch.ops.woq.gemv(x, gw.qweight, gw.scales, gw.zeros, None, 4, 64, 64, 128, 0, 0, 0, False,
                       ops.scratch(x.device).workspace, ops.scratch(x.device).counters)
except Exception as e:
    print("woq op raised", type(e).__name__ + ":", str(e).splitlines()[0])
'''

if "--inline-ours" in sys.argv:  # run our case in this process (under a debugger)
    exec(OURS)
    sys.exit(0)
for name, code in (("minimal", MINIMAL), ("woq", OURS)):
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    print(f"{name}: exit {r.returncode}; {r.stdout.strip() or r.stderr.strip()[-300:]}")
