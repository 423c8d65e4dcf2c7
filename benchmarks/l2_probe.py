"""Probe: does a GEMV find weights prefetched into L2 by kernels/l2_prefetch.py?"""
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine import CONTEXT, configs, random_state  # noqa: E402

from woq.kernels import ops  # noqa: E402
from woq.kernels.l2_prefetch import L2Prefetcher  # noqa: E402
from woq.models.builder import QuantConfig, build_model  # noqa: E402

config = configs()["llama3-8b"]
import copy  # noqa: E402

config = copy.deepcopy(config)
config.num_hidden_layers = 4
model = build_model(config, random_state(config), QuantConfig("int4", 128), torch.float16, "cuda", CONTEXT,
                    progress=False)
layer = model.layers[3]
flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
pf = {k: L2Prefetcher(torch.device("cuda"), k) for k in ("bulk", "line", "line_last")}


def timed(gw, x, prep):
    ts = []
    for _ in range(30):
        flush.zero_()
        prep()
        torch.cuda.synchronize()
        torch.cuda._sleep(200000)  # ~100 us: outstanding prefetches land
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        ops.run_path("gemv", x, gw, None)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


for name, lin in (("o", layer.attn.o), ("qkv", layer.attn.qkv), ("down", layer.mlp.down), ("gate_up", layer.mlp.gate_up)):
    gw = lin.gpu
    x = torch.randn(1, gw.K, dtype=torch.float16, device="cuda")
    tensors = [t for t in (gw.qweight, gw.scales, gw.zeros) if t is not None]
    mb = sum(t.numel() * t.element_size() for t in tensors) / 2**20
    res = {"cold": timed(gw, x, lambda: None),
           "hot": timed(gw, x, lambda: ops.run_path("gemv", x, gw, None))}
    for kind, p in pf.items():
        for f in (0.3, 1.0):
            def prep(p=p, f=f):
                p.prefetch(tensors, f)
                p.join()
            res[f"{kind} f={f}"] = timed(gw, x, prep)
    print(f"{name} ({mb:.1f} MB): " + ", ".join(f"{k} {v:.1f}" for k, v in res.items()), flush=True)
