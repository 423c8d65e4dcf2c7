"""Tensor-parallel serving: one engine, a model shard on every rank.

Rank 0 runs the engine -- scheduling, the KV block allocator, sampling, and above it the
HTTP server; every other rank runs ``follow``, which repeats each of rank 0's model calls on
its own shard (``models/sharding.py``) and its own KV cache (its KV heads, the same blocks).
Before rank 0 runs a call, its ``Leader`` announces it to the group: one
``broadcast_object_list`` of what to run -- a forward pass (its ids and batch, moved to the
CPU, and the block table), a block copy, the KV cache's geometry once the engine has sized
it, or the end. Every rank thus enters the same calls in the same order, and with them the
row-parallel layers' all-reduces and the vocab-parallel embedding's and LM head's
collectives (``CausalLM.tp``). Sampling needs no announcement: every rank's forward ends
with the whole vocabulary's logits (gathered from the ranks' LM head rows, or from a whole
head), so rank 0 samples from the model's.

Not here yet: CUDA graphs and the persistent decode step across ranks (the engine runs
eager steps under TP), and announcements as device tensors (a pickled announcement costs
host time that a GPU step would notice).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ..models.kv_cache import KVCache


def _moved(batch, device: torch.device | str):
    """``batch`` (a ``models.batches`` pass, or None) with its tensors on ``device``."""
    if batch is None:
        return None
    return dataclasses.replace(batch, **{f.name: getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)
                                         if isinstance(getattr(batch, f.name), torch.Tensor)})


def _announce(message: tuple, group=None) -> None:
    dist.broadcast_object_list([message], src=0, group=group)


def _receive(group=None) -> tuple:
    box = [None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


class Leader:
    """Rank 0's side: the model and the KV cache its engine drives, each call announced to
    the other ranks before it runs (``Engine(mirror=...)``)."""

    def __init__(self, group=None):
        self.group = group

    def lead(self, model) -> "_LeadingModel":
        return _LeadingModel(model, self)

    def attach(self, cache: KVCache) -> "_LeadingCache":
        """Announce the engine's cache (rows, positions, blocks) for the other ranks to build theirs."""
        _announce(("cache", cache.num_rows, cache.max_seq_len, cache.k.dtype, cache.block_size, cache.num_blocks),
                  self.group)
        return _LeadingCache(cache, self)

    def forward(self, input_ids: torch.Tensor, batch, cache, last_only: bool, greedy: bool) -> None:
        table = None if cache is None else cache.block_table.cpu()
        _announce(("forward", input_ids.cpu(), _moved(batch, "cpu"), table, last_only, greedy), self.group)

    def copy_block(self, src: int, dst: int) -> None:
        _announce(("copy_block", src, dst), self.group)

    def stop(self) -> None:
        """Let the other ranks' ``follow`` return."""
        _announce(("stop",), self.group)


class _LeadingModel:
    """The model as the engine sees it on rank 0: every forward announced first."""

    def __init__(self, model, leader: Leader):
        self._model, self._leader = model, leader

    def __getattr__(self, name):
        return getattr(self._model, name)

    def wants_persistent_decode(self) -> bool:
        return False  # (the persistent step has no all-reduce between its layers)

    def __call__(self, input_ids: torch.Tensor, batch=None, cache=None, last_only: bool = False,
                 greedy: bool = False) -> torch.Tensor:
        self._leader.forward(input_ids, batch, cache, last_only, greedy)
        return self._model(input_ids, batch, cache, last_only, greedy)


class _LeadingCache:
    """The KV cache as the engine sees it on rank 0: block copies announced first."""

    def __init__(self, cache: KVCache, leader: Leader):
        self._cache, self._leader = cache, leader

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def copy_block(self, src: int, dst: int) -> None:
        self._leader.copy_block(src, dst)
        self._cache.copy_block(src, dst)


def follow(model, group=None) -> None:
    """A rank other than 0: run every call rank 0 announces on this rank's shard ``model``,
    until rank 0 stops."""
    cache = None
    device = model.device
    while True:
        message = _receive(group)
        kind = message[0]
        if kind == "stop":
            return
        if kind == "cache":
            rows, max_seq_len, dtype, block_size, num_blocks = message[1:]
            cfg = model.cfg  # (this rank's KV heads)
            cache = KVCache(cfg.num_layers, rows, cfg.num_kv_heads, max_seq_len, cfg.head_dim, dtype, device,
                            block_size=block_size, num_blocks=num_blocks)
        elif kind == "copy_block":
            cache.copy_block(*message[1:])
        elif kind == "forward":
            _, input_ids, batch, table, last_only, greedy = message
            if table is not None:
                cache.block_table.copy_(table)
            model(input_ids.to(device), _moved(batch, device), cache if table is not None else None, last_only, greedy)
        else:
            raise ValueError(f"unknown announcement {kind!r}")
