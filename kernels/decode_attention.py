"""Decode attention over the per-slot KV cache, reading only each sequence's live tokens.

One query token per sequence (a decode step). The KV cache is ``[slots, kv_heads, T, D]``
per layer; sequence b lives in slot ``slots[b]`` and has ``lengths[b]`` valid positions.
The grid is (sequences, kv heads, splits): each program takes one KV head, all of its
query heads (grouped-query attention: the KV bytes are read once per group) and one
contiguous share of the sequence, keeping a running max and sum (online softmax); the
shares are then merged with their log-sum-exp weights (flash-decoding), so a long sequence
at batch 1 still spreads over many SMs. Shapes are static and the lengths are read on the
device, so a step can be captured in a CUDA graph once and replayed at any lengths.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import pdl
from .device import sm_count
from .fused import programmatic_prologue


@triton.jit
def _decode_attention_split(
    Q, K, V, Out, Lse, slots, lengths,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_kt, stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
    scale, split_len,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    programmatic_prologue(PDL)
    b = tl.program_id(0)
    hkv = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(slots + b)
    length = tl.load(lengths + b)
    start = split * split_len
    end = tl.minimum(start + split_len, length)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    gmask = g < GROUP
    q = tl.load(Q + b * stride_qb + (hkv * GROUP + g)[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    k_base = K + slot * stride_ks + hkv * stride_kh
    v_base = V + slot * stride_ks + hkv * stride_kh
    for t0 in range(start, end, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        tmask = t < end
        k = tl.load(k_base + t[:, None] * stride_kt + d[None, :], mask=tmask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale  # [GROUP_PAD, BLOCK], fp32
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_base + t[:, None] * stride_kt + d[None, :], mask=tmask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    heads = hkv * GROUP + g
    o = acc / l_i[:, None]
    tl.store(Out + b * stride_ob + split * stride_os + heads[:, None] * stride_oh + d[None, :], o,
             mask=gmask[:, None] & (l_i[:, None] > 0))
    tl.store(Lse + b * stride_lb + split * stride_ls + heads, m_i + tl.log(l_i), mask=gmask)


@triton.jit
def _merge_splits(Out, Lse, Final, lengths, stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_fb,
                  stride_fh, split_len, SPLITS: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr):
    programmatic_prologue(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    length = tl.load(lengths + b)
    used = (length + split_len - 1) // split_len  # splits that saw at least one token
    s = tl.arange(0, SPLITS)
    smask = s < used
    lse = tl.load(Lse + b * stride_lb + s * stride_ls + h, mask=smask, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, 0))
    w = tl.where(smask, w, 0.0)
    d = tl.arange(0, D)
    o = tl.load(Out + b * stride_ob + s[:, None] * stride_os + h * stride_oh + d[None, :], mask=smask[:, None], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(Final + b * stride_fb + h * stride_fh + d, out.to(Final.dtype.element_ty))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     lengths: torch.Tensor, max_len: int, splits: int | None = None) -> torch.Tensor:
    """Attention of ``q`` ``[B, H, D]`` (one token per sequence) over ``lengths[b]`` cached
    positions of slot ``slots[b]`` in ``k_cache``/``v_cache`` ``[S, Hkv, T, D]``; ``[B, H, D]``.

    ``max_len`` bounds the lengths (the cache's T) and fixes the split size, so the launch
    does not depend on the lengths (CUDA-graph safe).
    """
    B, H, D = q.shape
    Hkv = k_cache.shape[1]
    group = H // Hkv
    if splits is None:  # enough programs to fill the GPU at batch 1, few at large batches
        splits = max(1, min(16, triton.next_power_of_2(math.ceil(2 * sm_count(q.device) / (B * Hkv)))))
    split_len = max(64, math.ceil(max_len / splits / 64) * 64)
    splits = math.ceil(max_len / split_len)
    splits_pad = triton.next_power_of_2(splits)
    out = torch.empty(B, splits_pad, H, D, device=q.device, dtype=torch.float32)
    # No fill needed (one kernel fewer per layer): the merge reads only the splits that saw
    # a token, and each of those wrote its lse.
    lse = torch.empty(B, splits_pad, H, device=q.device, dtype=torch.float32)
    q = q.contiguous()
    launch = pdl.triton_kwargs(q.device)
    _decode_attention_split[(B, Hkv, splits)](
        q, k_cache, v_cache, out, lse, slots, lengths,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        1.0 / math.sqrt(D), split_len,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=D, BLOCK=64, **launch,
    )
    final = torch.empty_like(q)
    _merge_splits[(B, H)](out, lse, final, lengths, out.stride(0), out.stride(1), out.stride(2), lse.stride(0),
                          lse.stride(1), final.stride(0), final.stride(1), split_len, SPLITS=splits_pad, D=D, **launch)
    return final
