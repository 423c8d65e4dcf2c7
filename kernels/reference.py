"""Torch reference implementations of the quantized ops (any device, no custom kernels).

These define what the CUDA kernels must compute, and they are the CPU serving path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .format import QuantizedWeight, _grouped


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(q - z) * s`` as a ``[N, K]`` tensor of ``dtype``, computed in fp32 (fp64 if asked)."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    N, K = qw.out_features, qw.in_features
    codes = _grouped(qw.codes().to(work), qw.group_size)  # [N, groups, G]
    z = qw.zero_points().to(work).unsqueeze(-1)
    s = qw.scales.to(work).unsqueeze(-1)
    return ((codes - z) * s).reshape(N, -1)[:, :K].to(dtype)


def linear(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ dequantize(qw).T + bias`` in ``x.dtype``.

    ``weight`` may pass an already dequantized copy of ``qw`` (see ``DequantCache``): on CPU,
    dequantizing on every call was measured 7-15x slower than the dense matmul it feeds, and
    torch's own CPU int8/int4 kernels slower still, so the CPU path dequantizes once.
    """
    w = weight if weight is not None else dequantize(qw, x.dtype)
    return F.linear(x, w, bias)
