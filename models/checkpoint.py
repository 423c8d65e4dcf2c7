"""The woq prepacked checkpoint: quantize once, load in seconds.

A directory with the model's ``config.json``, its tokenizer files and ``woq.safetensors``:

* unquantized tensors under their Hugging Face names (``model.embed_tokens.weight``,
  ``model.layers.{i}.input_layernorm.weight``, ``model.norm.weight``, ``lm_head.weight``);
* each quantized linear layer in the logical format of ``kernels/format.py``, fused as the
  model runs it: ``model.layers.{i}.self_attn.qkv_proj``, ``...self_attn.o_proj``,
  ``...mlp.gate_up_proj``, ``...mlp.down_proj`` (and ``lm_head`` if quantized), each as
  ``<name>.packed`` (uint8), ``<name>.scales``, ``<name>.zeros`` (asymmetric only),
  ``<name>.bias`` (if any), ``<name>.in_perm`` (act-order imports only);
* a metadata header entry ``woq`` (JSON): format version, GPU layout version, source
  model, quantizer, and for every quantized layer its bits, group size and shape.

The GPU layout is derived at load (``kernels/layout.py``: milliseconds per layer), so one
checkpoint serves every GPU and the CPU. Loading validates everything against the header
and the model config and names the offending tensor on any mismatch. A quantized layer is
read as the builder takes it (``StoredLinear``): whole, or a tensor-parallel rank's share
of its rows or columns, the rest left on disk.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..kernels.format import QuantizedWeight
from ..kernels.layout import LAYOUT_VERSION
from .imported import CheckpointError, ImportedLinear
from .lazy_tensors import LazyTensors
from .sharding import row_shard, whole_groups
from .llama import CausalLM
from .quant_linear import WeightOnlyLinear

FORMAT_VERSION = 1
WEIGHTS = "woq.safetensors"

# our module path -> Hugging Face style name in the checkpoint
_LINEAR_NAMES = {"attn.qkv": "self_attn.qkv_proj", "attn.o": "self_attn.o_proj", "mlp.gate_up": "mlp.gate_up_proj",
                 "mlp.down": "mlp.down_proj"}
_NORM_NAMES = {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm"}


def is_woq_checkpoint(directory: Path) -> bool:
    return (directory / WEIGHTS).exists()


def _linear_items(model: CausalLM):
    for i, layer in enumerate(model.layers):
        for path, name in _LINEAR_NAMES.items():
            obj = layer
            for part in path.split("."):
                obj = getattr(obj, part)
            yield f"model.layers.{i}.{name}", obj
    yield "lm_head", model.lm_head


def save_checkpoint(model: CausalLM, hf_config, tokenizer, out: Path, source: str, quantizer: dict,
                    dtype: torch.dtype | None = None) -> Path:
    """Write ``model`` (already quantized) as a woq checkpoint directory; its unquantized
    floating-point tensors (embeddings, norms, biases, an unquantized LM head) in ``dtype``
    (default: as the model holds them). The quantized weights' scales keep their own dtype."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": model.embed.weight, "model.norm.weight": model.norm.weight}
    for i, layer in enumerate(model.layers):
        for attr, name in _NORM_NAMES.items():
            tensors[f"model.layers.{i}.{name}.weight"] = getattr(layer, attr).weight
    linears = {}
    for name, mod in _linear_items(model):
        if isinstance(mod, WeightOnlyLinear):
            qw = mod.qweight
            tensors[f"{name}.packed"], tensors[f"{name}.scales"] = qw.packed, qw.scales
            if qw.zeros is not None:
                tensors[f"{name}.zeros"] = qw.zeros
            if mod.in_perm is not None:
                tensors[f"{name}.in_perm"] = mod.in_perm
            linears[name] = {"bits": qw.bits, "group_size": qw.group_size, "in_features": qw.in_features,
                             "out_features": qw.out_features, "symmetric": qw.symmetric}
        elif name == "lm_head" and mod.weight.data_ptr() == model.embed.weight.data_ptr():
            continue  # tied to the embedding
        else:
            tensors[f"{name}.weight"] = mod.weight
        if mod.bias is not None:
            tensors[f"{name}.bias"] = mod.bias
    meta = {"format": "woq", "format_version": FORMAT_VERSION, "layout_version": LAYOUT_VERSION, "source_model": source,
            "quantizer": quantizer, "linears": linears}
    scales = {k for k in tensors if k.endswith(".scales")}
    tensors = {k: v.detach().to("cpu", dtype=dtype if dtype is not None and v.is_floating_point() and k not in scales
                                  else v.dtype).contiguous() for k, v in tensors.items()}
    save_file(tensors, out / WEIGHTS, metadata={"woq": json.dumps(meta)})
    hf_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # safetensors writes its file 0600 (a temporary file renamed); the weights get the mode the
    # config was written with (the umask's), so that whoever may read the config may load them
    os.chmod(out / WEIGHTS, (out / "config.json").stat().st_mode & 0o777)
    return out


def read_metadata(directory: Path) -> dict:
    """A woq checkpoint's metadata header (format, source model, quantizer, linears), without
    reading its tensors."""
    from safetensors import safe_open

    with safe_open(str(Path(directory) / WEIGHTS), framework="pt") as f:
        return json.loads((f.metadata() or {})["woq"])


def describe(meta: dict) -> str:
    """What a checkpoint holds, from its metadata: e.g. "int4 g128 asym, gptq"."""
    kinds: dict[tuple[int, bool], set[int]] = {}  # (bits, symmetric) -> group sizes smaller than K
    for m in meta["linears"].values():
        groups = kinds.setdefault((m["bits"], m["symmetric"]), set())
        if m["group_size"] < m["in_features"]:  # (a group as wide as K is a channel: any layer may be)
            groups.add(m["group_size"])
    text = ", ".join(f"int{b} {'/'.join(f'g{g}' for g in sorted(groups)) or 'channel'} {'sym' if sym else 'asym'}"
                     for (b, sym), groups in sorted(kinds.items())) or "unquantized"
    method = (meta.get("quantizer") or {}).get("method")
    return f"{text}, {method}" if method else text


class StoredLinear:
    """A quantized linear of a woq checkpoint whose tensors are checked against the header
    (their presence and shapes, from the file's header) but not read yet: ``read`` takes it
    whole, ``read_rows`` / ``read_columns`` only a tensor-parallel rank's share of it (the
    rest stays on disk), so that a rank's memory holds ~1/TP of the model."""

    def __init__(self, tensors: LazyTensors, name: str, info: dict, path: Path):
        self._tensors, self.name, self._path = tensors, name, path
        self.bits, self.group_size = info["bits"], info["group_size"]
        self.in_features, self.out_features = info["in_features"], info["out_features"]
        self.symmetric = info["symmetric"]
        needed = ["packed", "scales"] + ([] if self.symmetric else ["zeros"])
        for suffix in needed:
            if f"{name}.{suffix}" not in tensors:
                raise CheckpointError(f"{path}: missing tensor '{name}.{suffix}'")
        N, K = self.out_features, self.in_features
        groups = -(-K // self.group_size)
        expect = {"packed": [N, -(-K * self.bits // 8)], "scales": [N, groups], "zeros": [N, groups]}
        for suffix in needed:
            got = tensors.shape(f"{name}.{suffix}")
            if got != expect[suffix]:
                raise CheckpointError(f"{path}: tensor '{name}' does not match its header ({suffix} is {got}, "
                                      f"the header's shape needs {expect[suffix]})")
        self.act_order = f"{name}.in_perm" in tensors

    def _take(self, suffix: str, rows: slice | list[slice] | None = None,
              cols: slice | None = None) -> torch.Tensor | None:
        name = f"{self.name}.{suffix}"
        if name not in self._tensors:
            return None
        return self._tensors.pop_rows(name, rows, cols)

    def _weight(self, packed, scales, zeros, in_features: int, out_features: int, group_size: int) -> QuantizedWeight:
        try:
            return QuantizedWeight(packed, scales, zeros, self.bits, group_size, in_features, out_features)
        except ValueError as e:
            raise CheckpointError(f"{self._path}: tensor '{self.name}' does not match its header ({e})") from e

    def read(self) -> ImportedLinear:
        """The whole layer."""
        return ImportedLinear(self._weight(self._take("packed"), self._take("scales"), self._take("zeros"),
                                           self.in_features, self.out_features, self.group_size),
                              self._take("in_perm"))

    def read_rows(self, index: torch.Tensor) -> ImportedLinear:
        """Output rows ``index`` (increasing) of the layer: a column-parallel rank's share,
        read run by run (a fused qkv share is three runs: its q, k and v rows)."""
        cuts = (torch.nonzero(index.diff() != 1).flatten() + 1).tolist()
        runs = [slice(int(r[0]), int(r[-1]) + 1) for r in torch.tensor_split(index, cuts)]
        return ImportedLinear(self._weight(self._take("packed", runs), self._take("scales", runs),
                                           self._take("zeros", runs), self.in_features, len(index), self.group_size),
                              self._take("in_perm"))

    def read_columns(self, own: range) -> ImportedLinear | None:
        """Input columns ``own`` of the layer (a row-parallel rank's share; ``row_shard``'s
        result, from whole groups read), or None where it must be read whole: an act-order
        weight (its groups hold permuted columns), an int4 per-channel share that does not
        start on a byte."""
        K, G, b = self.in_features, self.group_size, self.bits
        if self.act_order:
            return None
        if G >= K:  # per-channel: one scale a row, any columns
            if b == 4 and own.start % 2:
                return None
            packed = self._take("packed", None, slice(own.start * b // 8, -(-own.stop * b // 8)))
            return ImportedLinear(self._weight(packed, self._take("scales"), self._take("zeros"), len(own),
                                               self.out_features, len(own)))
        lo, hi = whole_groups(own, G, K)  # (G is even: a byte edge)
        groups = slice(lo // G, -(-hi // G))
        whole = ImportedLinear(self._weight(self._take("packed", None, slice(lo * b // 8, -(-hi * b // 8))),
                                            self._take("scales", None, groups), self._take("zeros", None, groups),
                                            hi - lo, self.out_features, G))
        return whole if (lo, hi) == (own.start, own.stop) else row_shard(whole, range(own.start - lo, own.stop - lo))


def read_checkpoint(directory: Path) -> tuple[LazyTensors, dict[str, StoredLinear], dict]:
    """(the unquantized tensors, as the builder takes them; the quantized linears by name,
    checked against the header, not read yet; the metadata)."""
    from safetensors import safe_open

    path = Path(directory) / WEIGHTS
    with safe_open(str(path), framework="pt") as f:
        header = (f.metadata() or {}).get("woq")
    if header is None:
        raise CheckpointError(f"{path} has no woq metadata header: not a woq checkpoint")
    meta = json.loads(header)
    if meta.get("format") != "woq" or meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format version {meta.get('format_version')!r} is not supported "
                              f"(this woq reads version {FORMAT_VERSION}); re-run `woq quantize`")
    tensors = LazyTensors([path])
    linears = {name: StoredLinear(tensors, name, info, path) for name, info in meta["linears"].items()}
    return tensors, linears, meta
