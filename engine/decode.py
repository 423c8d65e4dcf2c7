"""The decode step runner: how one decode step of B sequences is computed, decided once
per engine. A one-sequence step on CUDA runs every decoder layer in the persistent kernel
where the model asks for it and qualifies (``CausalLM.wants_persistent_decode``,
``persistent_step``); any other step is the model's forward, a kernel per op."""
from __future__ import annotations

import torch

from ..models.batches import Decode
from ..models.kv_cache import KVCache
from ..models.llama import CausalLM


class DecodeRunner:
    def __init__(self, model: CausalLM, cache: KVCache):
        self.model, self.cache = model, cache
        self.persistent = None
        self._persistent_checked = not (cache.k.is_cuda and model.wants_persistent_decode())

    def _persistent_step(self):
        """The persistent step, built on the first one-sequence step (it must not be built
        during a CUDA-graph capture: the graphs' warm-up runs come first)."""
        if not self._persistent_checked:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the persistent decode step is built on its first use; run a step eagerly "
                                   "before capturing one")
            self.persistent = self.model.persistent_step(self.cache)
            self._persistent_checked = True
        return self.persistent

    def __call__(self, ids: torch.Tensor, batch: Decode, greedy: bool = False) -> torch.Tensor:
        """Logits ``[B, V]`` of one decode step (``ids``: ``[B, 1]``); with ``greedy``, their
        argmax ``[B]`` (the model's forward: ``CausalLM.forward``)."""
        if greedy:
            return self.model(ids, batch, self.cache, last_only=True, greedy=True)
        if ids.shape[0] == 1:
            step = self._persistent_step()
            if step is not None:
                return self.model.decode_persistent(step, ids, batch)
        return self.model(ids, batch, self.cache, last_only=True)
