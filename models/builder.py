"""Build our ``CausalLM`` from a Hugging Face state dict, quantizing linear layers on load."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

import torch
from torch import nn

from ..kernels.options import RuntimeOptions
from .config import ArchConfig, rope_inv_freq
from .llama import MLP, Attention, CausalLM, DecoderLayer, RMSNorm, Rotary
from .progress import progress as progress_of
from .quant_config import QuantConfig
from .quant_linear import DenseLinear, WeightOnlyLinear

if TYPE_CHECKING:
    from .imported import ImportedLinear
    from .sharding import TensorParallel

LinearFactory = Callable[[torch.Tensor, "torch.Tensor | None", str], nn.Module]


def stays_dense(quant: QuantConfig, kind: str) -> bool:
    """Whether ``quant`` leaves a layer of ``kind`` in floating point."""
    return quant.spec() is None or (kind == "lm_head" and not quant.quantize_lm_head)


def linear_factory(quant: QuantConfig, dtype: torch.dtype, device: torch.device) -> LinearFactory:
    """A function making the linear layer for (weight, bias, layer kind), quantized or not."""
    spec = quant.spec()
    cache = device.type == "cpu"

    def make(weight: torch.Tensor, bias: torch.Tensor | None, kind: str) -> nn.Module:
        bias = None if bias is None else bias.to(device=device, dtype=dtype)
        if stays_dense(quant, kind):
            return DenseLinear(weight.to(device=device, dtype=dtype), bias, kind)
        # Quantize the checkpoint's own values (in fp32, on the target device: fast on a
        # GPU), so that CPU and GPU runs hold the same codes; the dense copy is dropped.
        return WeightOnlyLinear.from_float(weight.to(device=device, dtype=torch.float32), bias, spec, kind,
                                           cache_dequantized=cache)

    return make


def _cat(tensors: Iterable[torch.Tensor | None]) -> torch.Tensor | None:
    ts = list(tensors)
    return None if any(t is None for t in ts) else torch.cat(ts, 0)


def _fuse_imported(parts: list["ImportedLinear"], name: str) -> "ImportedLinear":
    """One fused pre-quantized linear from its parts (same input, so same permutation)."""
    from ..kernels.format import concat_rows
    from .imported import CheckpointError, ImportedLinear

    if len(parts) == 1:
        return parts[0]
    perms = [p.in_perm for p in parts]
    if any(p is not None for p in perms) and not all(p is not None and torch.equal(p, perms[0]) for p in perms):
        raise CheckpointError(f"{name}: the fused parts were quantized with different input orders (g_idx)")
    try:
        return ImportedLinear(concat_rows([p.weight for p in parts]), perms[0])
    except ValueError as e:
        raise CheckpointError(f"{name}: {e}") from e


def build_model(
    hf_config,
    state_dict: dict[str, torch.Tensor],
    quant: QuantConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    max_seq_len: int,
    progress: bool = True,
    prequantized: dict | None = None,
    options: RuntimeOptions | None = None,
    tp: "TensorParallel | None" = None,
) -> CausalLM:
    """Assemble the model from HF-named tensors (``model.layers.{i}.self_attn.q_proj.weight``, ...).

    ``prequantized`` maps linear names to already quantized weights, not read yet: fused
    ones (``...self_attn.qkv_proj``: a woq checkpoint's ``StoredLinear``) or parts
    (``...q_proj``: a GPTQ/AWQ import's ``StoredImport``); those layers are used as they
    are, ``quant`` applies to the rest.
    Tensors are consumed (popped) as layers are built, so peak memory stays near one copy.
    Each linear layer's kernels are chosen once, at the end (``bind_kernels``). With ``tp``,
    the model is that rank's shard (``models/sharding.py``): a rank reads only its share of
    a layer where it can be read alone, else the whole layer, then splits it; the model's
    config holds the rank's shapes.
    """
    from .imported import CheckpointError, ImportedLinear
    from .sharding import row_shard, whole_groups

    prequantized = dict(prequantized or {})
    device = torch.device(device)
    cfg = ArchConfig.from_hf(hf_config)
    make = linear_factory(quant, dtype, device)

    def take(name: str, required: bool = True) -> torch.Tensor | None:
        """Pop a tensor, as stored (linear weights are cast or quantized by ``make``)."""
        t = state_dict.pop(name, None)
        if t is None and required:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}")
        return t

    def norm(name: str) -> RMSNorm:
        return RMSNorm(take(name).to(device=device, dtype=dtype), cfg.rms_norm_eps)

    H, D = cfg.hidden_size, cfg.head_dim
    shapes = {"qkv": ((cfg.num_heads + 2 * cfg.num_kv_heads) * D, H), "o": (H, cfg.num_heads * D),
              "gate_up": (2 * cfg.intermediate_size, H), "down": (H, cfg.intermediate_size),
              "lm_head": (cfg.vocab_size, H)}

    def read_share(parts: list[str], kind: str) -> tuple[torch.Tensor, range | None] | None:
        """This rank's share of the dense weight made of ``parts``, ``(weight, cut)``, reading
        only that share from the checkpoint's files (``LazyTensors.pop_rows``). ``cut`` is
        None, or, where the rank's input columns of a quantized row-parallel layer cut a
        group, the weight holds them widened to whole groups (quantized as the whole layer's
        groups are) and ``cut`` is the rank's columns among them. None where the whole
        weight must be read: no files to slice, another shape than the config's (the whole
        read names the error), or a per-channel row-parallel layer (a row's one scale spans
        every column)."""
        if tp is None or not hasattr(state_dict, "pop_rows") or any(p not in state_dict for p in parts):
            return None
        part_shapes = [state_dict.shape(p) for p in parts]
        if any(len(sh) != 2 for sh in part_shapes) or \
                (sum(sh[0] for sh in part_shapes), part_shapes[0][1]) != shapes[kind]:
            return None
        index = tp.output_rows(kind, cfg)
        if index is not None:  # (increasing: each part's rows in order, parts in order)
            pieces, first = [], 0
            for name, (n, _) in zip(parts, part_shapes):
                mine = index[(index >= first) & (index < first + n)] - first
                first += n
                lo, hi = (int(mine.min()), int(mine.max()) + 1) if len(mine) else (0, 0)
                pieces.append(state_dict.pop_rows(name, slice(lo, hi))[mine - lo])
            return torch.cat(pieces, 0), None
        if kind not in ("o", "down") or len(parts) != 1:
            return None
        own = tp.input_columns(kind, cfg)
        spec = None if stays_dense(quant, kind) else quant.spec()
        if spec is None:
            return state_dict.pop_rows(parts[0], None, slice(own.start, own.stop)), None
        K, G = shapes[kind][1], spec.group_size
        if G is None or G >= K:
            return None
        lo, hi = whole_groups(own, G, K)
        w = state_dict.pop_rows(parts[0], None, slice(lo, hi))
        return w, None if (lo, hi) == (own.start, own.stop) else range(own.start - lo, own.stop - lo)

    def quantized(qw, perm: torch.Tensor | None, bias: torch.Tensor | None, kind: str) -> WeightOnlyLinear:
        """The layer of kind ``kind`` of quantized weight ``qw`` (input order ``perm``), on the device."""
        perm = None if perm is None else perm.to(device)
        return WeightOnlyLinear(qw.to(device), None if bias is None else bias.to(device=device, dtype=dtype),
                                kind, cache_dequantized=device.type == "cpu", in_perm=perm)

    def read_stored(parts: list, fused: str, kind: str) -> tuple[ImportedLinear, bool]:
        """The quantized layer ``fused`` made of ``parts`` (not read yet: a woq checkpoint's
        fused ``StoredLinear``, or a GPTQ/AWQ import's ``StoredImport`` parts), read: this
        rank's share of each part where it can be read alone (then True), else whole."""
        shape = (sum(p.out_features for p in parts), parts[0].in_features)
        if shape != shapes[kind]:
            raise CheckpointError(f"{fused}: quantized weight is {shape[0]}x{shape[1]}, the model config "
                                  f"needs {shapes[kind][0]}x{shapes[kind][1]}")
        if tp is not None:
            index = tp.output_rows(kind, cfg)
            if index is not None:  # (the fused layer's rows: each part's in order, parts in order)
                shares, first = [], 0
                for part in parts:
                    shares.append(index[(index >= first) & (index < first + part.out_features)] - first)
                    first += part.out_features
                if all(len(mine) for mine in shares):
                    return _fuse_imported([p.read_rows(m) for p, m in zip(parts, shares)], fused), True
            elif kind in ("o", "down") and len(parts) == 1:
                share = parts[0].read_columns(tp.input_columns(kind, cfg))
                if share is not None:
                    return share, True
        return _fuse_imported([p.read() for p in parts], fused), False

    def linear(fused: str, parts: list[str], kind: str) -> nn.Module:
        """The layer ``fused`` (made of HF linears ``parts``), from whichever source has it."""
        imported, shared = None, False
        # (a woq checkpoint's fused layer, or a GPTQ/AWQ import's parts: o's and down's one
        # part is the layer itself)
        if fused in prequantized or all(p in prequantized for p in parts):
            stored = [prequantized.pop(fused)] if fused in prequantized else [prequantized.pop(p) for p in parts]
            imported, shared = read_stored(stored, fused, kind)
        bias = take(fused + ".bias", required=False)
        if bias is None:
            bias = _cat(take(p + ".bias", required=False) for p in parts)
        if imported is None:
            share = read_share([p + ".weight" for p in parts], kind)
            if share is not None:  # (this rank's share already: quantized as a whole layer's rows would be)
                w, cut = share
                layer = make(w, tp.shard_bias(kind, cfg, bias), kind)
                if cut is None:
                    return layer
                shard = row_shard(ImportedLinear(layer.qweight), cut)  # (whole groups read: the rank's columns)
                return quantized(shard.weight, shard.in_perm, None if layer.bias is None else layer.bias.data, kind)
            w = torch.cat([take(p + ".weight") for p in parts], 0)
            if tuple(w.shape) != shapes[kind]:
                raise CheckpointError(f"{fused}: weight is {tuple(w.shape)}, the model config needs {shapes[kind]}")
            dense = stays_dense(quant, kind)
            if tp is not None and dense:  # (split the floats; a quantized layer is split below)
                w, _, bias = tp.shard(kind, cfg, w, None, bias)
            layer = make(w, bias, kind)
            if tp is None or dense:
                return layer
            imported = ImportedLinear(layer.qweight, None)
            bias = None if layer.bias is None else layer.bias.data
        qw, perm = imported.weight, imported.in_perm
        if shared:  # (the rank's share already)
            bias = tp.shard_bias(kind, cfg, bias)
        elif tp is not None:
            qw, perm, bias = tp.shard(kind, cfg, qw, perm, bias)
        return quantized(qw, perm, bias, kind)

    layers = []
    for i in progress_of(range(cfg.num_layers), f"building layers ({quant.describe()})", progress):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        attn = Attention(linear(a + "qkv_proj", [a + f"{n}_proj" for n in "qkv"], "qkv"),
                         linear(a + "o_proj", [a + "o_proj"], "o"), i)
        mlp = MLP(linear(m + "gate_up_proj", [m + "gate_proj", m + "up_proj"], "gate_up"),
                  linear(m + "down_proj", [m + "down_proj"], "down"))
        layers.append(DecoderLayer(attn, mlp, norm(p + "input_layernorm.weight"), norm(p + "post_attention_layernorm.weight")))

    vocab_share = tp.vocab_rows(cfg.vocab_size) if tp is not None else None
    name = "model.embed_tokens.weight"
    if vocab_share is not None and hasattr(state_dict, "pop_rows") and name in state_dict:
        embed_w = state_dict.pop_rows(name, slice(vocab_share.start, vocab_share.stop))
    else:
        embed_w = take(name)
        if vocab_share is not None:  # (the rank's rows; a tied LM head is made of them too)
            embed_w = embed_w[vocab_share.start:vocab_share.stop].clone()
    embed_w = embed_w.to(device=device, dtype=dtype)
    embed = nn.Embedding.from_pretrained(embed_w, freeze=True)
    if "lm_head" in prequantized or "lm_head.weight" in state_dict or not cfg.tie_word_embeddings:
        lm_head = linear("lm_head", ["lm_head"], "lm_head")
    else:
        lm_head = make(embed_w, None, "lm_head")
    final_norm = norm("model.norm.weight")
    inv_freq, scaling = rope_inv_freq(hf_config)
    rope = Rotary(inv_freq, scaling, max_seq_len).to(device)
    leftover = [k for k in state_dict if not k.endswith("rotary_emb.inv_freq")] + list(prequantized)
    if leftover:
        raise CheckpointError(f"checkpoint has tensors the model does not use: {leftover[:5]}")
    model = CausalLM(cfg if tp is None else tp.local_config(cfg), embed, layers, final_norm, lm_head, rope).eval()
    model.tp, model.vocab_share = tp, vocab_share
    bind_kernels(model, options or RuntimeOptions(), progress)
    return model


def bind_kernels(model: CausalLM, options: RuntimeOptions, progress: bool = False) -> CausalLM:
    """Give every linear layer its kernel plan for where the model lies now (after a move to
    another device, bind again): on CUDA with the kernels loaded, quantized layers are
    repacked into the GPU layout and take their measured launches (new shapes are tuned
    once per GPU, cached)."""
    from ..kernels import build

    model.options = options
    gpu = model.device.type == "cuda" and build.load(options)
    dense = [m for m in model.modules() if isinstance(m, DenseLinear)]
    quantized = [m for m in model.modules() if isinstance(m, WeightOnlyLinear)]
    for mod in dense:
        mod.bind(options, gpu)
    desc = "packing for the GPU kernels (tuning new shapes)" if gpu else "binding the reference kernels"
    for mod in progress_of(quantized, desc, progress and gpu):
        mod.bind(model.dtype, options, gpu)
    model.observe_kernels(model.kernel_timing)  # (new plans, observed as the old ones were)
    return model
