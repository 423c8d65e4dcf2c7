"""Decode steps replayed through CUDA graphs, one graph per padded batch size.

A decode step of a small or quantized model is launch-bound: hundreds of small kernels
whose CPU-side launch cost exceeds their GPU time. Each graph is captured once with static
input buffers (token ids, positions, cache slots, lengths) and replayed with new values
copied in. Batches are padded to the next captured size (1, 2, 4, 8, ...); padding rows
decode a dummy token in a scratch cache slot that no sequence owns.
"""
from __future__ import annotations

import torch

from ..models.kv_cache import KVCache
from ..models.llama import Batch, CausalLM


def batch_buckets(max_batch: int) -> list[int]:
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(self, model: CausalLM, cache: KVCache, max_batch: int, scratch_slot: int):
        self.model, self.cache = model, cache
        self.buckets = batch_buckets(max_batch)
        self.scratch_slot = scratch_slot
        dev = model.device
        n = self.buckets[-1]
        self.ids = torch.zeros(n, 1, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, 1, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), scratch_slot, dtype=torch.long, device=dev)
        self.lengths = torch.ones(n, dtype=torch.long, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def _forward(self, b: int) -> torch.Tensor:
        batch = Batch(self.positions[:b], self.slots[:b], lengths=self.lengths[:b])
        return self.model(self.ids[:b], batch, self.cache, last_only=True)

    def capture(self) -> None:
        """Capture every bucket, largest first (the smaller graphs reuse its memory pool)."""
        self._pad(0)
        for b in reversed(self.buckets):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up: autotuning, allocator, lazy inits
                for _ in range(2):
                    self._forward(b)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._forward(b)
            self.pool = graph.pool()
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize()

    def _pad(self, start: int) -> None:
        self.ids[start:] = 0
        self.positions[start:] = 0
        self.slots[start:] = self.scratch_slot
        self.lengths[start:] = 1

    def run(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, V]`` for one decode step (``ids``, ``positions``: ``[B, 1]``; ``slots``: ``[B]``)."""
        B = ids.shape[0]
        b = self._bucket(B)
        self.ids[:B].copy_(ids, non_blocking=True)
        self.positions[:B].copy_(positions, non_blocking=True)
        self.slots[:B].copy_(slots, non_blocking=True)
        self.lengths[:B].copy_(positions[:, 0] + 1, non_blocking=True)
        if B < b:
            self._pad(B)
        return self._replay(b, B)

    def run_next(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits of the step after the last ``run`` / ``run_next`` for the same rows, fed
        with ``ids`` (``[B]``, on the device: the ids that step sampled): every row one
        position further. Nothing comes from the host, so it can be queued before those ids
        are known there (the engine's look-ahead)."""
        B = ids.shape[0]
        self.ids[:B, 0].copy_(ids)
        self.positions[:B] += 1
        self.lengths[:B] += 1
        return self._replay(self._bucket(B), B)

    def _replay(self, b: int, B: int) -> torch.Tensor:
        """Replay bucket ``b``'s graph; its first ``B`` rows of logits."""
        graph, out = self.graphs[b]
        graph.replay()
        return out[:B]

    def _bucket(self, B: int) -> int:
        return next(s for s in self.buckets if s >= B)
