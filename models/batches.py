"""What a forward pass computes, one small type per kind of pass. Each says where its
tokens sit (positions, cache slots) and which rows end a sequence; the attention that
reads and writes the KV cache for it is chosen from its kind (``models/attention.py``).

* ``Causal``: tokens attending to themselves only, no cache (scoring, calibration);
* ``Prefill``: prompt chunks packed into one row (M = the sum of their lengths), each
  written to its slot from its first position; a long prompt comes in chunks;
* ``Decode``: one token per sequence; ``lengths`` (positions to attend to, on the device)
  makes the step independent of host values, so a CUDA graph can capture it;
* ``PaddedPrompt``: one whole prompt padded to T tokens, the prefill a CUDA graph captures
  per T; attention is causal, so the padding rows after the prompt change nothing before
  them, and their k and v land past the prompt, where decode steps overwrite them first.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Causal:
    positions: torch.Tensor  # [B, T]

    def last_rows(self, h: torch.Tensor) -> torch.Tensor:
        """Each sequence's last hidden state: ``[B, T, C]`` -> ``[B, C]``."""
        return h[:, -1]


@dataclass(frozen=True)
class Prefill:
    positions: torch.Tensor  # [1, T]: every token's position in its prompt
    slots: torch.Tensor  # [T]: every token's cache slot
    prompt_lens: tuple[int, ...]  # each chunk's tokens
    prompt_slots: tuple[int, ...]  # each chunk's slot
    prompt_starts: tuple[int, ...]  # each chunk's first position (0: a whole prompt)

    @classmethod
    def pack(cls, prompt_lens: list[int], prompt_slots: list[int], device: torch.device | str,
             prompt_starts: list[int] | None = None) -> Prefill:
        """The packed prefill of prompt chunks of ``prompt_lens`` tokens into ``prompt_slots``
        from positions ``prompt_starts`` (default 0: whole prompts)."""
        starts = list(prompt_starts or [0] * len(prompt_lens))
        lens = torch.tensor(prompt_lens)
        offsets = torch.cumsum(lens, 0) - lens  # where each chunk begins in the packed row
        positions = torch.arange(int(lens.sum())) - torch.repeat_interleave(offsets - torch.tensor(starts), lens)
        slots = torch.repeat_interleave(torch.tensor(prompt_slots), lens)
        return cls(positions[None].to(device), slots.to(device), tuple(prompt_lens), tuple(prompt_slots),
                   tuple(starts))

    def last_rows(self, h: torch.Tensor) -> torch.Tensor:
        """Each chunk's last hidden state: ``[1, T, C]`` -> ``[chunks, C]``."""
        ends = torch.tensor(self.prompt_lens).cumsum(0) - 1
        return h[0, ends.to(h.device)]


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


@dataclass(frozen=True)
class PaddedPrompt:
    positions: torch.Tensor  # [1, T]: 0..T-1
    slots: torch.Tensor  # [T]: the prompt's slot
    last_index: torch.Tensor  # [1]: the row of the prompt's last real token (on the device)

    def last_rows(self, h: torch.Tensor) -> torch.Tensor:
        return h[0].index_select(0, self.last_index)


Batch = Causal | Prefill | Decode | PaddedPrompt
