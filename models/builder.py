"""Build our ``CausalLM`` from a Hugging Face state dict, quantizing linear layers on load."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Literal

import torch
from torch import nn
from tqdm.auto import tqdm

from ..kernels.format import QuantSpec
from .config import ArchConfig, rope_inv_freq
from .llama import MLP, Attention, CausalLM, DecoderLayer, RMSNorm, Rotary
from .quant_linear import DenseLinear, WeightOnlyLinear

QuantMode = Literal["int8", "int4", "none"]


@dataclass(frozen=True)
class QuantConfig:
    """What ``--quant`` / ``--group-size`` / ``--sym`` ask for.

    Defaults follow the seeds: int8 symmetric per-channel absmax; int4 group-wise (g128)
    asymmetric min-max with zero points, as GPTQ checkpoints are.
    """

    mode: QuantMode = "int8"
    group_size: int | None = None  # None: the mode's default; 0: per-channel
    symmetric: bool | None = None  # None: the mode's default
    quantize_lm_head: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ("int8", "int4", "none"):
            raise ValueError(f"quant must be int8, int4 or none, got {self.mode!r}")
        if self.group_size not in (None, 0) and self.group_size not in (32, 64, 128, 256):
            raise ValueError(f"group size must be 0 (per-channel), 32, 64, 128 or 256, got {self.group_size}")

    def spec(self) -> QuantSpec | None:
        if self.mode == "none":
            return None
        bits = 8 if self.mode == "int8" else 4
        g = self.group_size if self.group_size is not None else (0 if bits == 8 else 128)
        sym = self.symmetric if self.symmetric is not None else bits == 8
        return QuantSpec(bits=bits, group_size=g or None, symmetric=sym)

    def describe(self) -> str:
        spec = self.spec()
        return "none (dense)" if spec is None else spec.describe()


LinearFactory = Callable[[torch.Tensor, "torch.Tensor | None", str], nn.Module]


def linear_factory(quant: QuantConfig, dtype: torch.dtype, device: torch.device) -> LinearFactory:
    """A function making the linear layer for (weight, bias, layer kind), quantized or not."""
    spec = quant.spec()
    cache = device.type == "cpu"

    def make(weight: torch.Tensor, bias: torch.Tensor | None, kind: str) -> nn.Module:
        bias = None if bias is None else bias.to(device=device, dtype=dtype)
        if spec is None or (kind == "lm_head" and not quant.quantize_lm_head):
            return DenseLinear(weight.to(device=device, dtype=dtype), bias, kind)
        # Quantize the checkpoint's own values (in fp32, on the target device: fast on a
        # GPU), so that CPU and GPU runs hold the same codes; the dense copy is dropped.
        return WeightOnlyLinear.from_float(weight.to(device=device, dtype=torch.float32), bias, spec, kind,
                                           cache_dequantized=cache)

    return make


def _cat(tensors: Iterable[torch.Tensor | None]) -> torch.Tensor | None:
    ts = list(tensors)
    return None if any(t is None for t in ts) else torch.cat(ts, 0)


def build_model(
    hf_config,
    state_dict: dict[str, torch.Tensor],
    quant: QuantConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    max_seq_len: int,
    progress: bool = True,
) -> CausalLM:
    """Assemble the model from HF-named tensors (``model.layers.{i}.self_attn.q_proj.weight``, ...).

    Tensors are consumed (popped) as layers are built, so peak memory stays near one copy.
    """
    device = torch.device(device)
    cfg = ArchConfig.from_hf(hf_config)
    make = linear_factory(quant, dtype, device)

    def take(name: str, required: bool = True) -> torch.Tensor | None:
        """Pop a tensor, as stored (linear weights are cast or quantized by ``make``)."""
        t = state_dict.pop(name, None)
        if t is None and required:
            raise KeyError(f"checkpoint is missing tensor {name!r}")
        return t

    def norm(name: str) -> RMSNorm:
        return RMSNorm(take(name).to(device=device, dtype=dtype), cfg.rms_norm_eps)

    layers = []
    for i in tqdm(range(cfg.num_layers), desc=f"building layers ({quant.describe()})", disable=not progress):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        qkv_w = torch.cat([take(a + f"{n}_proj.weight") for n in "qkv"], 0)
        qkv_b = _cat(take(a + f"{n}_proj.bias", required=False) for n in "qkv")
        attn = Attention(cfg, make(qkv_w, qkv_b, "qkv"), make(take(a + "o_proj.weight"), take(a + "o_proj.bias", False), "o"), i)
        m = p + "mlp."
        gu_w = torch.cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")], 0)
        gu_b = _cat([take(m + "gate_proj.bias", False), take(m + "up_proj.bias", False)])
        mlp = MLP(make(gu_w, gu_b, "gate_up"), make(take(m + "down_proj.weight"), take(m + "down_proj.bias", False), "down"))
        layers.append(DecoderLayer(attn, mlp, norm(p + "input_layernorm.weight"), norm(p + "post_attention_layernorm.weight")))

    embed_w = take("model.embed_tokens.weight").to(device=device, dtype=dtype)
    embed = nn.Embedding.from_pretrained(embed_w, freeze=True)
    head_w = take("lm_head.weight", required=not cfg.tie_word_embeddings)
    lm_head = make(embed_w if head_w is None else head_w, None, "lm_head")
    final_norm = norm("model.norm.weight")
    inv_freq, scaling = rope_inv_freq(hf_config)
    rope = Rotary(inv_freq, scaling, max_seq_len).to(device)
    leftover = [k for k in state_dict if not k.endswith("rotary_emb.inv_freq")]
    if leftover:
        raise KeyError(f"checkpoint has tensors the model does not use: {leftover[:5]}")
    model = CausalLM(cfg, embed, layers, final_norm, lm_head, rope).eval()
    if device.type == "cuda":
        quantized = [m for m in model.modules() if isinstance(m, WeightOnlyLinear)]
        for mod in tqdm(quantized, desc="packing for the GPU kernels (tuning new shapes)", disable=not progress):
            mod.prepare_gpu(dtype)
    return model
