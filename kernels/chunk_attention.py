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
table row)``; a tile of 0 tokens does nothing. The grid is (tiles, KV heads): a program
takes its tile's tokens times all query heads of one KV head as the rows of its
``tl.dot``s (grouped-query attention: each key tile is loaded once for the whole group),
walks the keys from position 0 to its last token's position ``BLOCK_N`` at a time through
the table (one vectorised load of a key tile's table entries), and keeps a running max and
sum (online softmax, fp32). Because the grid and the tiles are device values of a fixed
count, a CUDA graph captures one launch for any mix of chunks up to that count
(``engine/cuda_graphs.py``: ``PackedGraphs``).

Why not split the keys as ``decode_attention`` does: the chunks of a mixed step come in
numbers (a running batch of decode tokens, prompt tiles), which fill the GPU without
splits. Why not flash attention per chunk: one call per chunk and layer is host time that
a step of 64 sequences cannot afford, and a graph cannot loop over a varying list. Long
chunks of an eager prefill (``models.batches.DENSE_FROM`` tokens or more) still take SDPA, whose larger
tiles read each key fewer times.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import pdl


@triton.jit
def _chunk_attention_kernel(
    Q, K, V, Table, Tiles, Out,
    stride_qt, stride_qh, stride_kb, stride_kh, stride_kt, stride_table, stride_ot, stride_oh, scale,
    HEADS: tl.constexpr, HKV: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BS: tl.constexpr, PDL: tl.constexpr,
):
    GROUP: tl.constexpr = HEADS // HKV
    ROWS: tl.constexpr = BLOCK_M * GROUP_PAD
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    w = tl.program_id(0)
    hkv = tl.program_id(1)
    row0 = tl.load(Tiles + w * 4)
    n = tl.load(Tiles + w * 4 + 1)
    pos0 = tl.load(Tiles + w * 4 + 2)
    table_row = Table + tl.load(Tiles + w * 4 + 3).to(tl.int64) * stride_table
    if PDL:
        tl.extra.cuda.gdc_wait()
    if n > 0:
        # row i of the tile: token i // GROUP_PAD of the tile, query head i % GROUP_PAD of the group
        i = tl.arange(0, ROWS)
        tok = i // GROUP_PAD
        g = i % GROUP_PAD
        live = (tok < n) & (g < GROUP)
        head = hkv * GROUP + g
        d = tl.arange(0, D)
        q = tl.load(Q + (row0 + tok)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=live[:, None], other=0.0)
        qpos = pos0 + tok  # every row sees key 0, so no row's softmax is empty (no NaN)
        k_base = K + hkv * stride_kh
        v_base = V + hkv * stride_kh
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D], tl.float32)
        end = pos0 + n  # keys [0, end): the last token's position and all before it
        for t0 in range(0, end, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            tmask = t < end
            blk = tl.load(table_row + t // BS, mask=tmask, other=0)
            rows = blk.to(tl.int64) * stride_kb + (t % BS) * stride_kt
            k = tl.load(k_base + rows[:, None] + d[None, :], mask=tmask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(t[None, :] <= qpos[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            v = tl.load(v_base + rows[:, None] + d[None, :], mask=tmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(Out + (row0 + tok)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=live[:, None])


def chunk_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    tiles: torch.Tensor, tile_tokens: int, out: torch.Tensor | None = None,
                    programmatic: bool = False) -> torch.Tensor:
    """Causal attention of the packed queries ``q`` ``[T, H, D]`` over the cache, for the
    rows that ``tiles`` (int32 ``[W, 4]``: first row, tokens <= ``tile_tokens`` (a power of
    two), first position, block-table row) cover; written into ``out`` ``[T, H, D]`` (new if None;
    rows no tile covers are left as they are). ``k_cache``/``v_cache``: one layer's blocks
    ``[N, Hkv, BS, D]``; ``block_table``: int32 ``[rows, blocks_per_row]``. The launch
    depends on ``W`` only (CUDA-graph safe)."""
    T, H, D = q.shape
    Hkv, bs = k_cache.shape[1], k_cache.shape[2]
    assert v_cache.stride() == k_cache.stride() and k_cache.stride(3) == 1, "k and v caches of one layout"
    assert block_table.stride(1) == 1 and tiles.is_contiguous() and tiles.dtype == torch.int32
    assert q.stride(2) == 1 and D & (D - 1) == 0, f"head_dim {D} must be a power of two"
    if out is None:
        out = torch.empty_like(q)
    group_pad = triton.next_power_of_2(H // Hkv)
    block_n = max(bs, 64 if D <= 128 else 32)  # keys per step: whole blocks, ~16 KB of k
    if tiles.shape[0]:
        _chunk_attention_kernel[(tiles.shape[0], Hkv)](
            q, k_cache, v_cache, block_table, tiles, out,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
            out.stride(0), out.stride(1), 1.0 / math.sqrt(D),
            HEADS=H, HKV=Hkv, GROUP_PAD=group_pad, D=D, BLOCK_M=tile_tokens, BLOCK_N=block_n, BS=bs,
            num_warps=4 if tile_tokens * group_pad * D <= 8192 else 8, num_stages=2,
            **pdl.triton_kwargs(q.device, programmatic),
        )
    return out
