"""The logical format of a weight-only quantized linear weight, and its quantizers.

A linear layer computes ``y = x @ W.T`` with ``W`` of shape ``[N, K]`` (``nn.Linear``
layout: N output features, K input features). Quantized, every weight is stored as an
unsigned integer code ``q`` and recovered as::

    W[n, k] ≈ (q[n, k] - z[n, g]) * s[n, g],      g = k // group_size

* ``bits`` is 8 or 4: codes are in ``[0, 2**bits - 1]``.
* ``group_size`` is the number of consecutive K elements that share a scale (and zero).
  Per-channel quantization is ``group_size == K`` (one group per row). Groups are
  ``ceil(K / group_size)``: the last one may be partial (SmolLM2 has K = 576, which
  g128 does not divide). GPU layouts pad K at pack time; the logical format does not.
* ``symmetric``: no zero tensor is stored and ``z`` is the constant midpoint
  ``2**(bits-1)`` (128 for int8, 8 for int4). Storing symmetric codes biased by the
  midpoint (rather than as signed integers) is what the fast GPU converters want: they
  build a float from an *unsigned* byte/nibble and subtract the bias as part of the
  magic-number subtraction (see ``kernels/layout.py``). It also makes symmetric and
  asymmetric weights one code path: symmetric is "zero point = midpoint".
* ``scales`` have their own dtype (``scale_dtype``), fp16 by default: the GPU kernels
  consume fp16/bf16 scales, and the CPU reference upcasts the very same values, so both
  paths dequantize to identical weights.
* Storage (``packed``, uint8): int8 is one code per byte, ``[N, K]``; int4 is two codes
  per byte, ``[N, K/2]``, element ``2j`` in the low nibble and ``2j + 1`` in the high
  nibble of byte ``j`` (the order GPTQ/AWQ and most tools use). int4 needs an even K.
* ``zeros`` (asymmetric only) are integer codes, uint8 ``[N, groups]``, like GPTQ's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

SUPPORTED_BITS = (4, 8)


def midpoint(bits: int) -> int:
    """The implicit zero point of symmetric codes: 128 for int8, 8 for int4."""
    return 1 << (bits - 1)


@dataclass(frozen=True)
class QuantSpec:
    """How to quantize: bit width, group size (None = per-channel) and symmetry."""

    bits: int = 8
    group_size: int | None = None
    symmetric: bool = True
    scale_dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {self.bits}")
        if self.group_size is not None and (self.group_size < 2 or self.group_size % 2):
            raise ValueError(f"group_size must be an even number >= 2 or None, got {self.group_size}")

    def group_size_for(self, in_features: int) -> int:
        return in_features if self.group_size is None else min(self.group_size, in_features)

    def describe(self) -> str:
        g = "per-channel" if self.group_size is None else f"g{self.group_size}"
        return f"int{self.bits} {g} {'sym' if self.symmetric else 'asym'}"


@dataclass
class QuantizedWeight:
    """A quantized ``[out_features, in_features]`` weight in the logical format above."""

    packed: torch.Tensor  # uint8 [N, K] (int8) or [N, K/2] (int4)
    scales: torch.Tensor  # [N, groups], scale dtype
    zeros: torch.Tensor | None  # uint8 [N, groups] or None (symmetric)
    bits: int
    group_size: int
    in_features: int
    out_features: int

    def __post_init__(self) -> None:
        self.validate()

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    @property
    def num_groups(self) -> int:
        return math.ceil(self.in_features / self.group_size)

    @property
    def per_channel(self) -> bool:
        return self.group_size >= self.in_features

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def validate(self) -> None:
        """Check shapes and dtypes; raise ValueError naming what is wrong."""
        N, K, b = self.out_features, self.in_features, self.bits
        if b not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {b}")
        expect = (N, -(-K * b // 8))  # (int4, odd K: the last byte half padding)
        if self.packed.dtype != torch.uint8 or tuple(self.packed.shape) != expect:
            raise ValueError(f"packed must be uint8 {expect}, got {self.packed.dtype} {tuple(self.packed.shape)}")
        groups = (N, self.num_groups)
        if tuple(self.scales.shape) != groups or not self.scales.is_floating_point():
            raise ValueError(f"scales must be floating {groups}, got {self.scales.dtype} {tuple(self.scales.shape)}")
        if self.zeros is not None and (self.zeros.dtype != torch.uint8 or tuple(self.zeros.shape) != groups):
            raise ValueError(f"zeros must be uint8 {groups}, got {self.zeros.dtype} {tuple(self.zeros.shape)}")

    def nbytes(self) -> int:
        t = [self.packed, self.scales] + ([self.zeros] if self.zeros is not None else [])
        return sum(x.numel() * x.element_size() for x in t)

    def to(self, device: torch.device | str) -> "QuantizedWeight":
        z = None if self.zeros is None else self.zeros.to(device)
        return replace(self, packed=self.packed.to(device), scales=self.scales.to(device), zeros=z)

    def codes(self) -> torch.Tensor:
        """The unsigned integer codes, uint8 ``[N, K]``."""
        return unpack_codes(self.packed, self.bits, self.in_features)

    def zero_points(self) -> torch.Tensor:
        """Integer zero points ``[N, groups]`` (uint8), the midpoint when symmetric."""
        if self.zeros is not None:
            return self.zeros
        return torch.full_like(self.scales, midpoint(self.bits), dtype=torch.uint8)


# ---------------------------------------------------------------------------------------
# Packing of codes into bytes (the logical storage; GPU layouts are built from this).


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``[N, K]`` → packed storage (identity for int8, two nibbles per byte for int4,
    ``ceil(K / 2)`` bytes a row)."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    if bits == 8:
        return codes.contiguous()
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError("int4 codes must be in [0, 15]")
    if codes.shape[-1] % 2:  # an odd K: the last byte's high nibble is padding (0), never read
        codes = torch.nn.functional.pad(codes, (0, 1))
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def unpack_codes(packed: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """Packed storage → uint8 codes ``[N, K]`` (inverse of :func:`pack_codes`)."""
    if bits == 8:
        return packed
    out = torch.empty(*packed.shape[:-1], in_features, dtype=torch.uint8, device=packed.device)
    out[..., 0::2] = packed & 0xF
    out[..., 1::2] = (packed >> 4)[..., : in_features // 2]  # (an odd K: the last high nibble is padding)
    return out


# ---------------------------------------------------------------------------------------
# Quantizers: round-to-nearest, per-channel or group-wise, symmetric or asymmetric.


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """View ``[N, K]`` as ``[N, groups, group_size]``, zero-padding a partial last group."""
    N, K = w.shape
    groups = math.ceil(K / group_size)
    pad = groups * group_size - K
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
    return w.reshape(N, groups, group_size)


def clip_search_params(
    w: torch.Tensor, spec: QuantSpec, steps: int = 80, max_shrink: float = 0.8, norm: float = 2.4
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Like :func:`quantize_params`, but each group's range is shrunk by the factor (1 down
    to 1 - max_shrink) that minimises sum |w - dequantized|^norm over the group: clipping a
    few outliers buys a finer step for the rest (GPTQ's reference quantizer, ``mse=True``)."""
    g = _grouped(w.float(), spec.group_size_for(w.shape[1]))
    qmax = (1 << spec.bits) - 1
    lo_q = 1 if (spec.bits == 8 and spec.symmetric) else 0
    best_err = torch.full(g.shape[:2], float("inf"), device=w.device)
    best_s = torch.zeros(g.shape[:2], device=w.device)
    best_z = torch.zeros(g.shape[:2], device=w.device)
    # (the ranges once; each step scales them. The error is worked out in one buffer, in
    # place: a new tensor for each element-wise op costs about as much as the op)
    if spec.symmetric:
        absmax = g.abs().amax(-1)
        z = torch.full_like(absmax, midpoint(spec.bits))
    else:
        lo0, hi0 = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    e = torch.empty_like(g)
    for i in range(int(max_shrink * steps) + 1):
        p = 1 - i / steps
        if spec.symmetric:
            s = (absmax * p / (127.0 if spec.bits == 8 else qmax / 2)).clamp(min=1e-10)
        else:
            lo, hi = lo0 * p, hi0 * p
            s = ((hi - lo) / qmax).clamp(min=1e-10)
            z = torch.round(-lo / s).clamp(0, qmax)
        # e = |(q - z) s - g|^norm, q = clamp(round(g / s + z)). The power is exp(norm *
        # log|.|) (0 gives exp(-inf) = 0): torch's pow with a fractional exponent runs
        # scalar code on the CPU, slower than the two vectorized calls (docs/design/ci.md)
        torch.div(g, s[..., None], out=e)
        e.add_(z[..., None]).round_().clamp_(lo_q, qmax)
        e.sub_(z[..., None]).mul_(s[..., None]).sub_(g).abs_().log_().mul_(norm).exp_()
        err = e.sum(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s = torch.where(better, s, best_s)
        best_z = torch.where(better, z, best_z)
    return best_s, (None if spec.symmetric else best_z)


def quantize_params(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-group fp32 scales and integer zeros (None when symmetric) for ``w`` ``[N, K]``.

    Symmetric int8 is the seed's absmax/127 per channel; symmetric int4 uses GPTQ's
    absmax/7.5 (the [-8, 7] range, -8 reached only by the most negative value); asymmetric
    is min-max over [0, 2**bits - 1] with the range widened to contain 0 (GPTQ), so that
    an exact zero weight stays exactly zero.
    """
    g = _grouped(w.float(), spec.group_size_for(w.shape[1]))
    qmax = (1 << spec.bits) - 1
    if spec.symmetric:
        absmax = g.abs().amax(-1)
        denom = 127.0 if spec.bits == 8 else qmax / 2  # int4: 7.5
        return absmax / denom, None
    lo = g.amin(-1).clamp(max=0)
    hi = g.amax(-1).clamp(min=0)
    scale = (hi - lo) / qmax
    zero = torch.round(-lo / scale.clamp(min=1e-30)).clamp(0, qmax)
    return scale, zero


def quantize_with_params(
    w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int, group_size: int
) -> torch.Tensor:
    """Round ``w`` to codes with given per-group ``scales`` (as stored) and ``zeros``: uint8 ``[N, K]``."""
    N, K = w.shape
    g = _grouped(w.float(), group_size)
    s = scales.float().unsqueeze(-1)
    z = (zeros.float() if zeros is not None else torch.full_like(scales, midpoint(bits), dtype=torch.float32))
    qmax = (1 << bits) - 1
    lo = 1 if (bits == 8 and zeros is None) else 0  # symmetric int8 keeps [-127, 127]
    q = torch.round(g / s + z.unsqueeze(-1)).clamp(lo, qmax)
    return q.reshape(N, -1)[:, :K].to(torch.uint8)


def _store_scales(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round fp32 scales to ``dtype`` *upwards*: a scale rounded down would push the largest
    weights of a group past the last code (clamped, an error above half a step)."""
    finfo = torch.finfo(dtype)
    # An all-zero group has scale 0: any positive scale represents it exactly. Tiny scales
    # must stay normal numbers of the scale dtype (1e-10 underflows to 0 in fp16).
    scale = torch.where(scale > finfo.tiny, scale, torch.where(scale > 0, finfo.tiny, 1.0))
    # x * (1 + eps) rounds to nearest at no less than x: the rounding error is at most eps/2.
    return (scale * (1 + finfo.eps)).to(dtype)


def quantize(w: torch.Tensor, spec: QuantSpec) -> QuantizedWeight:
    """Round-to-nearest quantization of a ``[N, K]`` weight into the logical format."""
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(w.shape)}")
    N, K = w.shape
    G = spec.group_size_for(K)
    scale, zero = quantize_params(w, spec)
    scales = _store_scales(scale, spec.scale_dtype)
    # Quantize with the scales as stored (after rounding to the scale dtype), so that the
    # rounding error bound |w - deq| <= s/2 holds for the scale the kernels actually use.
    zeros = None if zero is None else zero.to(torch.uint8)
    q = quantize_with_params(w, scales, zeros, spec.bits, G)
    return QuantizedWeight(pack_codes(q, spec.bits), scales, zeros, spec.bits, G, K, N)


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights along N (fusing q/k/v or gate/up). They must share bits, K and group
    size; a symmetric part joins asymmetric ones with its implicit zero point made explicit."""
    first = parts[0]
    for p in parts[1:]:
        if (p.bits, p.in_features, p.group_size) != (first.bits, first.in_features, first.group_size):
            raise ValueError(
                f"cannot fuse weights quantized differently: int{p.bits} K={p.in_features} g{p.group_size} vs "
                f"int{first.bits} K={first.in_features} g{first.group_size}"
            )
    zeros = None
    if any(p.zeros is not None for p in parts):
        zeros = torch.cat([p.zero_points() for p in parts], 0)
    return QuantizedWeight(
        packed=torch.cat([p.packed for p in parts], 0),
        scales=torch.cat([p.scales.to(first.scales.dtype) for p in parts], 0),
        zeros=zeros,
        bits=first.bits,
        group_size=first.group_size,
        in_features=first.in_features,
        out_features=sum(p.out_features for p in parts),
    )


# SwiGLU's gate and up projections, fused into one weight [gate; up] (2I rows), are
# interleaved in blocks of this many rows for the GPU kernels: gate rows 8j..8j+7, then up
# rows 8j..8j+7, for j = 0..I/8-1. One 16-row tile of the GPU layout then holds gate and
# up of the same 8 channels, in the rows g and g + 8 that one mma lane accumulates, so the
# GEMV can write silu(gate) * up itself (csrc/gemv.cuh, swiglu_column).
GATE_UP_BLOCK = 8


def gate_up_row_order(rows: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Source row of each row of the interleaved gate/up weight (``rows`` = 2I, I % 8 == 0)."""
    if rows % (2 * GATE_UP_BLOCK):
        raise ValueError(f"gate/up interleaving needs 2I rows with I % {GATE_UP_BLOCK} == 0, got {rows}")
    half = rows // 2
    j = torch.arange(half // GATE_UP_BLOCK, device=device)[:, None, None] * GATE_UP_BLOCK
    r = torch.arange(GATE_UP_BLOCK, device=device)[None, None, :]
    return (j + r + torch.tensor([0, half], device=device)[None, :, None]).reshape(-1)


def interleave_gate_up(qw: QuantizedWeight) -> QuantizedWeight:
    """The fused ``[gate; up]`` weight with its rows in ``gate_up_row_order``."""
    order = gate_up_row_order(qw.out_features, qw.packed.device)
    return replace(qw, packed=qw.packed[order], scales=qw.scales[order],
                   zeros=None if qw.zeros is None else qw.zeros[order])
