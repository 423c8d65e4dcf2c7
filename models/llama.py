"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) over quantized linear layers.

RMSNorm, RoPE (the config's theta and scaling), grouped-query attention, SwiGLU MLP,
optional attention bias, tied embeddings. q/k/v and gate/up are fused into one linear
each (one weight read and one kernel launch instead of three or two); quantization is
per output row, so fusing does not change the quantized values.

The residual stream is carried beside each layer's output (vLLM style) so that the
residual add and the next RMSNorm are one operation. On CUDA, that operation, RoPE with
the KV-cache write and SwiGLU's activation run as fused Triton kernels
(``kernels/fused.py``; the torch code here is the CPU path and their reference).
Attention is whatever the pass's kind asks for (``models/attention.py``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..kernels.observe import KernelCall, KernelTiming
from ..kernels.options import RuntimeOptions
from ..kernels.plans import DECODE_STEP, Epilogue
from .attention import Heads, Rotary, attention_for
from .batches import Batch, Causal, Decode
from .config import ArchConfig
from .kv_cache import KVCache


@functools.cache
def _fused_module():
    try:
        from ..kernels import fused
    except ImportError:  # no Triton: the torch ops
        return None
    return fused


@dataclass(frozen=True)
class Pass:
    """What every layer of one forward pass shares: the attention chosen for the pass's kind,
    the fused-kernel module (None: torch ops), whether its kernels launch programmatically,
    and what sums a row-parallel layer's partial output over a tensor-parallel group
    (None: one rank, nothing to sum)."""

    attention: object
    fused: object
    programmatic: bool
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def summed(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.reduce is None else self.reduce(y)


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

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                    p: Pass) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; with no residual yet, ``x`` starts the stream."""
        if p.fused is not None:
            return p.fused.add_rms_norm(x, residual, self.weight, self.eps, self.launch_next, p.programmatic)
        if residual is not None:
            x = x + residual
        return self(x), x


class Attention(nn.Module):
    """The qkv projection, the pass's attention (``Pass.attention``) and the o projection."""

    def __init__(self, qkv: nn.Module, o: nn.Module, layer_idx: int):
        super().__init__()
        self.qkv, self.o = qkv, o
        self.layer_idx = layer_idx

    def forward(self, x: torch.Tensor, p: Pass) -> torch.Tensor:
        qkv = self.qkv(x)
        out = p.attention(self.layer_idx, qkv.view(-1, qkv.shape[-1]))
        return p.summed(self.o(out.view(*x.shape[:-1], -1)))


class MLP(nn.Module):
    def __init__(self, gate_up: nn.Module, down: nn.Module):
        super().__init__()
        self.gate_up, self.down = gate_up, down

    def forward(self, x: torch.Tensor, p: Pass) -> torch.Tensor:
        return p.summed(self.down(self.gate_up(x, Epilogue.SWIGLU)))


class DecoderLayer(nn.Module):
    def __init__(self, attn: Attention, mlp: MLP, input_norm: RMSNorm, post_norm: RMSNorm):
        super().__init__()
        self.attn, self.mlp = attn, mlp
        self.input_norm, self.post_norm = input_norm, post_norm
        # The norm between o and gate/up lets gate/up launch (programmatically) only once it
        # has read its inputs: launched at its start, gate/up's blocks would put their weight
        # loads in flight as o ends, and the norm's own reads would wait behind them. The
        # input norm keeps the early launch: qkv's loads then overlap down's tail.
        post_norm.launch_next = "inputs"

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, p: Pass) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp_out, residual)``: the layer's output is their sum, which the next layer's
        ``add_forward`` (or the final norm) forms; ``residual`` None means ``x`` is the stream."""
        h, residual = self.input_norm.add_forward(x, residual, p)
        h, residual = self.post_norm.add_forward(self.attn(h, p), residual, p)
        return self.mlp(h, p), residual


class CausalLM(nn.Module):
    """The decoder with its embedding and LM head. Built by ``models.builder``, which binds
    every linear layer's kernels and sets ``options``."""

    def __init__(self, cfg: ArchConfig, embed: nn.Embedding, layers: list[DecoderLayer], norm: RMSNorm,
                 lm_head: nn.Module, rope: Rotary):
        super().__init__()
        self.cfg = cfg
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = lm_head
        self.rope = rope
        self.heads = Heads(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.options = RuntimeOptions()
        # A tensor-parallel rank's shard (models/sharding.py, set by the builder): cfg then
        # holds the rank's heads and intermediate rows; None: the whole model.
        self.tp = None
        # With ``tp``, the rank's rows of the embedding and the LM head (vocab-parallel:
        # models/sharding.py); None: the whole vocabulary.
        self.vocab_share: range | None = None
        self.kernel_timing: KernelTiming | None = None

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

    def linears(self) -> list[nn.Module]:
        """Every linear layer, the decoder's in step order (qkv, o, gate_up, down), then the LM head."""
        out = []
        for layer in self.layers:
            out += [layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down]
        return out + [self.lm_head]

    def observe_kernels(self, timing: KernelTiming | None) -> None:
        """Count every linear-layer call (and the persistent decode step) with ``timing``, which
        samples their latency; None stops. Plans are wrapped, not changed."""
        self.kernel_timing = timing
        for linear in self.linears():
            linear.observe(timing)

    def _pass(self, batch: Batch, cache: KVCache | None, x: torch.Tensor) -> Pass:
        fused = _fused_module() if x.is_cuda and self.options.fused_ops else None
        programmatic = self.options.programmatic_launch
        reduce = self.tp.all_reduce if self.tp is not None and self.tp.size > 1 else None
        return Pass(attention_for(batch, self.heads, self.rope, cache, fused, self.options), fused, programmatic,
                    reduce)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings; vocab-parallel, each rank looks up the tokens it holds
        and zeros for the rest, and the all-reduce sums in the holder's row."""
        share = self.vocab_share
        if share is None:
            return self.embed(input_ids)
        local = input_ids - share.start
        held = (local >= 0) & (local < len(share))
        x = self.embed(local.clamp(0, len(share) - 1)).masked_fill_(~held.unsqueeze(-1), 0)
        return self.tp.all_reduce(x)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the whole vocabulary (vocab-parallel: every rank's rows gathered)."""
        logits = self.lm_head.logits(h)
        return logits if self.vocab_share is None else self.tp.all_gather_last(logits)

    def _greedy(self, h: torch.Tensor) -> torch.Tensor:
        """Each row's most likely token (int64), the logits' first maximum as ``argmax``;
        vocab-parallel without gathering the logits: each rank's best (value, index) is
        gathered and the best of those taken (on a tie the first rank's: the lower index)."""
        logits = self.lm_head.logits(h)
        if self.vocab_share is None:
            return logits.argmax(-1)
        best, index = logits.max(-1, keepdim=True)
        best, index = self.tp.all_gather_last(best), self.tp.all_gather_last(index + self.vocab_share.start)
        return index.gather(-1, best.argmax(-1, keepdim=True)).squeeze(-1)

    def layer_output(self, layer: DecoderLayer, x: torch.Tensor, batch: Causal) -> torch.Tensor:
        """One decoder layer's output hidden states for its input hidden states ``x`` (GPTQ
        calibrates layer by layer)."""
        out, residual = layer(x, None, self._pass(batch, None, x))
        return out + residual

    def hidden_states(self, input_ids: torch.Tensor, batch: Batch, cache: KVCache | None) -> torch.Tensor:
        x, residual = self._embed(input_ids), None
        p = self._pass(batch, cache, x)
        with p.attention.context():
            for layer in self.layers:
                x, residual = layer(x, residual, p)
        return self.norm.add_forward(x, residual, p)[0]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: Batch | None = None, cache: KVCache | None = None,
                last_only: bool = False, greedy: bool = False) -> torch.Tensor:
        """Logits ``[B, T, V]`` (``[B, V]`` with ``last_only``, ``[prompts, V]`` for a packed
        prefill) in fp32; with ``greedy``, their argmax instead (``[B, T]``, ``[B]``, ...).
        Without ``batch``: positions 0..T-1, no cache (``Causal``)."""
        if batch is None:
            B, T = input_ids.shape
            batch = Causal(torch.arange(T, device=input_ids.device).expand(B, T))
        h = self.hidden_states(input_ids, batch, cache)
        if last_only:
            h = batch.last_rows(h)
        return self._greedy(h) if greedy else self._logits(h)

    # -- the persistent batch-1 decode step ------------------------------------------------
    def wants_persistent_decode(self) -> bool:
        """Whether a one-sequence CUDA decode step asks for the persistent step (it still runs
        only where the model qualifies): ``options.decode_step.enabled``, by default whether
        the model is at least ``min_hidden`` wide. A tensor-parallel shard only where its
        group has peer buffers: the step's stages meet across the GPUs there."""
        if self.tp is not None and self.tp.size > 1 and self.tp.peer is None:
            return False
        step = self.options.decode_step
        return self.cfg.hidden_size >= step.min_hidden if step.enabled is None else step.enabled

    def persistent_step(self, cache: KVCache):
        """The persistent decode step (``kernels/decode_step.py``) over ``cache``: every decoder
        layer in one kernel; None where the model does not qualify (CUDA, fused kernels, int4
        g128 weights without biases on an sm_90 GPU, ``DecodeStep.supported``). A
        tensor-parallel shard's, only where every rank's qualifies on as many SMs (a
        collective: every rank calls it), since each rank's stages wait for every rank's."""
        step = self._persistent_step(cache)
        if self.tp is None or self.tp.size == 1:
            return step
        from ..kernels.device import sm_count

        sms = sm_count(self.device)
        qualifies, fewest, most = self.tp.minimum([step is not None, sms, -sms], self.device)
        return step if qualifies and fewest == -most else None

    def _persistent_step(self, cache: KVCache):
        if not (cache.k.is_cuda and self.options.fused_ops and _fused_module() is not None):
            return None
        from ..kernels.decode_step import DecodeStep

        linears = self.linears()[:-1]
        plans = [getattr(m, "_plan", None) for m in linears]
        gpu = [getattr(m, "gpu", None) for m in linears]
        if any(w is None for w in gpu) or any(getattr(p, "bias", 0) is not None for p in plans):
            return None
        weights = [tuple(gpu[4 * i:4 * i + 4]) for i in range(len(self.layers))]
        if not DecodeStep.supported(weights, self.device):
            return None
        layers = [(*w, layer.input_norm.weight, layer.post_norm.weight) for w, layer in zip(weights, self.layers)]
        tp = self.tp if self.tp is not None and self.tp.size > 1 else None
        return DecodeStep(layers, list(cache.k), list(cache.v), cache.block_table, self.rope.cos, self.rope.sin,
                          self.cfg.num_heads, self.cfg.head_dim, self.layers[0].input_norm.eps,
                          self.options.decode_step, rank=tp.rank if tp else 0,
                          peer_areas=tp.peer.step_areas if tp else ())

    @torch.inference_mode()
    def decode_persistent(self, step, input_ids: torch.Tensor, batch: Decode) -> torch.Tensor:
        """Logits ``[1, V]`` of a one-sequence decode step with every decoder layer in the
        persistent kernel ``step`` (``persistent_step``); launch-only, a CUDA graph captures it."""
        x = self._embed(input_ids)

        def launch(stamps: torch.Tensor | None) -> None:
            step(x.view(-1), batch.positions.view(1), batch.slots, batch.lengths, stamps)

        if self.kernel_timing is None:
            launch(None)
        else:  # the layers' stages counted as their linears' calls, timed from the kernel's stamps
            first = self.layers[0]
            stages = [KernelCall(DECODE_STEP, m.layer_kind, m.bits, 1, m.out_features, m.in_features, m._group_size(),
                                 m.zeros is not None)
                      for m in (first.attn.qkv, first.attn.o, first.mlp.gate_up, first.mlp.down)]
            stages.insert(1, KernelCall(DECODE_STEP, "attention", 16, 1, 0, 0))
            self.kernel_timing.stages(stages, len(self.layers), launch, step.stamps)
        p = Pass(None, _fused_module(), self.options.programmatic_launch)
        h = self.norm.add_forward(x, None, p)[0]  # (x is the residual stream now)
        return self._logits(h[:, -1])
