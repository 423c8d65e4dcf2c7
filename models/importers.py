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
that the layer applies to its input, so that ``x[:, perm] @ Wq^T == x @ W^T``. A layer is
read when the builder takes it (``StoredImport``): whole, or only a tensor-parallel rank's
share.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..kernels.format import QuantizedWeight, midpoint, pack_codes
from .imported import CheckpointError, ImportedLinear
from .lazy_tensors import LazyTensors
from .sharding import row_shard, whole_groups

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # word nibble i holds column 8c + AWQ_ORDER[i]


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


class StoredImport:
    """A GPTQ or AWQ linear of a checkpoint, checked against the file's header but not
    read yet: ``read`` takes it whole, ``read_rows`` / ``read_columns`` only a
    tensor-parallel rank's share of it (the rest stays on disk), as
    ``checkpoint.StoredLinear`` does for woq checkpoints. GPTQ packs codes along K (a share
    of output rows is a column slice of ``qweight``, of input columns a row slice), AWQ
    along N (the other way round); zero points are packed along N in both, so a share of
    rows reads the words that hold its columns and unpacks them."""

    def __init__(self, tensors: LazyTensors, name: str, qc: dict, in_features: int | None):
        self._t, self.name = tensors, name
        self.method = (qc.get("quant_method") or "").lower()
        if self.method == "gptq":
            self.bits = int(qc.get("bits", 4))
            if self.bits not in (4, 8):
                raise CheckpointError(f"GPTQ checkpoints with {self.bits} bits are not supported (4 or 8)")
            self.v1 = qc.get("checkpoint_format", "gptq") == "gptq"
            self.symmetric = bool(qc.get("sym", True))  # (as declared; all-midpoint zeros are then dropped)
            group = int(qc.get("group_size", -1))
        else:
            self.bits = int(qc.get("bits", qc.get("w_bit", 4)))
            if self.bits != 4 or qc.get("version", "gemm").lower() != "gemm":
                raise CheckpointError("only 4-bit AWQ checkpoints in the GEMM layout are supported")
            self.v1, self.symmetric = False, False
            group = int(qc.get("group_size", qc.get("q_group_size", 128)))
        self.per = 32 // self.bits  # codes a word
        for suffix in ("qweight", "qzeros", "scales"):
            if f"{name}.{suffix}" not in tensors:
                raise CheckpointError(f"quantized checkpoint is missing tensor {name + '.' + suffix!r}")
        rows, cols = tensors.shape(f"{name}.qweight")
        K, N = (rows * self.per, cols) if self.method == "gptq" else (rows, cols * self.per)
        if in_features is not None and K != in_features:
            raise CheckpointError(f"{name}.qweight: holds {K} input features, the model expects {in_features}")
        self.in_features, self.out_features = K, N
        self.group_size = G = K if group in (-1, 0) else group
        groups = -(-K // G)
        for suffix, shape in (("scales", [groups, N]), ("qzeros", [groups, -(-N // self.per)])):
            got = tensors.shape(f"{name}.{suffix}")
            if got != shape:
                raise CheckpointError(f"{name}.{suffix} is {got}: a {N} x {K} weight in groups of {G} needs {shape}")
        self.perm = self._order(tensors.pop(f"{name}.g_idx").long()) if f"{name}.g_idx" in tensors else None

    def _order(self, g_idx: torch.Tensor) -> torch.Tensor | None:
        """None where GPTQ's ``g_idx`` holds contiguous groups; else (act-order) the input
        order that makes them contiguous."""
        contiguous = torch.arange(self.in_features) // self.group_size
        if torch.equal(g_idx, contiguous):
            return None
        perm = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[perm], contiguous):
            raise CheckpointError(f"{self.name}.g_idx: groups are not of size {self.group_size}")
        return perm

    def _unpack_n(self, words: torch.Tensor) -> torch.Tensor:
        """int32 words packed along N -> uint8 codes (AWQ's nibble order for AWQ)."""
        return _unpack_along_cols(words, self.bits, AWQ_ORDER if self.method == "awq" else None)

    def _zeros(self, zeros: torch.Tensor) -> torch.Tensor:
        zeros = zeros.to(torch.int16) + (1 if self.v1 else 0)  # (GPTQ v1 stores zero points minus one)
        if int(zeros.max()) >= (1 << self.bits) or int(zeros.min()) < 0:
            raise CheckpointError(f"{self.name}.qzeros: zero points out of range for {self.bits} bits "
                                  f"(wrong checkpoint_format?)")
        return zeros.to(torch.uint8)

    def _linear(self, codes_kn, zeros_gn, scales_gn, group: int, perm: torch.Tensor | None) -> ImportedLinear:
        if perm is not None:
            codes_kn = codes_kn[perm]
        return ImportedLinear(_build(codes_kn, self._zeros(zeros_gn), scales_gn, self.bits, group, self.symmetric,
                                     self.name), perm)

    def _take(self, suffix: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        return self._t.pop_rows(f"{self.name}.{suffix}", rows, cols)

    def read(self) -> ImportedLinear:
        """The whole layer."""
        return self.read_rows(None)

    def read_rows(self, index: torch.Tensor | None) -> ImportedLinear:
        """Output rows ``index`` (increasing; None: all) of the layer: a column-parallel
        rank's share, read from the columns (GPTQ's codes, the scales) and the packed words
        (GPTQ's zero points, AWQ's codes and zero points) that span them."""
        N, per = self.out_features, self.per
        index = torch.arange(N) if index is None else index
        lo, hi = int(index[0]), int(index[-1]) + 1
        w0, w1 = lo // per, -(-hi // per)  # the words holding columns [lo, hi) where packed along N
        run = len(index) == hi - lo  # (one run of columns: sliced, not gathered)

        def pick(base: int):  # index's columns in a read that starts at column ``base``
            return slice(lo - base, hi - base) if run else index - base

        if self.method == "gptq":
            codes = _unpack_along_rows(self._take("qweight", None, slice(lo, hi)), self.bits)[:, pick(lo)]
        else:
            codes = self._unpack_n(self._take("qweight", None, slice(w0, w1)))[:, pick(w0 * per)]
        zeros = self._unpack_n(self._take("qzeros", None, slice(w0, w1)))[:, pick(w0 * per)]
        scales = self._take("scales", None, slice(lo, hi))[:, pick(lo)]
        return self._linear(codes, zeros, scales, self.group_size, self.perm)

    def read_columns(self, own: range) -> ImportedLinear | None:
        """Input columns ``own`` of the layer (a row-parallel rank's share; ``row_shard``'s
        result, from whole groups read), or None where it must be read whole: an act-order
        weight (its groups hold permuted columns), a GPTQ share whose edges cut a word."""
        K, G, per = self.in_features, self.group_size, self.per
        if self.perm is not None:
            return None
        lo, hi = (own.start, own.stop) if G >= K else whole_groups(own, G, K)
        if self.method == "gptq" and (lo % per or hi % per):
            return None
        groups = slice(0, 1) if G >= K else slice(lo // G, -(-hi // G))
        rows = slice(lo // per, hi // per) if self.method == "gptq" else slice(lo, hi)
        packed = self._take("qweight", rows)
        codes = _unpack_along_rows(packed, self.bits) if self.method == "gptq" else self._unpack_n(packed)
        zeros = self._unpack_n(self._take("qzeros", groups))[:, : self.out_features]
        group = hi - lo if G >= K else G
        whole = self._linear(codes, zeros, self._take("scales", groups), group, None)
        if G >= K or (lo, hi) == (own.start, own.stop):
            return whole
        return row_shard(whole, range(own.start - lo, own.stop - lo))


def import_quantized(state: LazyTensors, qc: dict, hf_config) -> dict[str, StoredImport]:
    """The checkpoint's quantized linears by name (``quant_method`` gptq or awq), checked
    against the header, read when the builder takes them (only a rank's share where it can)."""
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
    if method not in ("gptq", "awq"):
        raise CheckpointError(f"quantization method {method!r} is not supported (gptq, awq)")
    names = [k[: -len(".qweight")] for k in state if k.endswith(".qweight")]
    return {name: StoredImport(state, name, qc, in_features.get(name)) for name in names}
