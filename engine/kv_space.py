"""The engine's side of the paged KV cache: which row and blocks each sequence holds.

A sequence holds a row of the block table (``models/kv_cache.py``) and a list of blocks of
the pool (``kv_blocks.BlockPool``): block i holds its tokens ``[i bs, (i + 1) bs)``. Its
blocks grow one at a time as it decodes, always a position ahead of the next step (a
step queued ahead, ``engine.py``, writes one position further than the host has seen).

Table updates are collected on the host and written in one copy before the next forward
(``flush``): a step's kernels read the table on the device, and a copy per block
assignment would be dozens of small copies a step at large batches. A row released and
given out again before a flush keeps only its last value per entry.

Prefix caching: once a block's positions are all written, it is registered under the
chained hash of its tokens (``commit``); an admitted sequence starts from the cached
blocks of its context's leading run (``admit``), never its last token's block (that
token's logits are needed, so at least it is computed).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..models.kv_cache import KVCache
from .kv_blocks import BlockPool, NoFreeBlocks


@dataclass
class SequenceBlocks:
    row: int
    blocks: list[int] = field(default_factory=list)
    registered: int = 0  # leading blocks registered in the prefix cache (or found there)


class KVSpace:
    def __init__(self, cache: KVCache, pool: BlockPool, rows: int):
        self.cache, self.pool = cache, pool
        self.block_size = cache.block_size
        self.free_rows = list(range(rows - 1, -1, -1))
        self._pending: dict[tuple[int, int], int] = {}  # (row, entry) -> block, not yet on the device

    def blocks_for(self, positions: int) -> int:
        """Blocks that hold ``positions`` positions."""
        return -(-positions // self.block_size)

    def admit(self, context: list[int], reserve: int) -> tuple[SequenceBlocks, int] | None:
        """A row and blocks for a sequence whose ``context`` (tokens to prefill) is followed by
        ``reserve`` more positions, and how many of the context's tokens are cached; None
        (nothing taken) where there is no row or too few blocks."""
        if not self.free_rows:
            return None
        cached = self.pool.match_prefix(context[:-1])  # (the last token is always computed)
        need = self.blocks_for(len(context) + reserve) - len(cached)
        try:
            fresh = self.pool.allocate(need)
        except NoFreeBlocks:
            self.pool.free(cached)
            return None
        seq = SequenceBlocks(self.free_rows.pop(), cached + fresh, registered=len(cached))
        self._assign(seq, 0)
        return seq, len(cached) * self.block_size

    def grow(self, seq: SequenceBlocks, positions: int) -> bool:
        """Blocks for ``positions`` positions of ``seq``; False (nothing taken) where too few are free."""
        need = self.blocks_for(positions) - len(seq.blocks)
        if need <= 0:
            return True
        try:
            fresh = self.pool.allocate(need)
        except NoFreeBlocks:
            return False
        first = len(seq.blocks)
        seq.blocks += fresh
        self._assign(seq, first)
        return True

    def fork(self, parent: SequenceBlocks, length: int, reserve: int) -> SequenceBlocks | None:
        """A row for a copy of ``parent``'s first ``length`` positions (another choice of its
        request): its full blocks shared, the partly written one copied, room for
        ``reserve`` more; None where there is no row or too few blocks."""
        if not self.free_rows:
            return None
        full = length // self.block_size
        try:
            fresh = self.pool.allocate(self.blocks_for(length + reserve) - full)
        except NoFreeBlocks:
            return None
        self.pool.fork(parent.blocks[:full])
        if length % self.block_size:
            self.cache.copy_block(parent.blocks[full], fresh[0])
        seq = SequenceBlocks(self.free_rows.pop(), parent.blocks[:full] + fresh, registered=min(full, parent.registered))
        self._assign(seq, 0)
        return seq

    def commit(self, seq: SequenceBlocks, tokens: list[int]) -> None:
        """``tokens``' keys and values are written (position i holds token i): register the
        full blocks among them in the prefix cache."""
        full = len(tokens) // self.block_size
        if full > seq.registered:
            self.pool.register(seq.blocks, tokens, start_block=seq.registered)
            seq.registered = full

    def release(self, seq: SequenceBlocks) -> None:
        """Give back ``seq``'s blocks (full ones stay cached until evicted) and its row."""
        self.pool.free(seq.blocks)
        for i in range(len(seq.blocks)):
            self._pending[(seq.row, i)] = 0
        self.free_rows.append(seq.row)
        seq.blocks = []

    def flush(self) -> None:
        """Write the table entries assigned since the last flush (one copy to the device)."""
        if not self._pending:
            return
        entries = torch.tensor([(r, i, b) for (r, i), b in self._pending.items()], dtype=torch.int32)
        self._pending.clear()
        self.cache.assign_entries(entries)

    def _assign(self, seq: SequenceBlocks, first: int) -> None:
        for i in range(first, len(seq.blocks)):
            self._pending[(seq.row, i)] = seq.blocks[i]
