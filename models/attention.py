"""Attention behind one interface, one implementation per kind of pass and device.

A decoder layer hands its attention the qkv projection's rows ``[rows, (H + 2 Hkv) D]`` and
gets back ``[rows, H D]`` for the o projection; what happens between -- RoPE, the KV-cache
write, which cached positions each query sees -- belongs to the implementation chosen for
the pass (``attention_for``). A paged KV cache or a tensor-parallel shard of the heads
is another implementation, not a change to the model.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..kernels.options import RuntimeOptions
from .batches import TILE_TOKENS, Batch, Causal, Prefill
from .kv_cache import KVCache

# Prefill attention never takes cuDNN's SDPA, the default on an H100: cuDNN builds an
# execution plan for every new sequence length (~50 ms on its first call at that length),
# which a server, whose prompts come in every length, would pay in time to first token
# again and again. Flash attention has no such set-up; memory-efficient attention and the
# math kernel are the fallbacks (and the CPU's).
_PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def end_aligned_causal(n: int, total: int, device: torch.device) -> torch.Tensor:
    """The boolean mask of n queries that are the last n of ``total`` keys (causal, aligned
    to the end): what SDPA makes of torch's lower-right ``CausalBias`` where no fused kernel
    takes it, built here so that the CPU never imports ``torch.nn.attention.bias``, which
    imports ``torch._dynamo`` as it loads (``docs/design/ci.md``)."""
    return torch.ones(n, total, dtype=torch.bool, device=device).tril(total - n)


class Rotary(nn.Module):
    """cos/sin tables for positions [0, max_len), computed in fp32 like the reference."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_len: int):
        super().__init__()
        freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at ``positions`` ``[B, T]``, ``[B, 1, T, D]`` in ``dtype``: what ``rotate``
        takes (a pass's layers share one gather of them)."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[B, heads, T, D]`` by ``tables``' cos and sin."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[B, heads, T, D]`` at ``positions`` ``[B, T]``."""
        return self.rotate(x, *self.tables(positions, x.dtype))


@dataclass(frozen=True)
class Heads:
    heads: int
    kv_heads: int
    head_dim: int

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        H, Hkv, D = self.heads, self.kv_heads, self.head_dim
        return qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)


class _Attention:
    """What every implementation holds: its pass's batch, the head shape, RoPE, the cache,
    the fused kernels (``kernels/fused.py``; None: the torch ops) and, from the model's
    options, whether they launch programmatically, the decode-attention kernel's tiles at
    large batches and the chunk kernel's walk over the keys."""

    def __init__(self, batch: Batch, heads: Heads, rope: Rotary, cache: KVCache | None, fused,
                 options: RuntimeOptions):
        self.batch, self.h, self.rope, self.cache, self.fused = batch, heads, rope, cache, fused
        self.programmatic = options.programmatic_launch
        self.wide, self.walk = options.decode_attention, options.chunk_attention

    def context(self):
        """Entered once around a whole forward (switching SDPA backends costs host time)."""
        return contextlib.nullcontext()

    def _rope_and_cache(self, layer: int, qkv: torch.Tensor, positions: torch.Tensor,
                        slots: torch.Tensor) -> torch.Tensor:
        """Rotate the q and k of token rows ``qkv`` ``[T, (H + 2 Hkv) D]`` at ``positions`` ``[T]``,
        store k and v at those positions of ``slots`` ``[T]``; the rotated q ``[T, H, D]``."""
        T = qkv.shape[0]
        H, Hkv, D = self.h.heads, self.h.kv_heads, self.h.head_dim
        cache = self.cache
        if self.fused is not None:
            return self.fused.rope_and_cache(qkv, positions, slots, self.rope.cos, self.rope.sin, cache.k[layer],
                                             cache.v[layer], cache.block_table, H, Hkv, D,
                                             programmatic=self.programmatic)
        q, k, v = self.h.split(qkv)
        q = self.rope(q.view(1, T, H, D).transpose(1, 2), positions[None])[0].transpose(0, 1)
        k = self.rope(k.view(1, T, Hkv, D).transpose(1, 2), positions[None])[0].transpose(0, 1)
        cache.write(layer, slots, positions, k, v.view(T, Hkv, D))
        return q


class CausalAttention(_Attention):
    """Tokens attending to the earlier tokens of their own row; no cache."""


    def __call__(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        B, T = self.batch.positions.shape
        H, Hkv, D = self.h.heads, self.h.kv_heads, self.h.head_dim
        q, k, v = self.h.split(qkv.view(B, T, -1))
        q = self.rope(q.view(B, T, H, D).transpose(1, 2), self.batch.positions)
        k = self.rope(k.view(B, T, Hkv, D).transpose(1, 2), self.batch.positions)
        v = v.view(B, T, Hkv, D).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=H != Hkv)
        return out.transpose(1, 2).reshape(B * T, H * D)


class PrefillAttention(_Attention):
    """Packed chunks (``Prefill``). Every token's rotated k and v go to its row's blocks
    first (on CUDA RoPE and the write are one kernel for all tokens); a chunk of n tokens
    from position p then sees positions ``[0, p + n)`` of its row (its sequence's earlier
    chunks, or blocks of a cached prefix, are there already), causally aligned to the end.
    The batch's query tiles go to the chunk kernel in one launch (CUDA,
    ``kernels/chunk_attention.py``); every other chunk is one SDPA call over its keys
    gathered from the blocks into one contiguous run."""

    def __init__(self, *args):
        super().__init__(*args)
        # SDPA's mask for a chunk after cached positions, chosen by the pass's device. On
        # CUDA torch's CausalBias, which flash or memory-efficient attention run without a
        # mask; importing it imports torch._dynamo, so that happens here, with the first
        # prefill (at start-up where graphs are captured), not in the middle of serving.
        if self.cache.k.is_cuda:
            from torch.nn.attention.bias import causal_lower_right

            self.end_mask = causal_lower_right
        else:
            device = self.cache.k.device
            self.end_mask = lambda n, total: end_aligned_causal(n, total, device)

    def context(self):
        return sdpa_kernel(_PREFILL_BACKENDS)

    def __call__(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        b = self.batch
        T, H, D = qkv.shape[0], self.h.heads, self.h.head_dim
        q = self._rope_and_cache(layer, qkv, b.positions.view(-1), b.slots)  # [T, H, D]
        tiled = b.tiles is not None and self.fused is not None
        out = q.new_empty(T, H, D)
        if tiled:
            from ..kernels.chunk_attention import chunk_attention

            chunk_attention(q, self.cache.k[layer], self.cache.v[layer], self.cache.block_table, b.tiles,
                            TILE_TOKENS, out, programmatic=self.programmatic, walk=self.walk)
        elif not b.chunks:
            raise ValueError("a packed pass without host chunks needs the chunk kernel (CUDA, fused kernels)")
        qt = q.transpose(0, 1)  # [H, T, D]
        for c in b.chunks:
            if tiled and c.tokens < b.dense_from:
                continue  # (the kernel's)
            n, p = c.tokens, c.start
            causal = {"is_causal": True} if p == 0 else {"attn_mask": self.end_mask(n, p + n)}
            k, v = self.cache.read(layer, c.slot, p + n)
            o = F.scaled_dot_product_attention(qt[None, :, c.row:c.row + n], k, v, enable_gqa=H != self.h.kv_heads,
                                               **causal)
            out[c.row:c.row + n] = o[0].transpose(0, 1)
        return out.view(T, H * D)


class FusedDecodeAttention(_Attention):
    """A CUDA decode step: RoPE, the cache write and attention over the live tokens in one
    Triton kernel (``kernels/decode_attention.py``)."""


    def __call__(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        from ..kernels.decode_attention import rope_cache_attention

        b, B = self.batch, qkv.shape[0]
        out = rope_cache_attention(qkv, b.positions.view(B), b.slots, b.lengths, self.rope.cos, self.rope.sin,
                                   self.cache.k[layer], self.cache.v[layer], self.cache.block_table, self.h.heads,
                                   self.h.head_dim, programmatic=self.programmatic, wide=self.wide)
        return out.view(B, -1)


@dataclass(frozen=True)
class _DecodePass:
    """What every layer of a torch decode pass uses, worked out once (each is a few small
    ops, and on the CPU small ops are much of a decode step: docs/design/kv_cache.md):
    RoPE's tables and where the new keys go (``KVCache.locate``); on the CPU also the
    longest length, ``KVCache.read``'s index and the mask as the additive bias (0 or -inf)
    that SDPA would otherwise make of a boolean mask at every call."""

    cos: torch.Tensor
    sin: torch.Tensor
    at: tuple[torch.Tensor, torch.Tensor]
    length: int = 0
    index: torch.Tensor | None = None
    bias: torch.Tensor | None = None


class TorchDecodeAttention(_Attention):
    """A decode step through torch ops (the fused kernels' reference): RoPE, the cache write,
    then on CUDA the decode-attention kernel over the live tokens, elsewhere the batch's
    cached rows gathered up to its longest sequence and masked per row."""

    def __init__(self, *args):
        super().__init__(*args)
        # (made at the first layer's call, inside a graph's capture where there is one)
        self.shared: _DecodePass | None = None

    def __call__(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        b, B = self.batch, qkv.shape[0]
        H, Hkv, D = self.h.heads, self.h.kv_heads, self.h.head_dim
        if self.shared is None:
            self.shared = self._shared(qkv)
        s = self.shared
        q, k, v = self.h.split(qkv.view(B, 1, -1))
        q = self.rope.rotate(q.view(B, 1, H, D).transpose(1, 2), s.cos, s.sin)
        k = self.rope.rotate(k.view(B, 1, Hkv, D).transpose(1, 2), s.cos, s.sin)
        self.cache.write(layer, b.slots, b.positions.view(B), k.view(B, Hkv, D), v.view(B, Hkv, D), at=s.at)
        if qkv.is_cuda:
            from ..kernels.decode_attention import decode_attention

            out = decode_attention(q[:, :, 0], self.cache.k[layer], self.cache.v[layer], self.cache.block_table,
                                   b.slots, b.lengths, programmatic=self.programmatic, wide=self.wide)
            return out.reshape(B, H * D)
        k, v = self.cache.read(layer, b.slots, s.length, s.index)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=s.bias, enable_gqa=H != Hkv)
        return out.transpose(1, 2).reshape(B, H * D)

    def _shared(self, qkv: torch.Tensor) -> _DecodePass:
        b = self.batch
        cos, sin = self.rope.tables(b.positions, qkv.dtype)
        at = self.cache.locate(b.slots, b.positions.view(-1))
        if qkv.is_cuda:
            return _DecodePass(cos, sin, at)
        length = int(b.lengths.max())
        keys = torch.arange(length, device=qkv.device)
        visible = (keys[None, None, :] <= b.positions[:, :, None]).unsqueeze(1)  # [B, 1, 1, length]
        bias = torch.zeros(visible.shape, dtype=qkv.dtype, device=qkv.device).masked_fill_(~visible, float("-inf"))
        return _DecodePass(cos, sin, at, length, self.cache.read_index(b.slots, length), bias)


def attention_for(batch: Batch, heads: Heads, rope: Rotary, cache: KVCache | None, fused,
                  options: RuntimeOptions):
    """The attention implementation of a pass of this kind (``fused``: the fused-kernel
    module on CUDA, else None; ``options``: the model's)."""
    if isinstance(batch, Causal):
        kind = CausalAttention
    elif cache is None:
        raise ValueError(f"a {type(batch).__name__} pass needs a KV cache")
    elif isinstance(batch, Prefill):
        kind = PrefillAttention
    else:
        kind = FusedDecodeAttention if fused is not None else TorchDecodeAttention
    return kind(batch, heads, rope, cache, fused, options)
