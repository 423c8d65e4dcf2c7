"""Paged KV cache: keys and values in fixed-size blocks of one pool, found through a table.

Layout per layer ``[blocks, kv_heads, block_size, head_dim]``, and one block table
``[rows, blocks_per_row]`` (int32, on the device) shared by every layer: a sequence owns a
row, and position t of the sequence in row r lives in block ``block_table[r, t //
block_size]`` at offset ``t % block_size``. A batch names its sequences by row (the
``slots`` of ``models/batches.py``), so every kernel of a step reads a table on the device
and a CUDA graph replays at any block assignment.

Block 0 is a scratch block that no sequence owns: every table entry not assigned points
at it, so a write past a sequence's blocks (a graph's padding rows, a decode step queued
ahead for a sequence that has ended) lands there, and a read past a sequence's length,
which attention masks, reads finite values. The pool is zero-filled for that reason (a
masked NaN would still poison ``softmax @ V``).

Which blocks a row gets is the engine's choice (``engine/kv_blocks.py``: allocation and
prefix caching); without ``num_blocks`` every row gets blocks of its own up front, the
fixed-slot cache of a caller that does not page (tests, scoring, benchmarks).
"""
from __future__ import annotations

import math

import torch

from ..kernels.device import to_device


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_rows: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        block_size: int = 16,
        num_blocks: int | None = None,
    ):
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, not {block_size}")
        self.block_size = block_size
        self.blocks_per_row = math.ceil(max_seq_len / block_size)
        fixed = num_blocks is None
        if fixed:
            num_blocks = 1 + num_rows * self.blocks_per_row
        shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_table = torch.zeros(num_rows, self.blocks_per_row, dtype=torch.int32, device=device)
        if fixed:
            self.block_table += torch.arange(1, num_blocks, dtype=torch.int32, device=device).view(num_rows, -1)
        self.num_rows = num_rows
        self.num_blocks = num_blocks
        self.max_seq_len = max_seq_len

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def bytes_per_block(self) -> int:
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    # -- the table (host-driven: the engine's allocator decides) -----------------------
    def assign(self, row: int, first: int, blocks: list[int]) -> None:
        """Point entries ``[first, first + len(blocks))`` of ``row`` at ``blocks``."""
        if blocks:
            self.block_table[row, first:first + len(blocks)] = torch.tensor(blocks, dtype=torch.int32)

    def assign_entries(self, entries: torch.Tensor) -> None:
        """Write table entries ``entries`` (CPU int32 ``[n, 3]``: row, index, block) in one
        copy to the device."""
        dev = to_device(entries, self.block_table.device)  # (queued: a step may be queued ahead)
        self.block_table[dev[:, 0].long(), dev[:, 1].long()] = dev[:, 2]

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src``'s keys and values (every layer) into block ``dst``."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    # -- torch reads and writes (the kernels do the same through the table) -------------
    def locate(self, rows: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of each position ``[N]`` of its row ``[N]``."""
        blocks = self.block_table[rows, positions // self.block_size].long()
        return blocks, positions % self.block_size

    def write(self, layer: int, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              at: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Store token rows ``k``/``v`` ``[N, kv_heads, D]`` at ``positions`` ``[N]`` of ``rows``
        ``[N]``; ``at``: ``locate(rows, positions)``, where the caller writes every layer there."""
        blocks, offsets = self.locate(rows, positions) if at is None else at
        self.k[layer][blocks, :, offsets] = k
        self.v[layer][blocks, :, offsets] = v

    def read(self, layer: int, rows: torch.Tensor | int, length: int,
             index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, kv_heads, length, D]`` of positions ``[0, length)`` of ``rows``
        ``[B]`` (an int: that one row, B = 1), gathered block by block (``length`` a host
        value: the shapes follow it); ``index``: ``read_index(rows, length)``, where the
        caller reads every layer at the same rows."""
        index = self.read_index(rows, length) if index is None else index
        _, _, H, bs, D = self.k.shape
        n = math.ceil(length / bs)

        def gather(pool: torch.Tensor) -> torch.Tensor:
            return pool.view(-1, bs * D).index_select(0, index).view(-1, H, n * bs, D)[:, :, :length]

        return gather(self.k[layer]), gather(self.v[layer])

    def read_index(self, rows: torch.Tensor | int, length: int) -> torch.Tensor:
        """``read``'s rows of one layer's pool for positions ``[0, length)`` of ``rows``.

        One copy: the pool seen as ``[blocks x heads, bs x D]`` rows, of which row
        ``b H + h`` holds head h of block b; taking (for each sequence, head, block) its row
        in that order lays the keys out as ``[B, H, n bs, D]`` directly (gathering whole
        blocks, then moving the heads first, copied them twice: docs/design/kv_cache.md)."""
        n = math.ceil(length / self.block_size)
        table = self.block_table[rows:rows + 1] if isinstance(rows, int) else self.block_table[rows]
        blocks = table[:, :n].long()  # [B, n]
        H = self.k.shape[2]
        return (blocks[:, None, :] * H + torch.arange(H, device=blocks.device)[None, :, None]).view(-1)
