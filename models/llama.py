"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) over quantized linear layers.

RMSNorm, RoPE (the config's theta and scaling), grouped-query attention, SwiGLU MLP,
optional attention bias, tied embeddings. q/k/v and gate/up are fused into one linear
each (one weight read and one kernel launch instead of three or two); quantization is
per output row, so fusing does not change the quantized values.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import ArchConfig
from .kv_cache import KVCache


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before the weight, as the reference does.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Rotary(nn.Module):
    """cos/sin tables for positions [0, max_len), computed in fp32 like the reference."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_len: int):
        super().__init__()
        freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[B, heads, T, D]`` at ``positions`` ``[B, T]``."""
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


@dataclass
class Batch:
    """Where the tokens of a forward pass sit: ``positions`` ``[B, T]`` and, with a KV
    cache, each row's cache ``slots`` ``[B]``.

    * a prompt prefilled from position 0 (``prefill=True``): attention over its own keys,
      written to the cache on the way;
    * a decode step on CUDA (``lengths`` ``[B]`` on the device): the decode-attention
      kernel reads ``lengths[b]`` live positions of each slot -- no host value involved,
      so the step can be captured in a CUDA graph;
    * otherwise ``length`` positions of every row are gathered and masked (CPU path).
    """

    positions: torch.Tensor
    slots: torch.Tensor | None = None
    length: int | None = None
    lengths: torch.Tensor | None = None
    prefill: bool = False

    def attention_mask(self) -> torch.Tensor:
        """Boolean ``[B, 1, T, L]``: query at position p sees cache positions <= p."""
        keys = torch.arange(self.length, device=self.positions.device)
        return (keys[None, None, :] <= self.positions[:, :, None]).unsqueeze(1)


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, qkv: nn.Module, o: nn.Module, layer_idx: int):
        super().__init__()
        self.qkv, self.o = qkv, o
        self.layer_idx = layer_idx
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def forward(self, x: torch.Tensor, rope: Rotary, batch: Batch, cache: KVCache | None) -> torch.Tensor:
        B, T, _ = x.shape
        H, Hkv, D = self.heads, self.kv_heads, self.head_dim
        q, k, v = self.qkv(x).split([H * D, Hkv * D, Hkv * D], dim=-1)
        q = rope(q.view(B, T, H, D).transpose(1, 2), batch.positions)
        k = rope(k.view(B, T, Hkv, D).transpose(1, 2), batch.positions)
        v = v.view(B, T, Hkv, D).transpose(1, 2)
        if cache is not None:
            cache.write(self.layer_idx, batch.slots, batch.positions, k, v)
        if cache is None or batch.prefill:  # attention over this pass's own tokens
            out = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=H != Hkv)
        elif batch.lengths is not None:  # CUDA decode step: live tokens only
            from ..kernels.decode_attention import decode_attention

            out = decode_attention(q[:, :, 0], cache.k[self.layer_idx], cache.v[self.layer_idx], batch.slots,
                                   batch.lengths, cache.max_seq_len).unsqueeze(2)
        else:
            k, v = cache.read(self.layer_idx, batch.slots, batch.length)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.attention_mask(), enable_gqa=H != Hkv)
        return self.o(out.transpose(1, 2).reshape(B, T, H * D))


class MLP(nn.Module):
    def __init__(self, gate_up: nn.Module, down: nn.Module):
        super().__init__()
        self.gate_up, self.down = gate_up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, attn: Attention, mlp: MLP, input_norm: RMSNorm, post_norm: RMSNorm):
        super().__init__()
        self.attn, self.mlp = attn, mlp
        self.input_norm, self.post_norm = input_norm, post_norm

    def forward(self, x, rope, batch, cache):
        h = x + self.attn(self.input_norm(x), rope, batch, cache)
        return h + self.mlp(self.post_norm(h))


class CausalLM(nn.Module):
    """The decoder with its embedding and LM head. Built by ``models.builder``."""

    def __init__(self, cfg: ArchConfig, embed: nn.Embedding, layers: list[DecoderLayer], norm: RMSNorm,
                 lm_head: nn.Module, rope: Rotary):
        super().__init__()
        self.cfg = cfg
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = lm_head
        self.rope = rope

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def max_seq_len(self) -> int:
        """Longest sequence the RoPE table (built at load) covers."""
        return self.rope.cos.shape[0]

    def hidden_states(self, input_ids: torch.Tensor, batch: Batch, cache: KVCache | None) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, self.rope, batch, cache)
        return self.norm(x)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: Batch | None = None, cache: KVCache | None = None,
                last_only: bool = False) -> torch.Tensor:
        """Logits ``[B, T, V]`` (``[B, V]`` with ``last_only``) in fp32.

        Without ``batch``, positions are 0..T-1 and no cache is used.
        """
        if batch is None:
            B, T = input_ids.shape
            batch = Batch(torch.arange(T, device=input_ids.device).expand(B, T))
        h = self.hidden_states(input_ids, batch, cache)
        if last_only:
            h = h[:, -1]
        return self.lm_head(h).float()
