"""Tensor-parallel serving: one engine, a model shard on every rank.

Rank 0 runs the engine -- scheduling, the KV block allocator, sampling, and above it the
HTTP server; every other rank runs ``follow``, which repeats each of rank 0's model calls on
its own shard (``models/sharding.py``) and its own KV cache (its KV heads, the same blocks).
Before rank 0 runs a call, its ``Leader`` announces it through the ``ControlChannel``
(``control_channel.py``, host to host): an eager forward pass (its ids and batch, moved to
the CPU), a CUDA-graph replay (a decode step's ids, positions and rows, or a packed step's
chunks), the block-table entries the allocator assigned, a block copy, the KV cache's
geometry once the engine has sized it, the graphs to capture, or the end.
Every rank thus enters the same calls in the same order, and with them the row-parallel
layers' all-reduces and the vocab-parallel embedding's and LM head's collectives
(``CausalLM.tp``), captured inside the graphs alike. Sampling needs no announcement: every
rank's forward ends with the whole vocabulary's logits (gathered from the ranks' LM head
rows, or from a whole head), so rank 0 samples from the model's. A look-ahead decode step
(``DecodeGraphs.run_next``) is fed with ids that exist only on rank 0's GPU: they reach
the other ranks by a device broadcast, queued before the replay on every rank.

A one-sequence step in a decode graph is the persistent kernel on every rank where the
model qualifies (``CausalLM.persistent_step``: the ranks agree when the graphs' warm-up
builds it); an eager one is the announced forward (``_LeadingModel``).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ..models.kv_cache import KVCache
from .control_channel import ControlChannel


def _moved(batch, device: torch.device | str):
    """``batch`` (a ``models.batches`` pass, or None) with its tensors on ``device``."""
    if batch is None:
        return None
    return dataclasses.replace(batch, **{f.name: getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)
                                         if isinstance(getattr(batch, f.name), torch.Tensor)})


class Leader:
    """Rank 0's side: the model and the KV cache its engine drives, each call announced to
    the other ranks before it runs (``Engine(mirror=...)``)."""

    def __init__(self, channel: ControlChannel):
        self.channel = channel

    def announce(self, message: tuple) -> None:
        self.channel.send(message)

    def lead(self, model) -> "_LeadingModel":
        return _LeadingModel(model, self)

    def attach(self, cache: KVCache) -> "_LeadingCache":
        """Announce the engine's cache (rows, positions, blocks) for the other ranks to build theirs."""
        self.announce(("cache", cache.num_rows, cache.max_seq_len, cache.k.dtype, cache.block_size, cache.num_blocks))
        return _LeadingCache(cache, self)

    def capture_graphs(self, model: "_LeadingModel", cache: "_LeadingCache", max_num_seqs: int, packed_tokens: int):
        """Capture the engine's graphs (``cuda_graphs.capture_engine_graphs``) on every rank;
        rank 0's, each replay announced first."""
        from .cuda_graphs import capture_engine_graphs
        from .decode import DecodeRunner

        self.announce(("graphs", max_num_seqs, packed_tokens))
        graphs, packed = capture_engine_graphs(DecodeRunner(model._model, cache._cache), max_num_seqs, packed_tokens)
        return _LeadingDecodeGraphs(graphs, self), None if packed is None else _LeadingPackedGraphs(packed, self)

    def forward(self, input_ids: torch.Tensor, batch, cache, last_only: bool, greedy: bool) -> None:
        self.announce(("forward", input_ids.cpu(), _moved(batch, "cpu"), cache is not None, last_only, greedy))

    def stop(self) -> None:
        """Let the other ranks' ``follow`` return."""
        self.announce(("stop",))
        self.channel.close()


class _LeadingModel:
    """The model as the engine sees it on rank 0: every forward announced first."""

    def __init__(self, model, leader: Leader):
        self._model, self._leader = model, leader

    def __getattr__(self, name):
        return getattr(self._model, name)

    def wants_persistent_decode(self) -> bool:
        # (an eager step's persistent kernel would run on rank 0 alone, unannounced: the
        # engine's eager one-sequence steps are forwards; the graphs' runners take the model
        # itself on every rank)
        return False

    def __call__(self, input_ids: torch.Tensor, batch=None, cache=None, last_only: bool = False,
                 greedy: bool = False) -> torch.Tensor:
        self._leader.forward(input_ids, batch, cache, last_only, greedy)
        return self._model(input_ids, batch, cache, last_only, greedy)


class _LeadingDecodeGraphs:
    """Rank 0's decode graphs (``cuda_graphs.DecodeGraphs``): every replay announced first."""

    def __init__(self, graphs, leader: Leader):
        self._graphs, self._leader = graphs, leader

    def __getattr__(self, name):
        return getattr(self._graphs, name)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        self._leader.announce(("decode_graph", ids.cpu(), positions.cpu(), slots.cpu()))
        return self._graphs.run(ids, positions, slots)

    def run_next(self, ids: torch.Tensor) -> torch.Tensor:
        self._leader.announce(("decode_graph_next", ids.shape[0]))
        ids = ids.to(torch.long)
        dist.broadcast(ids, src=0)  # (the device group: queued on the GPU, no host wait)
        return self._graphs.run_next(ids)


class _LeadingPackedGraphs:
    """Rank 0's packed graphs (``cuda_graphs.PackedGraphs``): every replay announced first."""

    def __init__(self, graphs, leader: Leader):
        self._graphs, self._leader = graphs, leader

    def __getattr__(self, name):
        return getattr(self._graphs, name)

    def run(self, ids: list[int], lens: list[int], slots: list[int], starts: list[int],
            fed: torch.Tensor | None = None) -> torch.Tensor:
        self._leader.announce(("packed_graph", ids, lens, slots, starts, 0 if fed is None else len(fed)))
        if fed is not None:  # (a step queued ahead: its decode ids on the device, as run_next's)
            fed = fed.to(torch.long)
            dist.broadcast(fed, src=0)
        return self._graphs.run(ids, lens, slots, starts, fed)


class _LeadingCache:
    """The KV cache as the engine sees it on rank 0: block copies announced first."""

    def __init__(self, cache: KVCache, leader: Leader):
        self._cache, self._leader = cache, leader

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def assign_entries(self, entries: torch.Tensor) -> None:
        self._leader.announce(("entries", entries))
        self._cache.assign_entries(entries)

    def copy_block(self, src: int, dst: int) -> None:
        self._leader.announce(("copy_block", src, dst))
        self._cache.copy_block(src, dst)


def follow(model, channel: ControlChannel) -> None:
    """A rank other than 0: run every call rank 0 announces on this rank's shard ``model``,
    until rank 0 stops."""
    cache = graphs = packed = None
    device = model.device
    while True:
        message = channel.receive()
        kind = message[0]
        if kind == "stop":
            channel.close()
            return
        if kind == "cache":
            rows, max_seq_len, dtype, block_size, num_blocks = message[1:]
            cfg = model.cfg  # (this rank's KV heads)
            cache = KVCache(cfg.num_layers, rows, cfg.num_kv_heads, max_seq_len, cfg.head_dim, dtype, device,
                            block_size=block_size, num_blocks=num_blocks)
        elif kind == "entries":
            cache.assign_entries(message[1])
        elif kind == "copy_block":
            cache.copy_block(*message[1:])
        elif kind == "forward":
            _, input_ids, batch, cached, last_only, greedy = message
            model(input_ids.to(device), _moved(batch, device), cache if cached else None, last_only, greedy)
        elif kind == "graphs":
            from .cuda_graphs import capture_engine_graphs
            from .decode import DecodeRunner

            graphs, packed = capture_engine_graphs(DecodeRunner(model, cache), *message[1:])
        elif kind == "decode_graph":
            graphs.run(*message[1:])
        elif kind == "decode_graph_next":
            ids = torch.empty(message[1], dtype=torch.long, device=device)
            dist.broadcast(ids, src=0)
            graphs.run_next(ids)
        elif kind == "packed_graph":
            fed = None
            if message[5]:
                fed = torch.empty(message[5], dtype=torch.long, device=device)
                dist.broadcast(fed, src=0)
            packed.run(*message[1:5], fed)
        else:
            raise ValueError(f"unknown announcement {kind!r}")
