"""Torch reference implementations of the quantized ops (any device, no custom kernels).

These define what the CUDA kernels must compute, and they are the CPU serving path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .format import GATE_UP_BLOCK, QuantizedWeight, _grouped


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(q - z) * s`` as a ``[N, K]`` tensor of ``dtype``, computed in fp32 (fp64 if asked)."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    N, K = qw.out_features, qw.in_features
    codes = _grouped(qw.codes().to(work), qw.group_size)  # [N, groups, G]
    z = qw.zero_points().to(work).unsqueeze(-1)
    s = qw.scales.to(work).unsqueeze(-1)
    return ((codes - z) * s).reshape(N, -1)[:, :K].to(dtype)


def linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize(qw).T + bias`` in ``x.dtype``, dequantizing on every call. (CPU
    serving dequantizes once and keeps the copy, ``plans.ReferencePlan``: dequantizing
    costs more than the matmul it feeds, and torch's own CPU int8/int4 kernels more still;
    docs/design/cpu_linear.md.)"""
    return F.linear(x, dequantize(qw, x.dtype), bias)


def gate_and_up(gate_up: torch.Tensor, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A SwiGLU layer's output ``[..., 2 I]`` split into gate and up ``[..., I]``: gate then up,
    or (``interleaved``) their rows in blocks of eight (``format.gate_up_row_order``)."""
    if not interleaved:
        return gate_up.chunk(2, dim=-1)
    blocks = gate_up.unflatten(-1, (-1, 2, GATE_UP_BLOCK))  # [..., I / 8, (gate, up), 8]
    return blocks[..., 0, :].flatten(-2), blocks[..., 1, :].flatten(-2)


def silu_mul(gate_up: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` of ``gate_up`` (``gate_and_up``'s orders); ``[..., I]``."""
    gate, up = gate_and_up(gate_up, interleaved)
    # (contiguous: torch's CPU SiLU can round a strided view differently in the last bit)
    return F.silu(gate.contiguous()) * up.contiguous()
