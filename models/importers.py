"""Import of pre-quantized Hugging Face checkpoints (GPTQ, AWQ GEMM) into the logical format.

GPTQ (AutoGPTQ / GPTQModel layout), per linear layer ``name``:
  ``name.qweight`` int32 ``[K / (32/bits), N]``: 32/bits codes along K per word, lowest bits first;
  ``name.qzeros``  int32 ``[groups, N / (32/bits)]``: zero points packed along N, stored minus 1
                   in the original ("gptq", v1) format, as is in "gptq_v2";
  ``name.scales``  fp16 ``[groups, N]``;  ``name.g_idx`` int32 ``[K]``: the group of each input
                   column (not contiguous with act-order / ``desc_act``);  ``name.bias``.
AWQ GEMM (AutoAWQ layout), 4-bit:
  ``name.qweight`` int32 ``[K, N / 8]``: 8 codes along N per word, in the order 0,2,4,6,1,3,5,7;
  ``name.qzeros``  int32 ``[groups, N / 8]`` (same packing, no offset);  ``name.scales`` fp16 ``[groups, N]``.
Both dequantize as ``W[n, k] = (q - z) * s`` per group. An act-order GPTQ weight becomes a
contiguous-group weight over permuted input columns plus the permutation (``in_perm``)
that the layer applies to its input, so that ``x[:, perm] @ Wq^T == x @ W^T``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..kernels.format import QuantizedWeight, midpoint, pack_codes

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # word nibble i holds column 8c + AWQ_ORDER[i]


class CheckpointError(ValueError):
    pass


@dataclass
class ImportedLinear:
    weight: QuantizedWeight
    in_perm: torch.Tensor | None = None  # input columns to gather before the matmul


def quantization_config(directory: Path, hf_config) -> dict | None:
    """The checkpoint's quantization settings (config.json or AutoGPTQ's quantize_config.json)."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict()
    legacy = directory / "quantize_config.json"
    if qc is None and legacy.exists():
        qc = json.loads(legacy.read_text())
        qc.setdefault("quant_method", "gptq")
    return qc


def _unpack_along_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[R, C]`` with 32/bits codes per word along R -> uint8 ``[R * 32/bits, C]``."""
    per = 32 // bits
    mask = (1 << bits) - 1
    parts = [(words >> (bits * j)) & mask for j in range(per)]  # arithmetic shift: low bits are right
    return torch.stack(parts, 1).reshape(words.shape[0] * per, words.shape[1]).to(torch.uint8)


def _unpack_along_cols(words: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 ``[R, C]`` with 32/bits codes per word along C -> uint8 ``[R, C * 32/bits]``."""
    per = 32 // bits
    mask = (1 << bits) - 1
    out = torch.empty(words.shape[0], words.shape[1] * per, dtype=torch.uint8)
    for i in range(per):
        col = order[i] if order else i
        out[:, col::per] = ((words >> (bits * i)) & mask).to(torch.uint8)
    return out


def _take(state: dict, name: str) -> torch.Tensor:
    t = state.pop(name, None)
    if t is None:
        raise CheckpointError(f"quantized checkpoint is missing tensor {name!r}")
    return t


def _build(codes_kn: torch.Tensor, zeros_gn: torch.Tensor, scales_gn: torch.Tensor, bits: int, group: int,
           sym: bool, name: str) -> QuantizedWeight:
    K, N = codes_kn.shape
    if scales_gn.shape[1] != N or zeros_gn.shape != scales_gn.shape:
        raise CheckpointError(f"{name}: scales {tuple(scales_gn.shape)} / zeros {tuple(zeros_gn.shape)} do not match "
                              f"{N} output features")
    zeros = zeros_gn.T.contiguous()
    if sym and bool((zeros == midpoint(bits)).all()):
        zeros = None
    try:
        return QuantizedWeight(pack_codes(codes_kn.T.contiguous(), bits), scales_gn.T.contiguous().to(torch.float16),
                               zeros, bits, group, K, N)
    except ValueError as e:
        raise CheckpointError(f"{name}: {e}") from e


def import_gptq(state: dict, qc: dict, in_features: dict[str, int]) -> dict[str, ImportedLinear]:
    bits = int(qc.get("bits", 4))
    if bits not in (4, 8):
        raise CheckpointError(f"GPTQ checkpoints with {bits} bits are not supported (4 or 8)")
    v1 = qc.get("checkpoint_format", "gptq") == "gptq"
    sym = bool(qc.get("sym", True))
    out: dict[str, ImportedLinear] = {}
    for key in [k for k in state if k.endswith(".qweight")]:
        name = key[: -len(".qweight")]
        K = in_features.get(name)
        qweight, qzeros, scales = _take(state, key), _take(state, name + ".qzeros"), _take(state, name + ".scales")
        g_idx = state.pop(name + ".g_idx", None)
        codes = _unpack_along_rows(qweight, bits)  # [K, N]
        if K is not None and codes.shape[0] != K:
            raise CheckpointError(f"{key}: holds {codes.shape[0]} input features, the model expects {K}")
        K = codes.shape[0]
        group = int(qc.get("group_size", -1))
        group = K if group in (-1, 0) else group
        zeros = _unpack_along_cols(qzeros, bits)[:, : codes.shape[1]].to(torch.int16) + (1 if v1 else 0)
        if int(zeros.max()) >= (1 << bits) or int(zeros.min()) < 0:
            raise CheckpointError(f"{name}.qzeros: zero points out of range for {bits} bits (wrong checkpoint_format?)")
        perm = None
        if g_idx is not None:
            g_idx = g_idx.long()
            contiguous = torch.arange(K) // group
            if not torch.equal(g_idx, contiguous):  # act-order: regroup the columns
                perm = torch.argsort(g_idx, stable=True)
                if not torch.equal(g_idx[perm], contiguous):
                    raise CheckpointError(f"{name}.g_idx: groups are not of size {group}")
                codes = codes[perm]
        out[name] = ImportedLinear(_build(codes, zeros.to(torch.uint8), scales, bits, group, sym, name), perm)
    return out


def import_awq(state: dict, qc: dict, in_features: dict[str, int]) -> dict[str, ImportedLinear]:
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits != 4 or qc.get("version", "gemm").lower() != "gemm":
        raise CheckpointError("only 4-bit AWQ checkpoints in the GEMM layout are supported")
    out: dict[str, ImportedLinear] = {}
    for key in [k for k in state if k.endswith(".qweight")]:
        name = key[: -len(".qweight")]
        qweight, qzeros, scales = _take(state, key), _take(state, name + ".qzeros"), _take(state, name + ".scales")
        codes = _unpack_along_cols(qweight, bits, AWQ_ORDER)  # [K, N]
        K = codes.shape[0]
        if in_features.get(name, K) != K:
            raise CheckpointError(f"{key}: holds {K} input features, the model expects {in_features[name]}")
        group = int(qc.get("group_size", qc.get("q_group_size", 128)))
        group = K if group in (-1, 0) else group
        zeros = _unpack_along_cols(qzeros, bits, AWQ_ORDER)
        out[name] = ImportedLinear(_build(codes, zeros, scales, bits, group, False, name))
    return out


def import_quantized(state: dict, qc: dict, hf_config) -> dict[str, ImportedLinear]:
    """Dispatch on ``quant_method``; consumes the quantized tensors from ``state``."""
    from .config import ArchConfig

    cfg = ArchConfig.from_hf(hf_config)
    in_features = {}
    for i in range(cfg.num_layers):
        for n in ("q_proj", "k_proj", "v_proj"):
            in_features[f"model.layers.{i}.self_attn.{n}"] = cfg.hidden_size
        in_features[f"model.layers.{i}.self_attn.o_proj"] = cfg.num_heads * cfg.head_dim
        for n in ("gate_proj", "up_proj"):
            in_features[f"model.layers.{i}.mlp.{n}"] = cfg.hidden_size
        in_features[f"model.layers.{i}.mlp.down_proj"] = cfg.intermediate_size
    method = (qc.get("quant_method") or "").lower()
    if method == "gptq":
        return import_gptq(state, qc, in_features)
    if method == "awq":
        return import_awq(state, qc, in_features)
    raise CheckpointError(f"quantization method {method!r} is not supported (gptq, awq)")
