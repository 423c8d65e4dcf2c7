"""Decode attention over the paged KV cache, reading only each sequence's live tokens.

One query token per sequence (a decode step). The KV cache is paged
(``models/kv_cache.py``): per layer ``[blocks, kv_heads, BS, D]``, and one block table
``[rows, blocks_per_row]``; sequence b owns row ``slots[b]`` of the table and has
``lengths[b]`` valid positions, position t in block ``block_table[slots[b], t // BS]`` at
offset ``t % BS``. A tile of the kernel spans several blocks: it gathers its tokens' rows
through the table (one vectorised load of the tile's entries, then the k and v rows).
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
  projection's output; the program whose share holds the new position writes k and v
  into the cache, and every program takes them from registers;
* the last program of a (sequence, KV head) to finish -- a counter per pair, re-armed by
  that program -- merges the shares, instead of a second kernel; a sequence whose length
  fits in one share (a tile, see ``tiles``) has one program per KV head, which writes
  the output itself.

Where its time goes. At batch 1 the kernel sits between two GEMVs, and what it costs is
the latency it adds to that chain, not bandwidth (a KB of q and a few hundred KB of
cache). Launched programmatically (``pdl.py``), its programs start while the qkv
projection still runs, so all that does not depend on the projection -- the step's
lengths and positions, the cached k and v of the first tile, the RoPE rows -- is loaded
before ``griddepcontrol.wait``; a program whose share is past the length leaves at once
instead of holding an SM the next GEMV's blocks could take; at small batches, tiles of
128 tokens without software pipelining keep its shared memory small for the same reason
(``tiles``; larger batches are bandwidth-bound and take pipelined tiles of 32).
The kernel lets the o projection launch at its start (``launch_next``). Measurements of
these choices and of the alternatives tried (other tile sizes and stage counts, fewer
shares, later launches of o, fewer registers to share an SM with a GEMV block) are in
docs/design/attention.md.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import pdl
from .device import sm_count
from .fused import LAUNCH_NEXT, rope_rotate
from .options import DecodeAttentionOptions


@triton.jit
def _cache_rows(table_row, t, end, stride_kb, stride_kt, BS: tl.constexpr):
    """Offsets in one layer's cache (add ``hkv * stride_kh`` for a KV head) of positions
    ``t`` (a tile) of the sequence whose block-table row starts at ``table_row``.

    One vectorised load of the tile's table entries, one per position: the ``BS`` positions
    of a block read the same entry, and a tile's entries are a few consecutive int32s (a
    sector or two), so this costs one dependent round trip ahead of the k/v loads.
    Masked past ``end``, where the tile may run past the table row (the k/v loads are
    masked there too; unassigned entries inside the row are 0, the scratch block). Offsets
    in int64: one layer's pool may pass 2^31 elements."""
    blk = tl.load(table_row + t // BS, mask=t < end, other=0)
    return blk.to(tl.int64) * stride_kb + (t % BS) * stride_kt


@triton.jit
def _decode_attention_kernel(
    Q, K, V, Table, Part, Lse, Out, Counters, slots, lengths, positions, COS, SIN,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kt, stride_table, stride_pb, stride_ps, stride_ph,
    stride_lb, stride_ls, stride_ob, stride_oh, stride_rope, scale,
    HEADS: tl.constexpr, HKV: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    BS: tl.constexpr, SPLITS: tl.constexpr, ROPE: tl.constexpr, PDL: tl.constexpr, LAUNCH: tl.constexpr,
):
    GROUP: tl.constexpr = HEADS // HKV
    if PDL and LAUNCH == 0:  # when the next kernel may launch: fused.LAUNCH_NEXT
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    hkv = tl.program_id(1)
    split = tl.program_id(2)
    # Before waiting for the previous kernel (the qkv projection), all that does not
    # depend on it: the step's inputs (written before the step's first kernel: the block
    # table too) and the cached k and v of the earlier positions -- the first tile's DRAM
    # latency then passes while the projection still runs instead of after it.
    table_row = Table + tl.load(slots + b) * stride_table  # this sequence's blocks
    length = tl.load(lengths + b)
    # This sequence's shares: SPLITS equal ones of the live length (multiples of 16
    # tokens), at least a tile each: a short sequence takes one program per KV head, which
    # then writes its output itself (no partial results, no merge).
    share = tl.maximum(tl.cdiv(tl.cdiv(length, SPLITS), 16) * 16, BLOCK)
    used = tl.cdiv(length, share)  # the shares that hold a token
    start = split * share
    end = tl.minimum(start + share, length)
    if ROPE:
        pos = tl.load(positions + b)  # the new token's position (= length - 1): from qkv, not the cache
    else:
        pos = length  # the caller cached every position already
    # A program past the length leaves at once, without waiting: it holds no SM the next
    # kernel's blocks could start on (a share's program always waits, so this kernel still
    # completes after its predecessor).
    if start < end:
        d = tl.arange(0, D)
        t = start + tl.arange(0, BLOCK)
        k_base = K + hkv * stride_kh
        v_base = V + hkv * stride_kh
        rows = _cache_rows(table_row, t, end, stride_kb, stride_kt, BS)
        cached = ((t < end) & (t != pos))[:, None]
        k = tl.load(k_base + rows[:, None] + d[None, :], mask=cached, other=0.0)
        v = tl.load(v_base + rows[:, None] + d[None, :], mask=cached, other=0.0)
        if ROPE:  # this position's RoPE rows (fp32 tables, DRAM) and cache row too
            cos = tl.load(COS + pos * stride_rope + d)
            sin = tl.load(SIN + pos * stride_rope + d)
            owner = (pos >= start) & (pos < end)  # this share holds the new position: it caches k and v
            new = tl.load(table_row + pos // BS, mask=owner, other=0).to(tl.int64) * stride_kb
            new += (pos % BS) * stride_kt
        if PDL:
            tl.extra.cuda.gdc_wait()

        g = tl.arange(0, GROUP_PAD)
        gmask = g < GROUP
        heads = hkv * GROUP + g
        q_rows = Q + b * stride_qb + heads[:, None] * stride_qh
        q = tl.load(q_rows + d[None, :], mask=gmask[:, None], other=0.0)
        if ROPE:  # Q is the qkv projection's row: q heads, then k heads, then v heads
            partner = (d + D // 2) % D
            q = rope_rotate(q, tl.load(q_rows + partner[None, :], mask=gmask[:, None], other=0.0), d[None, :],
                            cos[None, :], sin[None, :], D)
            k_row = Q + b * stride_qb + (HEADS + hkv) * stride_qh
            k_new = rope_rotate(tl.load(k_row + d), tl.load(k_row + partner), d, cos, sin, D)
            v_new = tl.load(Q + b * stride_qb + (HEADS + HKV + hkv) * stride_qh + d)
            # the share holding the new position caches it, and every share takes it from
            # registers (its tile left that row out), so nothing waits for the store
            mine = (d < D) & owner
            tl.store(k_base + new + d, k_new, mask=mine)
            tl.store(v_base + new + d, v_new, mask=mine)
            new_row = (t == pos)[:, None]
            k = tl.where(new_row, k_new[None, :], k)
            v = tl.where(new_row, v_new[None, :], v)

        # online softmax over the share: the first tile (loaded above), then the rest
        s = tl.dot(q, tl.trans(k)) * scale  # [GROUP_PAD, BLOCK], fp32
        if PDL and LAUNCH == 1:  # (q is in)
            tl.extra.cuda.gdc_launch_dependents()
        s = tl.where((t < end)[None, :], s, float("-inf"))
        m_i = tl.max(s, 1)
        p = tl.exp(s - m_i[:, None])
        l_i = tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v)
        for t0 in range(start + BLOCK, end, BLOCK):
            t = t0 + tl.arange(0, BLOCK)
            tmask = t < end
            rows = _cache_rows(table_row, t, end, stride_kb, stride_kt, BS)
            k = tl.load(k_base + rows[:, None] + d[None, :], mask=tmask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(tmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            v = tl.load(v_base + rows[:, None] + d[None, :], mask=tmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new

        out_ptrs = Out + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
        if used == 1:
            tl.store(out_ptrs, (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=gmask[:, None])
        else:
            # Several shares: each leaves its output and log-sum-exp, and the last of the
            # `used` programs to arrive merges them. Every thread's stores precede the
            # barrier, the barrier precedes the releasing increment (as CUTLASS's
            # semaphores do); the last program's acquiring increment precedes its reads,
            # which bypass L1 (.cg). Programs past the length take no part.
            tl.store(Part + b * stride_pb + split * stride_ps + heads[:, None] * stride_ph + d[None, :],
                     acc / l_i[:, None], mask=gmask[:, None])
            tl.store(Lse + b * stride_lb + split * stride_ls + heads, m_i + tl.log(l_i), mask=gmask)
            tl.debug_barrier()
            counter = Counters + b * HKV + hkv
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == used - 1:
                tl.store(counter, 0)  # re-armed for the next launch (stream-ordered after this one)
                sh = tl.arange(0, SPLITS)
                lse = tl.load(Lse + b * stride_lb + sh[:, None] * stride_ls + heads[None, :],
                              mask=(sh[:, None] < used) & gmask[None, :], other=float("-inf"), cache_modifier=".cg")
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
                tl.store(out_ptrs, (total / weight[:, None]).to(Out.dtype.element_ty), mask=gmask[:, None])
        if PDL and LAUNCH == 2:
            tl.extra.cuda.gdc_launch_dependents()


def tiles(batch: int, kv_heads: int, device: torch.device,
          wide: DecodeAttentionOptions = DecodeAttentionOptions()) -> tuple[int, int]:
    """(tokens per tile -- the least a share holds --, software-pipeline stages of the tile
    loop) for a launch over ``batch`` sequences.

    Few (sequence, KV head) pairs -- under a quarter of the SMs: a small batch, where
    the kernel's cost is the latency it adds between two GEMVs -- take tiles of 128 tokens
    without pipelining: fewer programs, each with little shared memory and more of its
    tokens loaded before the wait (its first tile). More pairs take ``wide``'s tiles (by
    default 32 tokens with 3 stages), for bandwidth (measured: docs/design/attention.md,
    benchmarks/decode_attention.py).
    """
    if batch * kv_heads * 4 < sm_count(device):
        return 128, 1
    return wide.tile_tokens, wide.stages


def default_launch(batch: int, kv_heads: int, device: torch.device,
                   wide: DecodeAttentionOptions = DecodeAttentionOptions()) -> tuple[int, int, int]:
    """(tile tokens, stages, splits) of a launch over ``batch`` sequences that names none:
    ``tiles``, and enough shares to fill the GPU at batch 1, few at large batches."""
    block, stages = tiles(batch, kv_heads, device, wide)
    splits = min(16, math.ceil(2 * sm_count(device) / (batch * kv_heads)))
    return block, stages, triton.next_power_of_2(splits)


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


def _launch(q_src: torch.Tensor, stride_qh: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
            block_table: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, B: int, H: int, D: int,
            splits: int | None, block: int | None, stages: int | None,
            rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, launch_next: str = "start",
            programmatic: bool = False, wide: DecodeAttentionOptions = DecodeAttentionOptions()) -> torch.Tensor:
    Hkv, bs = k_cache.shape[1], k_cache.shape[2]
    # (k and v share one set of strides, a position's D values are contiguous, so are a
    # table row's entries)
    assert v_cache.stride() == k_cache.stride() and k_cache.stride(3) == 1, "k and v caches of one layout"
    assert block_table.stride(1) == 1, "block-table rows must be contiguous"
    assert bs & (bs - 1) == 0, f"cache block size {bs} is not a power of two"
    group = H // Hkv
    default_block, default_stages, default_splits = default_launch(B, Hkv, q_src.device, wide)
    block, stages = block or default_block, stages or default_stages
    splits = triton.next_power_of_2(splits or default_splits)  # (the merge loads the shares' [SPLITS] as one block)
    # (no fill: the merge reads only the shares that saw a token, and each of those wrote)
    part = torch.empty(B, splits, H, D, device=q_src.device, dtype=torch.float32)
    lse = torch.empty(B, splits, H, device=q_src.device, dtype=torch.float32)
    out = torch.empty(B, H, D, device=q_src.device, dtype=q_src.dtype)
    counters = _merge_counters(q_src.device, B * Hkv)
    positions, cos, sin = rope if rope is not None else (lengths, q_src, q_src)  # (unread without RoPE)
    _decode_attention_kernel[(B, Hkv, splits)](
        q_src, k_cache, v_cache, block_table, part, lse, out, counters, slots, lengths, positions, cos, sin,
        q_src.stride(0), stride_qh, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
        cos.stride(0), 1.0 / math.sqrt(D),
        HEADS=H, HKV=Hkv, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=D, BLOCK=block, BS=bs, SPLITS=splits,
        ROPE=rope is not None, LAUNCH=LAUNCH_NEXT[launch_next], num_warps=min(16, max(4, block * D // 2048)),
        num_stages=stages, **pdl.triton_kwargs(q_src.device, programmatic),
    )
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     slots: torch.Tensor, lengths: torch.Tensor, splits: int | None = None, block: int | None = None,
                     stages: int | None = None, programmatic: bool = False,
                     wide: DecodeAttentionOptions = DecodeAttentionOptions()) -> torch.Tensor:
    """Attention of ``q`` ``[B, H, D]`` (one token per sequence) over ``lengths[b]`` cached
    positions of block-table row ``slots[b]``; ``[B, H, D]``. ``k_cache``/``v_cache``: one
    layer's blocks ``[N, Hkv, BS, D]`` (BS a power of two), ``block_table``: int32 ``[rows,
    blocks_per_row]``, position t of row r in block ``block_table[r, t // BS]``.

    ``splits`` (rounded up to a power of two; default: from the batch and the GPU's SMs)
    shares per sequence and KV head, each at least ``block`` tokens (a power of two >= 16)
    unless the length is shorter, their tile loop pipelined over ``stages`` (defaults of
    both: ``tiles``, with ``wide`` at large batches); the launch does not depend on the
    lengths (CUDA-graph safe).
    """
    B, H, D = q.shape
    q = q.contiguous()
    return _launch(q, q.stride(1), k_cache, v_cache, block_table, slots, lengths, B, H, D, splits, block, stages,
                   None, programmatic=programmatic, wide=wide)


def rope_cache_attention(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_table: torch.Tensor, heads: int, head_dim: int, splits: int | None = None,
                         block: int | None = None, stages: int | None = None, launch_next: str = "start",
                         programmatic: bool = False,
                         wide: DecodeAttentionOptions = DecodeAttentionOptions()) -> torch.Tensor:
    """A decode step's attention from the qkv projection ``qkv`` ``[B, (H + 2 Hkv) D]``:
    q and k rotated at ``positions`` ``[B]`` (``cos``/``sin``: ``[max_len, D]`` tables, as
    ``fused.rope_and_cache`` takes them), k and v stored at that position of block-table
    row ``slots[b]`` (its block through ``block_table``), then ``decode_attention`` of q over
    ``lengths[b]`` (> ``positions[b]``) positions; ``[B, H, D]``."""
    assert qkv.stride(-1) == 1, "qkv rows must be contiguous"
    return _launch(qkv, head_dim, k_cache, v_cache, block_table, slots, lengths, qkv.shape[0], heads, head_dim,
                   splits, block, stages, (positions, cos, sin), launch_next, programmatic, wide)
