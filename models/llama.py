"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) over quantized linear layers.

RMSNorm, RoPE (the config's theta and scaling), grouped-query attention, SwiGLU MLP,
optional attention bias, tied embeddings. q/k/v and gate/up are fused into one linear
each (one weight read and one kernel launch instead of three or two); quantization is
per output row, so fusing does not change the quantized values.

The residual stream is carried beside each layer's output (vLLM style) so that the
residual add and the next RMSNorm are one operation. On CUDA, that operation, RoPE with
the KV-cache write (decode) and SwiGLU's activation run as fused Triton kernels
(``kernels/fused.py``; the torch code here is the CPU path and their reference, and
that module states how close they are).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import ArchConfig
from .kv_cache import KVCache

_fused_enabled = True


def set_fused_ops(enabled: bool) -> None:
    """Use the fused Triton kernels on CUDA (default) or the torch ops (for comparisons)."""
    global _fused_enabled
    _fused_enabled = enabled


@functools.cache
def _fused_module():
    try:
        from ..kernels import fused
    except ImportError:  # no Triton: the torch ops
        return None
    return fused


def fused_ops(x: torch.Tensor):
    """The fused-kernel module for CUDA tensors, else None (torch ops)."""
    return _fused_module() if x.is_cuda and _fused_enabled else None


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

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; with no residual yet, ``x`` starts the stream."""
        fused = fused_ops(x)
        if fused is not None:
            return fused.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        return self(x), x


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
        qkv = self.qkv(x)
        fused = fused_ops(qkv)
        if fused is not None and cache is not None and batch.lengths is not None and T == 1:
            # CUDA decode step: RoPE and the cache write in one kernel, then live-token attention
            from ..kernels.decode_attention import decode_attention

            q = fused.rope_and_cache(qkv.view(B, -1), batch.positions.view(B), batch.slots, rope.cos, rope.sin,
                                     cache.k[self.layer_idx], cache.v[self.layer_idx], H, Hkv, D)
            out = decode_attention(q, cache.k[self.layer_idx], cache.v[self.layer_idx], batch.slots, batch.lengths,
                                   cache.max_seq_len)
            return self.o(out.view(B, T, H * D))
        q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
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
        gate_up = self.gate_up(x)
        fused = fused_ops(gate_up)
        if fused is not None:
            return self.down(fused.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, attn: Attention, mlp: MLP, input_norm: RMSNorm, post_norm: RMSNorm):
        super().__init__()
        self.attn, self.mlp = attn, mlp
        self.input_norm, self.post_norm = input_norm, post_norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rotary, batch: Batch,
                cache: KVCache | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp_out, residual)``: the layer's output is their sum, which the next layer's
        ``add_forward`` (or the final norm) forms; ``residual`` None means ``x`` is the stream."""
        h, residual = self.input_norm.add_forward(x, residual)
        h, residual = self.post_norm.add_forward(self.attn(h, rope, batch, cache), residual)
        return self.mlp(h), residual

    def output(self, x: torch.Tensor, rope: Rotary, batch: Batch, cache: KVCache | None) -> torch.Tensor:
        """The layer's output hidden states for input hidden states ``x``."""
        out, residual = self(x, None, rope, batch, cache)
        return out + residual


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
        x, residual = self.embed(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, self.rope, batch, cache)
        return self.norm.add_forward(x, residual)[0]

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
