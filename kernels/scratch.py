"""Device scratch shared by every quantized layer of a device: the GEMV's and the mixed
GEMM's partial sums and counters, and the dequantized-weight buffer of dequant + cuBLAS.
Sized at load for the largest layer and never reallocated while serving, so that CUDA
graphs can capture the pointers; the sizes come from the library (``scratch_sizes``),
whose launchers cap their grids to them."""
from __future__ import annotations

import torch

from .device import sm_count
from .layout import GpuWeight

# The largest M the tuner lets the mixed GEMM serve (the last of tuning.GEMM_MS); beyond,
# it runs one block per output tile, which needs no counters.
MAX_GEMM_M = 1024


class Scratch:
    def __init__(self, device: torch.device):
        self.device = device
        self.sms = sm_count(device)
        floats, counters = torch.ops.woq.scratch_sizes(1, self.sms, MAX_GEMM_M)
        self.workspace = torch.empty(floats, dtype=torch.float32, device=device)
        self.counters = torch.zeros(counters, dtype=torch.int32, device=device)
        self.dense: dict[torch.dtype, torch.Tensor] = {}

    def reserve(self, gw: GpuWeight) -> None:
        """Grow the buffers for ``gw`` (at load, before any capture)."""
        floats, counters = torch.ops.woq.scratch_sizes(gw.N, self.sms, MAX_GEMM_M)
        if self.workspace.numel() < floats:
            self.workspace = torch.empty(floats, dtype=torch.float32, device=self.device)
        if self.counters.numel() < counters:
            self.counters = torch.zeros(counters, dtype=torch.int32, device=self.device)
        dense = self.dense.get(gw.dtype)
        if dense is None or dense.numel() < gw.N * gw.K:
            self.dense[gw.dtype] = torch.empty(gw.N * gw.K, dtype=gw.dtype, device=self.device)


_scratch: dict[torch.device, Scratch] = {}


def scratch(device: torch.device) -> Scratch:
    """The device's scratch (one per device and process, like the CUDA library)."""
    if device not in _scratch:
        _scratch[device] = Scratch(device)
    return _scratch[device]
