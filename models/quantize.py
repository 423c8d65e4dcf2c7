"""Offline quantization of a whole model: round-to-nearest, or GPTQ with calibration text.

GPTQ runs layer by layer on calibration windows (random 512-token windows of a text,
wikitext-2 ``valid.txt`` by default): the inputs of every linear layer of decoder layer i
are recorded as Hessians H = Σ x xᵀ while the layer runs on the outputs of the already
quantized layers 0..i-1; its four fused linears (qkv, o, gate_up, down) are quantized with
GPTQ; the quantized layer then produces the inputs of layer i+1. Runs on the GPU when
present (a few minutes for 8B) and on the CPU for small models.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..kernels.format import QuantSpec
from ..kernels.gptq import gptq_quantize
from .batches import Causal
from .builder import build_model
from .llama import CausalLM
from .progress import progress as progress_of
from .quant_config import QuantConfig
from .quant_linear import DenseLinear, WeightOnlyLinear

DEFAULT_CALIBRATION = Path(__file__).resolve().parent / "data" / "wikitext-2" / "valid.txt"  # (shipped, as DEFAULT_TEXT)


def calibration_windows(tokenizer, text: str, samples: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """``[samples, seq_len]`` token windows at random offsets of the tokenized text."""
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    if ids.numel() <= seq_len:
        raise ValueError(f"calibration text has {ids.numel()} tokens, fewer than one window of {seq_len}")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq_len, (samples,), generator=g)
    return torch.stack([ids[s : s + seq_len] for s in starts.tolist()])


class _HessianHook:
    """Accumulates H = Σ x xᵀ (fp32) over every token fed to a linear layer."""

    def __init__(self, k: int, device):
        self.H = torch.zeros(k, k, dtype=torch.float32, device=device)
        self.tokens = 0

    def __call__(self, module, args):
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        self.H.addmm_(x.T, x)
        self.tokens += x.shape[0]


@torch.inference_mode()
def gptq_model(model: CausalLM, windows: torch.Tensor, spec: QuantSpec, act_order: bool = False,
               batch_size: int = 8, progress: bool = True) -> CausalLM:
    """Quantize every decoder linear of an unquantized ``model`` in place with GPTQ."""
    device = model.device
    T = windows.shape[1]
    positions = torch.arange(T, device=device).expand(batch_size, T)
    hidden = [model.embed(w.to(device)) for w in windows.split(batch_size)]

    def run_layer(layer, xs):
        return [model.layer_output(layer, x, Causal(positions[: x.shape[0]])) for x in xs]

    for layer in progress_of(model.layers, "GPTQ layers", progress):
        linears = {"qkv": layer.attn, "o": layer.attn, "gate_up": layer.mlp, "down": layer.mlp}
        hooks = {}
        handles = []
        for kind, parent in linears.items():
            mod = getattr(parent, kind)
            assert isinstance(mod, DenseLinear)
            hooks[kind] = _HessianHook(mod.in_features, device)
            handles.append(mod.register_forward_pre_hook(hooks[kind]))
        run_layer(layer, hidden)
        for h in handles:
            h.remove()
        for kind, parent in linears.items():
            dense = getattr(parent, kind)
            H = hooks[kind].H * (2.0 / max(hooks[kind].tokens, 1))
            qw = gptq_quantize(dense.weight.float(), H, spec, act_order=act_order)
            bias = None if dense.bias is None else dense.bias.data
            setattr(parent, kind, WeightOnlyLinear(qw, bias, kind, cache_dequantized=True))
        hidden = run_layer(layer, hidden)  # inputs of the next layer, through the quantized one
    return model


def quantize_model(hf_config, state: dict, tokenizer, quant: QuantConfig, method: str = "rtn", act_order: bool = False,
                   calibration: Path | None = None, samples: int = 128, seq_len: int = 512,
                   device: str | torch.device = "cpu", progress: bool = True) -> CausalLM:
    """A quantized ``CausalLM`` (fp32 on ``device``) ready for ``checkpoint.save_checkpoint``."""
    spec = quant.spec()
    if spec is None:
        raise ValueError("quantize needs --bits 4 or 8")
    if method == "rtn":
        return build_model(hf_config, state, quant, torch.float32, device, seq_len, progress=progress)
    if method != "gptq":
        raise ValueError(f"unknown method {method!r} (rtn, gptq)")
    spec = QuantSpec(spec.bits, spec.group_size, spec.symmetric, torch.float16)
    dense = QuantConfig("none")
    model = build_model(hf_config, state, dense, torch.float32, device, seq_len, progress=progress)
    text = Path(calibration or DEFAULT_CALIBRATION).read_text()
    windows = calibration_windows(tokenizer, text, samples, seq_len)
    model = gptq_model(model, windows, spec, act_order=act_order, progress=progress)
    if quant.quantize_lm_head:  # GPTQ covers the decoder; the head gets round-to-nearest
        head = model.lm_head
        model.lm_head = WeightOnlyLinear.from_float(head.weight.float(), head.bias, spec, "lm_head")
    return model
