"""Architecture description of a Llama-family model, read from a Hugging Face config."""
from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# RoPE types whose frequencies do not depend on the sequence length: the cos/sin table
# can be built once. "dynamic" (NTK re-scaling as the sequence grows) and "longrope"
# (two frequency sets) are not supported.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class ArchConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_type: str
    sliding_window: int | None

    @classmethod
    def from_hf(cls, config) -> "ArchConfig":
        mt = getattr(config, "model_type", None)
        if mt not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(f"model_type {mt!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {config.hidden_act!r} is not supported (SwiGLU with silu only)")
        rope_type = rope_parameters(config).get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported (supported: {', '.join(STATIC_ROPE_TYPES)})")
        heads = config.num_attention_heads
        sliding = getattr(config, "sliding_window", None)
        if mt == "qwen2" and not getattr(config, "use_sliding_window", False):
            sliding = None
        return cls(
            model_type=mt,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            rope_type=rope_type,
            sliding_window=sliding,
        )

    @property
    def context_limit(self) -> int:
        """Longest sequence we run: the sliding window, when the model has one, bounds it,
        so that full causal attention is exactly what the model computes."""
        limit = self.max_position_embeddings
        return min(limit, self.sliding_window) if self.sliding_window else limit


def rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None)
    if params is None:  # older configs
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
        params.setdefault("rope_type", params.get("type", "default"))
    return params


def rope_inv_freq(config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the config's RoPE type.

    Computed by transformers' own RoPE initialisers (they cover linear, llama3 and yarn
    scaling), so our cos/sin tables are the reference's, bit for bit.
    """
    params = rope_parameters(config)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(scaling)
