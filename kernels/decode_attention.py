"""Decode attention over the per-slot KV cache, reading only each sequence's live tokens.

One query token per sequence (a decode step). The KV cache is ``[slots, kv_heads, T, D]``
per layer; sequence b lives in slot ``slots[b]`` and has ``lengths[b]`` valid positions.
The grid is (sequences, kv heads, splits): each program takes one KV head, all of its
query heads (grouped-query attention: the KV bytes are read once per group) and one of
``splits`` equal contiguous shares of the sequence's live length, keeping a running max
and sum (online softmax); the shares are then merged with their log-sum-exp weights
(flash-decoding), so a sequence at batch 1 spreads over many SMs, short or long. The grid
is fixed by the batch and the GPU, and the lengths are read on the device, so a step can
be captured in a CUDA graph once and replayed at any lengths.

One kernel per layer does all of a decode step's attention work (it was three: RoPE and
the cache write, the shares, their merge):

* with ``rope_cache_attention`` it rotates q and the new k (RoPE) straight from the qkv
  projection's output, and the program whose share holds the new position writes k and v
  into the cache before reading its share;
* the last program of a (sequence, KV head) to finish -- a counter per pair, re-armed by
  that program -- merges the shares, instead of a second kernel.

Measured against the three kernels it replaced (RoPE + cache write, split attention with
shares sized from the cache's length, merge), H100, int4 g128 random weights at position
128, graph step µs, median of 3 alternating runs in one process
(``profile_decode.graph_step_us``): Llama-3-8B batch 1 2663 vs 2653, batch 16 3913 vs
4106; SmolLM2-135M batch 1 687 vs 682, batch 16 761 vs 900. At batch 1 the small
kernels' launches were already hidden behind the GEMVs' programmatic launches
(``pdl.py``); at 16 the equal shares spread each sequence over more programs.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import pdl
from .device import sm_count
from .fused import programmatic_prologue, rope_rotate


@triton.jit
def _decode_attention_kernel(
    Q, K, V, Part, Lse, Out, Counters, slots, lengths, positions, COS, SIN,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_kt, stride_pb, stride_ps, stride_ph, stride_lb, stride_ls,
    stride_ob, stride_oh, stride_rope, scale,
    HEADS: tl.constexpr, HKV: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    SPLITS: tl.constexpr, ROPE: tl.constexpr, PDL: tl.constexpr,
):
    programmatic_prologue(PDL)
    GROUP: tl.constexpr = HEADS // HKV
    b = tl.program_id(0)
    hkv = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(slots + b)
    length = tl.load(lengths + b)
    # This sequence's shares: SPLITS equal ones of the live length (multiples of 16 tokens),
    # so a short sequence spreads over the programs as a long one does.
    share = tl.maximum(tl.cdiv(tl.cdiv(length, SPLITS), 16) * 16, 16)  # (>= 16: no division by 0 below)
    start = split * share
    end = tl.minimum(start + share, length)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    gmask = g < GROUP
    heads = hkv * GROUP + g
    q_rows = Q + b * stride_qb + heads[:, None] * stride_qh
    q = tl.load(q_rows + d[None, :], mask=gmask[:, None], other=0.0)
    k_base = K + slot * stride_ks + hkv * stride_kh
    v_base = V + slot * stride_ks + hkv * stride_kh
    if ROPE:  # Q is the qkv projection's row: q heads, then k heads, then v heads
        pos = tl.load(positions + b)
        cos_row = COS + pos * stride_rope
        sin_row = SIN + pos * stride_rope
        partner = (d + D // 2) % D
        q = rope_rotate(q, tl.load(q_rows + partner[None, :], mask=gmask[:, None], other=0.0), d[None, :],
                        cos_row, sin_row, D)
        if (pos >= start) & (pos < end):  # the new token falls in this share: cache it first
            k_row = Q + b * stride_qb + (HEADS + hkv) * stride_qh
            k_new = rope_rotate(tl.load(k_row + d), tl.load(k_row + partner), d, cos_row, sin_row, D)
            tl.store(k_base + pos * stride_kt + d, k_new)
            tl.store(v_base + pos * stride_kt + d, tl.load(Q + b * stride_qb + (HEADS + HKV + hkv) * stride_qh + d))
            tl.debug_barrier()  # (a block barrier orders global memory too: the loop below reads them)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
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
    # A share that saw tokens leaves its output and log-sum-exp (an empty one, past the
    # length, leaves nothing: the merge reads only the shares that saw a token).
    if start < end:
        tl.store(Part + b * stride_pb + split * stride_ps + heads[:, None] * stride_ph + d[None, :],
                 acc / l_i[:, None], mask=gmask[:, None])
        tl.store(Lse + b * stride_lb + split * stride_ls + heads, m_i + tl.log(l_i), mask=gmask)

    # Merge: the pair's last program to arrive. Every thread's stores above precede the
    # barrier, the barrier precedes the releasing increment (as CUTLASS's semaphores do);
    # the last program's acquiring increment precedes its reads, which bypass L1 (.cg).
    tl.debug_barrier()
    counter = Counters + b * HKV + hkv
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
        tl.store(counter, 0)  # re-armed for the next launch (stream-ordered after this one)
        used = tl.cdiv(length, share)  # the shares that saw a token
        s = tl.arange(0, SPLITS)
        lse = tl.load(Lse + b * stride_lb + s[:, None] * stride_ls + heads[None, :],
                      mask=(s[:, None] < used) & gmask[None, :], other=float("-inf"), cache_modifier=".cg")
        lse_max = tl.max(lse, 0)
        total = tl.zeros([GROUP_PAD, D], tl.float32)
        weight = tl.zeros([GROUP_PAD], tl.float32)
        for i in tl.static_range(SPLITS):  # (unrolled, predicated: the shares' loads fly together)
            live = gmask & (i < used)
            w = tl.exp(tl.load(Lse + b * stride_lb + i * stride_ls + heads, mask=live, other=float("-inf"),
                               cache_modifier=".cg") - lse_max)  # 0 for a share past the length
            part = tl.load(Part + b * stride_pb + i * stride_ps + heads[:, None] * stride_ph + d[None, :],
                           mask=live[:, None], other=0.0, cache_modifier=".cg")
            total += part * w[:, None]
            weight += w
        tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 (total / weight[:, None]).to(Out.dtype.element_ty), mask=gmask[:, None])


# One int32 per (sequence, KV head), zero between launches (each launch's merging programs
# re-arm theirs); per device, grown only outside a CUDA-graph capture, so that every graph
# captures a buffer that stays.
_counters: dict[torch.device, torch.Tensor] = {}


def _merge_counters(device: torch.device, n: int) -> torch.Tensor:
    have = _counters.get(device)
    if have is None or have.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"decode attention needs {n} merge counters during a CUDA-graph capture; "
                               "run the step once eagerly before capturing it")
        have = _counters[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return have


def _launch(q_src: torch.Tensor, stride_qh: int, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
            lengths: torch.Tensor, B: int, H: int, D: int, splits: int | None,
            rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    Hkv = k_cache.shape[1]
    group = H // Hkv
    if splits is None:  # enough programs to fill the GPU at batch 1, few at large batches
        splits = min(16, math.ceil(2 * sm_count(q_src.device) / (B * Hkv)))
    splits = triton.next_power_of_2(splits)  # (the merge loads the shares' [SPLITS] as one block)
    # (no fill: the merge reads only the shares that saw a token, and each of those wrote)
    part = torch.empty(B, splits, H, D, device=q_src.device, dtype=torch.float32)
    lse = torch.empty(B, splits, H, device=q_src.device, dtype=torch.float32)
    out = torch.empty(B, H, D, device=q_src.device, dtype=q_src.dtype)
    counters = _merge_counters(q_src.device, B * Hkv)
    positions, cos, sin = rope if rope is not None else (lengths, q_src, q_src)  # (unread without RoPE)
    _decode_attention_kernel[(B, Hkv, splits)](
        q_src, k_cache, v_cache, part, lse, out, counters, slots, lengths, positions, cos, sin,
        q_src.stride(0), stride_qh, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
        cos.stride(0), 1.0 / math.sqrt(D),
        HEADS=H, HKV=Hkv, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=D, BLOCK=64, SPLITS=splits,
        ROPE=rope is not None,
        **pdl.triton_kwargs(q_src.device),
    )
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     lengths: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """Attention of ``q`` ``[B, H, D]`` (one token per sequence) over ``lengths[b]`` cached
    positions of slot ``slots[b]`` in ``k_cache``/``v_cache`` ``[S, Hkv, T, D]``; ``[B, H, D]``.

    ``splits`` (rounded up to a power of two; default: from the batch and the GPU's SMs)
    shares per sequence and KV head; the launch does not depend on the lengths (CUDA-graph
    safe).
    """
    B, H, D = q.shape
    q = q.contiguous()
    return _launch(q, q.stride(1), k_cache, v_cache, slots, lengths, B, H, D, splits, None)


def rope_cache_attention(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         heads: int, head_dim: int, splits: int | None = None) -> torch.Tensor:
    """A decode step's attention from the qkv projection ``qkv`` ``[B, (H + 2 Hkv) D]``:
    q and k rotated at ``positions`` ``[B]`` (``cos``/``sin``: ``[max_len, D]`` tables, as
    ``fused.rope_and_cache`` takes them), k and v stored at that position of slot
    ``slots[b]``, then ``decode_attention`` of q over ``lengths[b]`` (> ``positions[b]``)
    positions; ``[B, H, D]``."""
    assert qkv.stride(-1) == 1, "qkv rows must be contiguous"
    return _launch(qkv, head_dim, k_cache, v_cache, slots, lengths, qkv.shape[0], heads, head_dim, splits,
                   (positions, cos, sin))
