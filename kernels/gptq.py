"""GPTQ (Frantar et al., 2022): quantize a weight column by column, spreading each column's
rounding error over the columns not yet quantized, weighted by the inverse Hessian of the
layer's inputs (H = X Xᵀ over calibration tokens).

Output is the logical format of ``format.py``: contiguous groups along K. With
``act_order`` the columns are *processed* in order of decreasing Hessian diagonal (the
most salient first), but group scales/zeros are fixed beforehand on the original,
contiguous groups ("static groups"), so no input permutation (g_idx) is needed at run time.
"""
from __future__ import annotations

import math

import torch

from .format import QuantizedWeight, QuantSpec, _store_scales, clip_search_params, midpoint, pack_codes, quantize_params


def _group_params(w: torch.Tensor, spec: QuantSpec, clip_search: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group (stored) scales and zero points, float32 ``[N, groups]``."""
    scale, zero = clip_search_params(w, spec) if clip_search else quantize_params(w, spec)
    s = _store_scales(scale, spec.scale_dtype)
    z = torch.full_like(scale, midpoint(spec.bits)) if zero is None else zero
    return s, z


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    spec: QuantSpec,
    act_order: bool = False,
    damp: float = 0.01,
    block_size: int = 128,
    clip_search: bool = True,
) -> QuantizedWeight:
    """GPTQ-quantize ``weight`` ``[N, K]`` given ``hessian`` ``[K, K]`` (on any device).

    ``clip_search``: fit each group's range by the error-minimising shrink of min/max
    (``format.clip_search_params``) instead of plain min/max."""
    W = weight.detach().float().clone()
    N, K = W.shape
    G = spec.group_size_for(K)
    H = hessian.detach().float().clone()
    dead = torch.diag(H) == 0  # inputs never active in the calibration data
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    # Group parameters from the (dead-column-zeroed) weights, before any error feedback for
    # static groups; dynamic groups (no act_order) are recomputed as GPTQ reaches them.
    static_s, static_z = _group_params(W, spec, clip_search) if act_order else (None, None)
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(K, device=W.device)
    W, H = W[:, perm], H[perm][:, perm]
    H += damp * torch.mean(torch.diag(H)) * torch.eye(K, device=H.device)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

    groups = math.ceil(K / G)
    scales = torch.zeros(N, groups, device=W.device)
    zeros = torch.zeros(N, groups, device=W.device)
    codes = torch.zeros(N, K, dtype=torch.uint8, device=W.device)
    qmax = (1 << spec.bits) - 1
    lo = 1 if (spec.bits == 8 and spec.symmetric) else 0
    for i1 in range(0, K, block_size):
        i2 = min(i1 + block_size, K)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = int(perm[i1 + i])  # original column index
            g = col // G
            if act_order:
                s, z = static_s[:, g], static_z[:, g]
            else:
                if col % G == 0:  # entering a new group: fit it to the error-corrected weights
                    s_all, z_all = _group_params(torch.cat([W1[:, i:], W[:, i2:]], 1)[:, : min(G, K - col)], spec, clip_search)
                    scales[:, g], zeros[:, g] = s_all[:, 0], z_all[:, 0]
                s, z = scales[:, g], zeros[:, g]
            w = W1[:, i]
            q = torch.clamp(torch.round(w / s + z), lo, qmax)
            codes[:, col] = q.to(torch.uint8)
            err = (w - (q - z) * s) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    if act_order:
        scales, zeros = static_s, static_z
    zero_codes = None if spec.symmetric else zeros.round().to(torch.uint8)
    return QuantizedWeight(pack_codes(codes, spec.bits), scales.to(spec.scale_dtype), zero_codes, spec.bits, G, K, N)
