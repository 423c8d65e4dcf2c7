"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) over quantized linear layers.

RMSNorm, RoPE (the config's theta and scaling), grouped-query attention, SwiGLU MLP,
optional attention bias, tied embeddings. q/k/v and gate/up are fused into one linear
each (one weight read and one kernel launch instead of three or two); quantization is
per output row, so fusing does not change the quantized values. On the GPU the gate/up
weight's rows are interleaved so that the decode GEMV applies SwiGLU's activation itself
(``kernels/format.py``, ``interleave_gate_up``).

The residual stream is carried beside each layer's output (vLLM style) so that the
residual add and the next RMSNorm are one operation. On CUDA, that operation, RoPE with
the KV-cache write and SwiGLU's activation run as fused Triton kernels
(``kernels/fused.py``; the torch code here is the CPU path and their reference, and
that module states how close they are).
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from . import dispatch
from .config import ArchConfig
from .kv_cache import KVCache

_fused_enabled = True

# Prefill attention (set for the whole forward in ``CausalLM.hidden_states``) never takes
# cuDNN's SDPA, the default on an H100: cuDNN builds an execution plan for every new
# sequence length, ~50 ms on its first call at that length (measured on the H100 with
# torch 2.11), which a server -- whose prompts come in every length -- would pay in time
# to first token again and again. Flash attention has no such set-up (0.07 ms on a new
# length); memory-efficient attention and the math kernel are the fallbacks (and the CPU's).
_PREFILL_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


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
        self.launch_next = "start"  # the fused kernel's programmatic launch of the next (fused.LAUNCH_NEXT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before the weight, as the reference does.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; with no residual yet, ``x`` starts the stream."""
        fused = fused_ops(x)
        if fused is not None:
            return fused.add_rms_norm(x, residual, self.weight, self.eps, self.launch_next)
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
    cache, the cache ``slots``.

    * prompt chunks prefilled (``Batch.prefill``): packed into one row (B = 1, T = the sum
      of their lengths) so that every linear layer runs once for all of them; ``slots``
      holds each token's slot ``[T]``, ``prompt_lens``/``prompt_slots``/``prompt_starts``
      each chunk's length, slot and first position (0 for a whole prompt; a long prompt
      comes in chunks), and attention covers each chunk's slot up to its own tokens;
    * a decode step on CUDA (``lengths`` ``[B]`` on the device): the decode-attention
      kernel reads ``lengths[b]`` live positions of slot ``slots[b]`` -- no host value
      involved, so the step can be captured in a CUDA graph;
    * one whole prompt padded to T tokens (``last_index`` ``[1]`` on the device: the row of
      its last real token; positions ``[1, T]`` = 0..T-1, ``slots`` ``[T]`` its slot): the
      prefill a CUDA graph captures per T (``engine/cuda_graphs.py``). Attention is causal,
      so the padding rows after the prompt change nothing before them; their k and v land
      past the prompt in its slot, where decode steps overwrite them before reading;
    * otherwise ``length`` positions of every row's slot are gathered and masked (CPU path).
    """

    positions: torch.Tensor
    slots: torch.Tensor | None = None
    length: int | None = None
    lengths: torch.Tensor | None = None
    prompt_lens: tuple[int, ...] | None = None
    prompt_slots: tuple[int, ...] | None = None
    prompt_starts: tuple[int, ...] | None = None
    last_index: torch.Tensor | None = None

    @classmethod
    def prefill(cls, prompt_lens: list[int], prompt_slots: list[int], device: torch.device | str,
                prompt_starts: list[int] | None = None) -> Batch:
        """The packed prefill of prompt chunks of ``prompt_lens`` tokens into ``prompt_slots``
        from positions ``prompt_starts`` (default 0: whole prompts)."""
        starts = list(prompt_starts or [0] * len(prompt_lens))
        lens = torch.tensor(prompt_lens)
        offsets = torch.cumsum(lens, 0) - lens  # where each chunk begins in the packed row
        positions = torch.arange(int(lens.sum())) - torch.repeat_interleave(offsets - torch.tensor(starts), lens)
        slots = torch.repeat_interleave(torch.tensor(prompt_slots), lens)
        return cls(positions[None].to(device), slots.to(device), prompt_lens=tuple(prompt_lens),
                   prompt_slots=tuple(prompt_slots), prompt_starts=tuple(starts))

    @property
    def is_prefill(self) -> bool:
        return self.prompt_lens is not None

    @property
    def is_padded_prompt(self) -> bool:
        return self.last_index is not None

    def last_rows(self, h: torch.Tensor) -> torch.Tensor:
        """Each sequence's last hidden state: ``[B, T, C]`` -> ``[B, C]`` (``[prompts, C]`` packed)."""
        if self.is_padded_prompt:
            return h[0].index_select(0, self.last_index)
        if not self.is_prefill:
            return h[:, -1]
        ends = torch.tensor(self.prompt_lens).cumsum(0) - 1
        return h[0, ends.to(h.device)]

    def attention_mask(self) -> torch.Tensor:
        """Boolean ``[B, 1, T, L]``: query at position p sees cache positions <= p."""
        keys = torch.arange(self.length, device=self.positions.device)
        return (keys[None, None, :] <= self.positions[:, :, None]).unsqueeze(1)


class Attention(nn.Module):
    # True: a CUDA decode step's attention is done by the o projection's GEMV grid where that
    # layer can (WeightOnlyLinear.attends, kernels/csrc/attention.cuh): one kernel and one
    # wait fewer between qkv and o. Off: so far it is slower than the attention kernel apart
    # (H100, Llama-3-8B int4 batch-1 graph step: +156 us at position 128, +289 at 1024;
    # docs/bench/attention_in_o.md), its roles' attention being slower than the Triton kernel's.
    attention_in_o = False

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
        if cache is not None and batch.is_prefill:
            return self.o(self._prefill(qkv.view(T, -1), rope, batch, cache, fused)[None])
        if cache is not None and batch.is_padded_prompt:
            return self.o(self._padded_prompt(qkv.view(T, -1), rope, batch, cache, fused)[None])
        if fused is not None and cache is not None and batch.lengths is not None and T == 1:
            # CUDA decode step: RoPE, the cache write and live-token attention in one kernel
            k_cache, v_cache = cache.k[self.layer_idx], cache.v[self.layer_idx]
            if self.attention_in_o and getattr(self.o, "attends", None) and self.o.attends(B, H, Hkv, D):
                y = self.o.attend_and_project(qkv.view(B, -1), batch.positions.view(B), batch.slots, batch.lengths,
                                              rope.cos, rope.sin, k_cache, v_cache, H, D)
                return y.view(B, T, -1)
            from ..kernels.decode_attention import rope_cache_attention

            out = rope_cache_attention(qkv.view(B, -1), batch.positions.view(B), batch.slots, batch.lengths, rope.cos,
                                       rope.sin, k_cache, v_cache, H, D)
            return self.o(out.view(B, T, H * D))
        q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        q = rope(q.view(B, T, H, D).transpose(1, 2), batch.positions)
        k = rope(k.view(B, T, Hkv, D).transpose(1, 2), batch.positions)
        v = v.view(B, T, Hkv, D).transpose(1, 2)
        if cache is None:  # attention over this pass's own tokens
            out = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=H != Hkv)
        else:
            cache.write(self.layer_idx, batch.slots[:, None].expand(B, T).reshape(-1), batch.positions.reshape(-1),
                        k.transpose(1, 2).reshape(B * T, Hkv, D), v.transpose(1, 2).reshape(B * T, Hkv, D))
            if batch.lengths is not None:  # CUDA decode step (torch ops): live tokens only
                from ..kernels.decode_attention import decode_attention

                out = decode_attention(q[:, :, 0], cache.k[self.layer_idx], cache.v[self.layer_idx], batch.slots,
                                       batch.lengths).unsqueeze(2)
            else:
                k, v = cache.read(self.layer_idx, batch.slots, batch.length)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.attention_mask(), enable_gqa=H != Hkv)
        return self.o(out.transpose(1, 2).reshape(B, T, H * D))

    def _prefill(self, qkv: torch.Tensor, rope: Rotary, batch: Batch, cache: KVCache, fused) -> torch.Tensor:
        """Packed prompt chunks' attention outputs ``[T, H D]`` for their ``qkv`` ``[T, (H + 2 Hkv) D]``.

        Every token's rotated k and v go to its slot first (on CUDA RoPE and the write are
        one kernel for all tokens); a chunk of n tokens from position p then sees the
        contiguous positions ``[0, p + n)`` of its slot (its prompt's earlier chunks are
        there already), causally aligned to the end (query i sees keys up to p + i): one
        SDPA call per chunk.
        """
        H, D = self.heads, self.head_dim
        k_cache, v_cache = cache.k[self.layer_idx], cache.v[self.layer_idx]
        q = self._rope_and_cache(qkv, rope, batch, cache, fused).transpose(0, 1)  # [H, T, D]
        outs, start = [], 0
        # (the SDPA backends: _PREFILL_ATTENTION, set for the whole forward)
        for n, slot, p in zip(batch.prompt_lens, batch.prompt_slots, batch.prompt_starts):
            causal = {"is_causal": True} if p == 0 else {"attn_mask": causal_lower_right(n, p + n)}
            out = F.scaled_dot_product_attention(q[None, :, start:start + n], k_cache[None, slot, :, :p + n],
                                                 v_cache[None, slot, :, :p + n], enable_gqa=H != self.kv_heads,
                                                 **causal)
            outs.append(out[0].transpose(0, 1).reshape(n, H * D))
            start += n
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _padded_prompt(self, qkv: torch.Tensor, rope: Rotary, batch: Batch, cache: KVCache, fused) -> torch.Tensor:
        """Attention outputs ``[T, H D]`` of one whole prompt padded to T tokens (see ``Batch``):
        every device-side, so that a CUDA graph can capture it. Its keys and values are
        read back from its slot (positions ``[0, T)``), where they were just written."""
        T = qkv.shape[0]
        H, D = self.heads, self.head_dim
        q = self._rope_and_cache(qkv, rope, batch, cache, fused).transpose(0, 1)  # [H, T, D]
        k, v = cache.read(self.layer_idx, batch.slots[:1], T)
        out = F.scaled_dot_product_attention(q[None], k, v, is_causal=True, enable_gqa=H != self.kv_heads)
        return out[0].transpose(0, 1).reshape(T, H * D)

    def _rope_and_cache(self, qkv: torch.Tensor, rope: Rotary, batch: Batch, cache: KVCache, fused) -> torch.Tensor:
        """Rotate the q and k of prefill tokens ``qkv`` ``[T, (H + 2 Hkv) D]``, store k and v
        at their positions of their slots (``batch.slots`` ``[T]``); the rotated q ``[T, H, D]``."""
        T = qkv.shape[0]
        H, Hkv, D = self.heads, self.kv_heads, self.head_dim
        positions = batch.positions.view(T)
        if fused is not None:
            return fused.rope_and_cache(qkv, positions, batch.slots, rope.cos, rope.sin, cache.k[self.layer_idx],
                                        cache.v[self.layer_idx], H, Hkv, D)
        q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        q = rope(q.view(1, T, H, D).transpose(1, 2), positions[None])[0].transpose(0, 1)
        k = rope(k.view(1, T, Hkv, D).transpose(1, 2), positions[None])[0].transpose(0, 1)
        cache.write(self.layer_idx, batch.slots, positions, k, v.view(T, Hkv, D))
        return q


class MLP(nn.Module):
    def __init__(self, gate_up: nn.Module, down: nn.Module):
        super().__init__()
        self.gate_up, self.down = gate_up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_ops(x) is not None:  # the activation in the decode GEMV's epilogue, else one Triton kernel
            return self.down(self.gate_up(x, swiglu=True))
        gate, up = self.gate_up.gate_and_up(self.gate_up(x))
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, attn: Attention, mlp: MLP, input_norm: RMSNorm, post_norm: RMSNorm):
        super().__init__()
        self.attn, self.mlp = attn, mlp
        self.input_norm, self.post_norm = input_norm, post_norm
        # The norm between o and gate/up lets gate/up launch (programmatically) only once it
        # has read its inputs: launched at its start, gate/up's blocks take the SMs o's
        # blocks leave and put ~15 MB of weight loads in flight exactly as o ends, and the
        # norm's own reads wait behind them (H100, Llama-3-8B-shaped int4, batch-1 step:
        # gate/up's wait returned ~5.5 us after o's last block, 2.7 us so; graph step 133-173
        # us faster at position 128, 38-73 at 1024 over four runs: docs/bench/
        # decode_timeline.md, launch_order_ab.md).
        # The input norm keeps the early launch: qkv's loads then overlap down's long tail.
        post_norm.launch_next = "inputs"

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

    # True: a CUDA decode step of one sequence runs every decoder layer in one persistent
    # kernel (kernels/decode_step.py, csrc/decode_step.cuh) where the model qualifies:
    # int4 g128 weights on an sm_90 GPU, no biases; elsewhere the kernel-per-op step. None
    # (the default): True for models of hidden size persistent_min_hidden or more, where it
    # was measured faster -- H100, Llama-3-8B int4, the engine's batch-1 decode: 503.5 vs
    # 431.4 tok/s (docs/bench/persistent_ab.md); graph step 2319 vs 2426 us at position 128,
    # even at 1024 (session 45, docs/bench/decode_step_persistent.md). Not measured on
    # narrower models (SmolLM2's 576), whose kernel-per-op layers are short next to the
    # step's fixed cost a layer (the attention's round trips, five grid-wide waits).
    persistent_decode: bool | None = None
    persistent_min_hidden = 4096

    def __init__(self, cfg: ArchConfig, embed: nn.Embedding, layers: list[DecoderLayer], norm: RMSNorm,
                 lm_head: nn.Module, rope: Rotary):
        super().__init__()
        self.cfg = cfg
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = lm_head
        self.rope = rope
        self._decode_steps: dict[tuple[int, int], object] = {}  # per KV cache: DecodeStep, or None

    def _persistent_step(self, cache: KVCache):
        """The persistent decode step for this cache, built on first use; None where the
        model does not qualify."""
        key = (cache.k.data_ptr(), cache.v.data_ptr())
        if key in self._decode_steps:
            return self._decode_steps[key]
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the persistent decode step is built on its first use; run a step eagerly before "
                               "capturing one")
        from ..kernels.decode_step import DecodeStep

        step, linears = None, []
        for layer in self.layers:
            linears += [layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down]
        gpu = [getattr(m, "gpu", None) for m in linears]
        weights = [tuple(gpu[4 * i:4 * i + 4]) for i in range(len(self.layers))]
        if (all(w is not None for w in gpu) and all(getattr(m, "gpu_bias", 0) is None for m in linears)
                and DecodeStep.supported(weights, self.device)):
            cfg = self.cfg
            layers = [(*w, layer.input_norm.weight, layer.post_norm.weight) for w, layer in zip(weights, self.layers)]
            step = DecodeStep(layers, list(cache.k), list(cache.v), self.rope.cos, self.rope.sin, cfg.num_heads,
                              cfg.head_dim, self.layers[0].input_norm.eps)
        self._decode_steps[key] = step
        return step

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

    def wants_persistent_decode(self) -> bool:
        """Whether a one-sequence CUDA decode step asks for the persistent step (it still
        runs only where the model qualifies): ``persistent_decode``, or by default whether
        the model is at least ``persistent_min_hidden`` wide."""
        if self.persistent_decode is None:
            return self.cfg.hidden_size >= self.persistent_min_hidden
        return self.persistent_decode

    def hidden_states(self, input_ids: torch.Tensor, batch: Batch, cache: KVCache | None) -> torch.Tensor:
        x, residual = self.embed(input_ids), None
        if (self.wants_persistent_decode() and cache is not None and batch.lengths is not None and input_ids.shape == (1, 1)
                and fused_ops(x) is not None):
            step = self._persistent_step(cache)
            if step is not None:  # every layer in one kernel; x becomes the residual stream
                dispatch.decoder_step(4, self.cfg.hidden_size,
                                      lambda: step(x.view(-1), batch.positions.view(1), batch.slots, batch.lengths))
                return self.norm.add_forward(x, None)[0]
        # the SDPA backends of a prefill, chosen once for all layers (the switch costs host time)
        with sdpa_kernel(_PREFILL_ATTENTION) if batch.is_prefill or batch.is_padded_prompt else contextlib.nullcontext():
            for layer in self.layers:
                x, residual = layer(x, residual, self.rope, batch, cache)
        return self.norm.add_forward(x, residual)[0]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: Batch | None = None, cache: KVCache | None = None,
                last_only: bool = False) -> torch.Tensor:
        """Logits ``[B, T, V]`` (``[B, V]`` with ``last_only``, ``[prompts, V]`` for a packed
        prefill) in fp32.

        Without ``batch``, positions are 0..T-1 and no cache is used.
        """
        if batch is None:
            B, T = input_ids.shape
            batch = Batch(torch.arange(T, device=input_ids.device).expand(B, T))
        h = self.hidden_states(input_ids, batch, cache)
        if last_only:
            h = batch.last_rows(h)
        return self.lm_head.logits(h)
