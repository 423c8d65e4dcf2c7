"""Causal attention of packed query chunks over the paged KV cache, one launch for them all.

A packed forward (``models.batches.Prefill``) holds chunks of several sequences in one
row: prompt chunks, and in a step that mixes prefill with decode, every running
sequence's one new token (a chunk of one). Chunk i's tokens are at positions
``[p_i, p_i + n_i)`` of its sequence, whose keys and values -- the cached prefix and the
chunk itself, written just before by ``fused.rope_and_cache`` -- sit in the blocks of
block-table row ``r_i`` (layout: ``models/kv_cache.py``). A query at position p sees the
keys at positions ``[0, p]``.

The work is cut into **query tiles** of up to ``tile_tokens`` consecutive tokens of one
chunk, described on the device as int32 rows ``(first packed row, tokens, first position,
table row)``; a tile of 0 tokens does nothing. The grid is (tiles, KV heads, key splits):
a program takes its tile's tokens times all query heads of one KV head as the rows of its
``tl.dot``s (grouped-query attention: each key tile is loaded once for the whole group),
walks its share of the keys ``BLOCK_N`` at a time through the table (one vectorised load
of a key tile's table entries), and keeps a running max and sum (online softmax, fp32).
Because the grid and the tiles are device values of a fixed count, a CUDA graph captures
one launch for any mix of chunks up to that count (``engine/cuda_graphs.py``:
``PackedGraphs``).

**Key splits** (flash-decoding): a tile's keys ``[0, last position]`` may be cut into
``SPLITS`` equal runs of whole key tiles, one program each; the programs write their
unnormalised sums with their max and denominator (fp32), and a second kernel merges the
tile's splits. A program walks its keys one dependent load-dot-exp-dot round after
another, so a launch of few tiles, whose programs are few, is latency-bound; splits give
each program a fraction of the walk. The partial sums cost a write and a read per row,
head and split: little beside the keys for a tile of a few tokens (a decode token), about
as much again as the keys for a full 16-token tile; and where the tiles already fill the
GPU, more programs only add their start-up. So a split launch cuts the keys of every tile
if it has at most ``SPLIT_ALL_TOKENS`` packed rows, else only those of tiles of up to
``SMALL_TILE`` tokens; the other tiles write their rows themselves, as without splits.

By default only launches of up to ``SPLIT_TOKENS`` rows split (the packed graph of 16
tokens, whose tiles cannot fill the GPU): whether a larger launch gains depends on the
tiles in it, which a graph's launch does not know on the host (the measured gains and
losses: docs/design/attention.md).

Long chunks of an eager prefill (``models.batches.DENSE_FROM`` tokens or more) still take
SDPA, whose larger tiles read each key fewer times. Why not flash attention per chunk: one
call per chunk and layer is host time that a step of 64 sequences cannot afford, and a
graph cannot loop over a varying list.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import pdl
from .options import ChunkAttentionOptions


SPLITS = 8  # key splits of a split tile
SPLIT_TOKENS = 16  # launches of up to this many packed rows split by default
SPLIT_ALL_TOKENS = 128  # a split launch of up to this many rows splits every tile, beyond only small ones
SMALL_TILE = tl.constexpr(4)  # tokens: a tile of at most this many writes little partial sum per key it reads


@triton.jit
def _splits_of(n, SPLITS: tl.constexpr, SPLIT_ALL: tl.constexpr):
    """Key splits of a tile of ``n`` tokens (the same in both kernels)."""
    return tl.where((n <= SMALL_TILE) | SPLIT_ALL, SPLITS, 1)


@triton.jit
def _tile_rows(n, hkv, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr):
    """A tile's rows for KV head ``hkv`` (the same in both kernels): row i is token
    i // GROUP_PAD of the tile and query head i % GROUP_PAD of the group. Each row's token,
    query head and whether it is a real one (of the ``n`` tokens, of the ``GROUP`` heads),
    and the head dimension's offsets."""
    i = tl.arange(0, ROWS)
    tok = i // GROUP_PAD
    g = i % GROUP_PAD
    return tok, hkv * GROUP + g, (tok < n) & (g < GROUP), tl.arange(0, D)


@triton.jit
def _chunk_attention_kernel(
    Q, K, V, Table, Tiles, Out, Part, Stats,
    stride_qt, stride_qh, stride_kb, stride_kh, stride_kt, stride_table, stride_ot, stride_oh, scale,
    HEADS: tl.constexpr, HKV: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BS: tl.constexpr, SPLITS: tl.constexpr, SPLIT_ALL: tl.constexpr, PDL: tl.constexpr,
):
    GROUP: tl.constexpr = HEADS // HKV
    ROWS: tl.constexpr = BLOCK_M * GROUP_PAD
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    w = tl.program_id(0)
    hkv = tl.program_id(1)
    split = tl.program_id(2)
    row0 = tl.load(Tiles + w * 4)
    n = tl.load(Tiles + w * 4 + 1)
    pos0 = tl.load(Tiles + w * 4 + 2)
    table_row = Table + tl.load(Tiles + w * 4 + 3).to(tl.int64) * stride_table
    if PDL:
        tl.extra.cuda.gdc_wait()
    used = _splits_of(n, SPLITS, SPLIT_ALL)
    if (n > 0) & (split < used):
        tok, head, live, d = _tile_rows(n, hkv, GROUP, GROUP_PAD, ROWS, D)
        q = tl.load(Q + (row0 + tok)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=live[:, None], other=0.0)
        qpos = pos0 + tok
        k_base = K + hkv * stride_kh
        v_base = V + hkv * stride_kh
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D], tl.float32)
        end = pos0 + n  # keys [0, end): the last token's position and all before it
        # this split's keys: a run of whole key tiles (the last splits may have none)
        span = tl.cdiv(tl.cdiv(end, used), BLOCK_N) * BLOCK_N
        lo = split * span
        hi = tl.minimum(end, lo + span)
        for t0 in range(lo, hi, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            tmask = t < hi
            blk = tl.load(table_row + t // BS, mask=tmask, other=0)
            rows = blk.to(tl.int64) * stride_kb + (t % BS) * stride_kt
            k = tl.load(k_base + rows[:, None] + d[None, :], mask=tmask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where((t[None, :] <= qpos[:, None]) & tmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row that has seen no key of this split yet keeps a max of -inf: its
            # exponentials are taken against 0 so that they are 0, not NaN
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_ref)
            p = tl.exp(s - m_ref[:, None])
            v = tl.load(v_base + rows[:, None] + d[None, :], mask=tmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        out_row = (row0 + tok).to(tl.int64)
        if used == 1:  # (every row sees key 0, so its denominator is not 0)
            tl.store(Out + out_row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=live[:, None])
        else:  # Part [T, H, SPLITS, D], Stats [T, H, SPLITS, 2]: (max, denominator)
            at = (out_row * HEADS + head) * SPLITS + split
            tl.store(Part + at[:, None] * D + d[None, :], acc, mask=live[:, None])
            tl.store(Stats + at * 2, m_i, mask=live)
            tl.store(Stats + at * 2 + 1, l_i, mask=live)


@triton.jit
def _merge_splits_kernel(Tiles, Part, Stats, Out, stride_ot, stride_oh,
                         HEADS: tl.constexpr, HKV: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr,
                         BLOCK_M: tl.constexpr, SPLITS: tl.constexpr, SPLIT_ALL: tl.constexpr, PDL: tl.constexpr):
    """One tile's rows of one KV head's group: the splits' sums rescaled to their common
    max and added, over the added denominators."""
    GROUP: tl.constexpr = HEADS // HKV
    ROWS: tl.constexpr = BLOCK_M * GROUP_PAD
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    w = tl.program_id(0)
    hkv = tl.program_id(1)
    row0 = tl.load(Tiles + w * 4)
    n = tl.load(Tiles + w * 4 + 1)
    if PDL:
        tl.extra.cuda.gdc_wait()
    if (n > 0) & (_splits_of(n, SPLITS, SPLIT_ALL) > 1):  # (a tile of one split wrote its rows itself)
        tok, head, live, d = _tile_rows(n, hkv, GROUP, GROUP_PAD, ROWS, D)
        out_row = (row0 + tok).to(tl.int64)
        base = (out_row * HEADS + head) * SPLITS
        m = tl.full([ROWS], float("-inf"), tl.float32)
        for s in tl.static_range(SPLITS):
            m = tl.maximum(m, tl.load(Stats + (base + s) * 2, mask=live, other=float("-inf")))
        m = tl.where(live, m, 0.0)  # (split 0 holds key 0 for every live row: m is finite there)
        acc = tl.zeros([ROWS, D], tl.float32)
        den = tl.zeros([ROWS], tl.float32)
        for s in tl.static_range(SPLITS):
            scale = tl.exp(tl.load(Stats + (base + s) * 2, mask=live, other=float("-inf")) - m)
            den += scale * tl.load(Stats + (base + s) * 2 + 1, mask=live, other=0.0)
            acc += scale[:, None] * tl.load(Part + (base + s)[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
        tl.store(Out + out_row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 (acc / tl.where(live, den, 1.0)[:, None]).to(Out.dtype.element_ty), mask=live[:, None])


def chunk_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    tiles: torch.Tensor, tile_tokens: int, out: torch.Tensor | None = None,
                    programmatic: bool = False, splits: int | None = None,
                    walk: ChunkAttentionOptions = ChunkAttentionOptions()) -> torch.Tensor:
    """Causal attention of the packed queries ``q`` ``[T, H, D]`` over the cache, for the
    rows that ``tiles`` (int32 ``[W, 4]``: first row, tokens <= ``tile_tokens`` (a power of
    two), first position, block-table row) cover; written into ``out`` ``[T, H, D]`` (new if None;
    rows no tile covers are left as they are). ``k_cache``/``v_cache``: one layer's blocks
    ``[N, Hkv, BS, D]``; ``block_table``: int32 ``[rows, blocks_per_row]``. ``splits``: key
    splits of a split tile (None: ``SPLITS`` up to ``SPLIT_TOKENS`` rows, else 1);
    ``walk``: keys a step and pipeline stages of an unsplit launch. The launch depends on
    ``W`` and ``T`` only (CUDA-graph safe)."""
    T, H, D = q.shape
    Hkv, bs = k_cache.shape[1], k_cache.shape[2]
    assert v_cache.stride() == k_cache.stride() and k_cache.stride(3) == 1, "k and v caches of one layout"
    assert block_table.stride(1) == 1 and tiles.is_contiguous() and tiles.dtype == torch.int32
    assert q.stride(2) == 1 and D & (D - 1) == 0, f"head_dim {D} must be a power of two"
    if out is None:
        out = torch.empty_like(q)
    if splits is None:
        splits = SPLITS if T <= SPLIT_TOKENS else 1
    split_all = T <= SPLIT_ALL_TOKENS
    group_pad = triton.next_power_of_2(H // Hkv)
    # keys per step: whole blocks, ~16 KB of k at 64 keys of head_dim 128
    keys, stages = (walk.keys_per_step, walk.stages) if splits == 1 else (64, 2)
    block_n = max(bs, keys if D <= 128 else keys // 2)
    warps = 4 if tile_tokens * group_pad * D <= 8192 else 8
    if tiles.shape[0]:
        # (the partial sums of every row, head and split, and their max and denominator)
        part = q.new_empty((T, H, splits, D), dtype=torch.float32) if splits > 1 else out
        stats = q.new_empty((T, H, splits, 2), dtype=torch.float32) if splits > 1 else out
        _chunk_attention_kernel[(tiles.shape[0], Hkv, splits)](
            q, k_cache, v_cache, block_table, tiles, out, part, stats,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
            out.stride(0), out.stride(1), 1.0 / math.sqrt(D),
            HEADS=H, HKV=Hkv, GROUP_PAD=group_pad, D=D, BLOCK_M=tile_tokens, BLOCK_N=block_n, BS=bs,
            SPLITS=splits, SPLIT_ALL=split_all, num_warps=warps, num_stages=stages,
            **pdl.triton_kwargs(q.device, programmatic),
        )
        if splits > 1:
            _merge_splits_kernel[(tiles.shape[0], Hkv)](
                tiles, part, stats, out, out.stride(0), out.stride(1),
                HEADS=H, HKV=Hkv, GROUP_PAD=group_pad, D=D, BLOCK_M=tile_tokens, SPLITS=splits,
                SPLIT_ALL=split_all, num_warps=warps, **pdl.triton_kwargs(q.device, programmatic),
            )
    return out
