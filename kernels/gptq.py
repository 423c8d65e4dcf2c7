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

    # The loop works on Wᵀ (a column of W is a contiguous row) and with the diagonal of
    # each block's Hinv and the column order as Python numbers: on the CPU a strided column
    # costs several times a row, and a scalar read from a tensor costs an op (on a GPU, a
    # sync). Each column's values are computed by the same ops as on W.
    groups = math.ceil(K / G)
    scales_t = torch.zeros(groups, N, device=W.device)  # (dynamic groups; transposed like Wᵀ)
    zeros_t = torch.zeros(groups, N, device=W.device)
    if act_order:
        scales_t, zeros_t = static_s.T.contiguous(), static_z.T.contiguous()
    codes_t = torch.empty(K, N, device=W.device)  # (integral values, uint8 at the end)
    qmax = (1 << spec.bits) - 1
    lo = 1 if (spec.bits == 8 and spec.symmetric) else 0
    Wt = W.T.contiguous()
    order = perm.tolist()
    update = torch.empty(min(block_size, K), N, device=W.device)  # (the rank-1 update of a block)
    for i1 in range(0, K, block_size):
        i2 = min(i1 + block_size, K)
        W1 = Wt[i1:i2].clone()
        Err1 = torch.empty_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        diag = Hinv1.diagonal().tolist()
        for i in range(i2 - i1):
            col = order[i1 + i]  # original column index
            g = col // G
            if not act_order and col % G == 0:  # entering a new group: fit it to the error-corrected weights
                ahead = torch.cat([W1[i:], Wt[i2:]])[: min(G, K - col)].T.contiguous()
                s_all, z_all = _group_params(ahead, spec, clip_search)
                scales_t[g], zeros_t[g] = s_all[:, 0], z_all[:, 0]
            s, z = scales_t[g], zeros_t[g]
            w, q, err = W1[i], codes_t[col], Err1[i]
            torch.div(w, s, out=q).add_(z).round_().clamp_(lo, qmax)
            torch.sub(q, z, out=err).mul_(s)
            torch.sub(w, err, out=err).div_(diag[i])
            rest = W1[i:]
            step = update[: rest.shape[0]]
            torch.mul(Hinv1[i, i:, None], err[None, :], out=step)
            rest.sub_(step)
        Wt[i2:] -= (Err1.T @ Hinv[i1:i2, i2:]).T
    codes = codes_t.T.contiguous().to(torch.uint8)
    scales, zeros = scales_t.T.contiguous(), zeros_t.T.contiguous()
    zero_codes = None if spec.symmetric else zeros.round().to(torch.uint8)
    return QuantizedWeight(pack_codes(codes, spec.bits), scales.to(spec.scale_dtype), zero_codes, spec.bits, G, K, N)
