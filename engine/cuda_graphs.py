"""Decode steps and short prefills replayed through CUDA graphs.

A decode step of a small or quantized model is launch-bound: hundreds of small kernels
whose CPU-side launch cost exceeds their GPU time. Each graph is captured once with static
input buffers (token ids, positions, block-table rows, lengths) and replayed with new
values copied in; the block table itself is read on the device, so a replay follows the
blocks assigned since the capture. Batches are padded to the next captured size (1, 2,
4, 8, ...); padding rows decode a dummy token in a scratch row that no sequence owns
(every entry the scratch block: ``models/kv_cache.py``).

A packed forward of a few hundred tokens is host-bound the same way (a 128-token prompt
of a small model spends far more host time launching its kernels than the GPU runs them:
docs/design/engine.md). ``PackedGraphs`` captures a packed forward per padded token
count (``prefill_buckets``, up to ``PACKED_GRAPH_TOKENS``) whose chunks -- how many, how long,
where -- are device values (``models.batches.Prefill``): one replay prefills several
prompts' chunks, or mixes them with the running sequences' decode tokens.
"""
from __future__ import annotations

import array
import contextlib
import gc
from dataclasses import dataclass

import torch

from ..kernels.observe import Captured, KernelTiming
from ..models.batches import TILE_TOKENS, Decode, Prefill, packed_rows, query_tiles
from ..models.kv_cache import KVCache
from ..models.llama import CausalLM
from .decode import DecodeRunner


@dataclass(eq=False)
class Graph:
    """One captured graph and its output; with kernel metrics on, also its timed twin (the
    same work with one linear-layer call of each kind timed -- a GEMV or mixed GEMM by its
    blocks' stamps, others by event pairs -- and event nodes around a decode step,
    ``kernels/observe.py``) and the calls each one replays."""

    graph: torch.cuda.CUDAGraph
    out: torch.Tensor
    calls: Captured | None = None
    twin: torch.cuda.CUDAGraph | None = None
    twin_out: torch.Tensor | None = None
    twin_calls: Captured | None = None
    timing: KernelTiming | None = None  # (the one that recorded the calls)

    def replay(self) -> torch.Tensor:
        """Replay the graph (one replay in ``timing.sample_every``: its timed twin); its output.
        Replays inside ``timing.quiet()`` (the engine timing its steps at start) are not counted."""
        counted = self.timing is not None and not self.timing.quieted
        if counted and self.twin is not None and self.timing.take_timed(self.twin_calls):
            self.twin.replay()
            self.timing.timed_replayed(self.twin_calls)
            return self.twin_out
        self.graph.replay()
        if counted and self.calls is not None:
            self.calls.replayed()
        return self.out


def capture_graphs(forward, sizes: list[int], timing: KernelTiming | None, decode: bool = False) -> dict[int, Graph]:
    """A graph of ``forward(size)`` for each size, with its output: captured largest first,
    in one memory pool that the smaller ones reuse (one graph replays at a time). With
    ``timing``, each graph's calls are recorded and a timed twin is captured beside it (a
    ``decode`` step's twin also times the whole step: the step's roofline gauge); the
    warm-up runs are not counted."""
    # Freeing a graph while another is captured invalidates that capture (destroying one is
    # not permitted during a global-mode capture): dead cycles that hold an earlier engine's
    # graphs are collected now, not by a collection that an allocation sets off mid-capture
    # (torch.cuda.graph no longer collects on entry).
    gc.collect()
    graphs, pool = {}, None
    for size in sorted(sizes, reverse=True):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        quiet = timing.quiet() if timing is not None else contextlib.nullcontext()
        with torch.cuda.stream(stream), quiet:  # warm-up: autotuning, allocator, lazy inits
            for _ in range(2):
                forward(size)
        torch.cuda.current_stream().wait_stream(stream)
        captures = []
        for timed in (False, True) if timing is not None else (False,):
            graph = torch.cuda.CUDAGraph()
            recording = timing.recording(timed) if timing is not None else contextlib.nullcontext()
            with recording as calls, torch.cuda.graph(graph, pool=pool):
                if timed and decode:
                    calls.begin_step()
                out = forward(size)
                if timed and decode:
                    calls.end_step(size)
                if timed:
                    calls.end_capture()
            pool = graph.pool()
            captures.append((graph, out, calls))
        graphs[size] = Graph(*captures[0], *(captures[1] if len(captures) > 1 else ()), timing=timing)
    torch.cuda.synchronize()
    return graphs


def batch_buckets(max_batch: int) -> list[int]:
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(self, runner: DecodeRunner, max_batch: int, scratch_slot: int):
        self.runner = runner
        model = runner.model
        self.buckets = batch_buckets(max_batch)
        self.scratch_slot = scratch_slot
        dev = model.device
        n = self.buckets[-1]
        self.ids = torch.zeros(n, 1, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, 1, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), scratch_slot, dtype=torch.long, device=dev)
        self.lengths = torch.ones(n, dtype=torch.long, device=dev)
        self.graphs: dict[int, Graph] = {}

    def _forward(self, b: int) -> torch.Tensor:
        return self.runner(self.ids[:b], Decode(self.positions[:b], self.slots[:b], self.lengths[:b]))

    def capture(self) -> None:
        """Capture every bucket, largest first (the smaller graphs reuse its memory pool)."""
        self._pad(0)
        self.graphs = capture_graphs(self._forward, self.buckets, self.runner.model.kernel_timing, decode=True)

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
        return self.graphs[b].replay()[:B]

    def _bucket(self, B: int) -> int:
        return next(s for s in self.buckets if s >= B)


def capture_engine_graphs(decode: DecodeRunner, max_num_seqs: int,
                          packed_tokens: int) -> tuple["DecodeGraphs", "PackedGraphs | None"]:
    """An engine's graphs, captured: decode steps of up to ``max_num_seqs`` rows, and with
    ``packed_tokens`` packed forwards of up to that many tokens (in at most ``max_num_seqs``
    chunks); their padding rows use row ``max_num_seqs``. Every rank of a tensor-parallel
    group captures the same ones, in this order (their collectives pair up)."""
    graphs = DecodeGraphs(decode, max_num_seqs, scratch_slot=max_num_seqs)
    graphs.capture()
    packed = None
    if packed_tokens:
        packed = PackedGraphs(decode.model, decode.cache, packed_tokens, max_num_seqs, scratch_slot=max_num_seqs)
        packed.capture()
    return graphs, packed


# The most tokens a packed graph takes: past a few hundred tokens a packed forward's
# kernels outlast its launches, and each graph's memory pool holds its activations for good.
PACKED_GRAPH_TOKENS = 512


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token counts with a packed graph: 16, 32, 64, 128, then every 64 up to ``max_tokens``
    (itself included). Past 128 tokens a step's time grows with its tokens (its GEMMs are
    compute-bound), so a step padded to the next power of two would pay for up to twice
    its tokens (docs/bench/step_budget.md)."""
    sizes, t = [], 16
    while t < max_tokens:
        sizes.append(t)
        t = t * 2 if t < 128 else t + 64
    return sizes + [max_tokens] if max_tokens >= 1 else []


class PackedGraphs:
    """One graph per padded token count T, each a packed forward (``models.batches.Prefill``)
    of any chunks of up to T tokens in all and at most ``max_chunks`` of them -- prompt
    chunks, and in a mixed step the running sequences' decode tokens -- giving the logits
    of each chunk's last token. Padding rows write token 0 at position 0 of the scratch
    row; padding query tiles hold 0 tokens; padding chunks' logits are not read."""

    def __init__(self, model: CausalLM, cache: KVCache, max_tokens: int, max_chunks: int, scratch_slot: int):
        self.model, self.cache = model, cache
        self.buckets = prefill_buckets(min(max_tokens, cache.max_seq_len))
        self.max_chunks = max_chunks
        self.scratch_slot = scratch_slot
        n = self.buckets[-1]
        # Every input of every graph lies in one int64 buffer, so that a replay's host values
        # go over in one copy (``run``): ids, positions, rows [n each], each chunk's last row
        # [chunks(n)], then the query tiles, int32 [tiles(n), 4] in 2 x tiles(n) words.
        c, w = self._most_chunks, self._most_tiles = self._chunks(n), self._tiles(n)
        self.inputs = torch.zeros(3 * n + c + 2 * w, dtype=torch.long, device=model.device)
        self.ids = self.inputs[:n].view(1, n)
        self.positions = self.inputs[n:2 * n].view(1, n)
        self.slots = self.inputs[2 * n:3 * n]
        self.last = self.inputs[3 * n:3 * n + c]
        self.tiles = self.inputs[3 * n + c:].view(torch.int32).view(w, 4)
        self.slots.fill_(scratch_slot)
        self.graphs: dict[int, Graph] = {}
        self.replays = 0

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def _chunks(self, t: int) -> int:
        return min(t, self.max_chunks)

    def _tiles(self, t: int) -> int:
        """Query tiles of chunks of t tokens in all: one per TILE_TOKENS, and one more a chunk at most."""
        return t // TILE_TOKENS + self._chunks(t)

    def _forward(self, t: int) -> torch.Tensor:
        batch = Prefill(self.positions[:, :t], self.slots[:t], self.last[:self._chunks(t)],
                        self.tiles[:self._tiles(t)], ())
        return self.model(self.ids[:, :t], batch, self.cache, last_only=True)

    def capture(self) -> None:
        """Capture every token count, largest first (the smaller graphs reuse its memory pool).
        The captures write position 0 of row ``scratch_slot``, which no sequence holds."""
        self.graphs = capture_graphs(self._forward, self.buckets, self.model.kernel_timing)

    def fits(self, tokens: int, chunks: int) -> bool:
        return tokens <= self.max_tokens and chunks <= self._chunks(self._bucket(tokens))

    def _bucket(self, tokens: int) -> int:
        return next((b for b in self.buckets if b >= tokens), self.buckets[-1])

    def run(self, ids: list[int], lens: list[int], slots: list[int], starts: list[int],
            fed: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[chunks, V]`` of the last token of each chunk: chunk i is ``lens[i]``
        of ``ids`` (in order), at positions ``starts[i]...`` of block-table row ``slots[i]``
        (``fits``: at most ``max_tokens`` in all). ``fed``: ids on the device for the first
        ``len(fed)`` tokens, in place of those of ``ids`` (a step queued before the host has
        them: the engine's ``_queue_mixed``)."""
        n, c = len(ids), len(lens)
        if not self.fits(n, c):
            raise ValueError(f"a packed graph takes up to {self.max_tokens} tokens in {self.max_chunks} chunks, "
                             f"got {n} in {c}")
        chunks, positions, rows, last = packed_rows(lens, slots, starts)
        tiles = query_tiles(list(chunks), TILE_TOKENS)  # (every chunk: a graph has no SDPA calls)
        # The whole input buffer, padding included (rows past ``n`` write token 0 at position 0
        # of the scratch row, tiles of 0 tokens do nothing, chunks past ``c`` are not read):
        # one copy from pinned memory, queued (one from pageable memory would wait for the
        # GPU's queued work, a step queued ahead included; torch's pinned-memory cache keeps
        # the buffer until its copy has run), and few torch calls (``packed_rows``).
        pad = self.buckets[-1] - n
        words = array.array("q", [*ids, *[0] * pad, *positions, *[0] * pad, *rows, *[self.scratch_slot] * pad,
                                  *last, *[0] * (self._most_chunks - c)])
        quads = array.array("i", [v for tile in tiles for v in tile])
        quads.extend([0] * (4 * self._most_tiles - len(quads)))
        host = torch.frombuffer(bytearray(words.tobytes() + quads.tobytes()), dtype=torch.long)
        self.inputs.copy_(host.pin_memory() if self.inputs.is_cuda else host, non_blocking=True)
        if fed is not None:
            self.ids[0, :len(fed)].copy_(fed)
        t = self._bucket(n)
        out = self.graphs[t].replay()
        self.replays += 1
        return out[:c]
