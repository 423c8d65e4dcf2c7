"""What a forward pass computes, one small type per kind of pass. Each says where its
tokens sit (positions, cache slots) and which rows end a sequence; the attention that
reads and writes the KV cache for it is chosen from its kind (``models/attention.py``).

* ``Causal``: tokens attending to themselves only, no cache (scoring, calibration);
* ``Prefill``: chunks of several sequences packed into one row (M = the sum of their
  lengths), each written to its slot from its first position: prompt chunks (a long
  prompt comes in several), and in a step that mixes prefill with decode, each running
  sequence's new token as a chunk of one. Its query tiles (``query_tiles``) are device
  values, so a CUDA graph captures a packed forward of up to T tokens and replays it for
  any chunks that fit (padding rows write to the scratch row, padding tiles do nothing);
* ``Decode``: one token per sequence; ``lengths`` (positions to attend to, on the device)
  makes the step independent of host values, so a CUDA graph can capture it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class Causal:
    positions: torch.Tensor  # [B, T]

    def last_rows(self, h: torch.Tensor) -> torch.Tensor:
        """Each sequence's last hidden state: ``[B, T, C]`` -> ``[B, C]``."""
        return h[:, -1]


class Chunk(NamedTuple):
    """One sequence's tokens in a packed row: rows ``[row, row + tokens)`` of the row, at
    positions ``[start, start + tokens)`` of block-table row ``slot``."""

    row: int
    tokens: int
    slot: int
    start: int


# Query tokens per tile of the chunk-attention kernel (``kernels/chunk_attention.py``):
# 16 rows per KV head already give its ``tl.dot`` 64 rows with 4 query heads per KV head,
# and a decode token's tile (one token) wastes the fewest rows at the smallest tile.
TILE_TOKENS = 16

# Chunks this long or longer are attended by SDPA (flash attention) in an eager forward:
# its larger tiles read each key fewer times than the chunk kernel's query tiles of 16.
DENSE_FROM = 256


def query_tiles(chunks: list[Chunk], tile: int) -> list[tuple[int, int, int, int]]:
    """The chunk-attention kernel's work (``kernels/chunk_attention.py``): each chunk cut
    into tiles of up to ``tile`` tokens, as (first row, tokens, first position, slot)."""
    return [(c.row + i, min(tile, c.tokens - i), c.start + i, c.slot)
            for c in chunks for i in range(0, c.tokens, tile)]


def packed_rows(lens: list[int], slots: list[int],
                starts: list[int] | None = None) -> tuple[tuple[Chunk, ...], list[int], list[int], list[int]]:
    """Chunks of ``lens`` tokens packed into one row, for block-table rows ``slots`` from
    positions ``starts`` (default 0): the chunks, every token's position and block-table
    row, and each chunk's last row. Host lists, not tensors: the engine packs a step while
    the GPU runs the one before, and every torch call there lets go of the GIL and may then
    wait for the event loop to give it back (docs/design/serving.md, "The GIL between the
    engine and the event loop")."""
    offsets = itertools.accumulate(lens, initial=0)  # where each chunk begins in the packed row
    chunks = tuple(Chunk(o, n, s, p) for o, n, s, p in zip(offsets, lens, slots, starts or [0] * len(lens)))
    return (chunks, [p for c in chunks for p in range(c.start, c.start + c.tokens)],
            [c.slot for c in chunks for _ in range(c.tokens)], [c.row + c.tokens - 1 for c in chunks])


@dataclass(frozen=True)
class Prefill:
    positions: torch.Tensor  # [1, T]: every token's position in its sequence
    slots: torch.Tensor  # [T]: every token's block-table row
    last_index: torch.Tensor  # [chunks]: each chunk's last row (on the device)
    # The query tiles of the chunks the chunk kernel attends (int32 [W, 4], on the device;
    # a tile of 0 tokens is padding), or None; the other chunks take SDPA.
    tiles: torch.Tensor | None
    chunks: tuple[Chunk, ...]  # every chunk, host values (empty in a captured graph: all tiled)
    dense_from: int = DENSE_FROM  # with tiles: the chunks this long or longer take SDPA

    @classmethod
    def pack(cls, prompt_lens: list[int], prompt_slots: list[int], device: torch.device | str,
             prompt_starts: list[int] | None = None, tiled: bool | None = None,
             dense_from: int = DENSE_FROM) -> Prefill:
        """The packed prefill of chunks of ``prompt_lens`` tokens into ``prompt_slots`` from
        positions ``prompt_starts`` (default 0: whole prompts). ``tiled`` (default: on
        CUDA): chunks shorter than ``dense_from`` go to the chunk kernel."""
        chunks, positions, slots, last = packed_rows(prompt_lens, prompt_slots, prompt_starts)
        tiles = None
        if torch.device(device).type == "cuda" if tiled is None else tiled:
            work = query_tiles([c for c in chunks if c.tokens < dense_from], TILE_TOKENS)
            tiles = torch.tensor(work, dtype=torch.int32).view(-1, 4).to(device)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long).to(device)  # noqa: E731
        return cls(as_tensor([positions]), as_tensor(slots), as_tensor(last), tiles, chunks, dense_from)

    def last_rows(self, h: torch.Tensor) -> torch.Tensor:
        """Each chunk's last hidden state: ``[1, T, C]`` -> ``[chunks, C]``."""
        return h[0].index_select(0, self.last_index)


@dataclass(frozen=True)
class Decode:
    positions: torch.Tensor  # [B, 1]
    slots: torch.Tensor  # [B]
    lengths: torch.Tensor  # [B]: positions attended to (= positions + 1)

    @classmethod
    def at(cls, positions: torch.Tensor, slots: torch.Tensor) -> Decode:
        return cls(positions, slots, positions[:, 0] + 1)

    def last_rows(self, h: torch.Tensor) -> torch.Tensor:
        return h[:, -1]


Batch = Causal | Prefill | Decode
