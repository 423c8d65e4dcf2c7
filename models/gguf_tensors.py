"""The tensors of a GGUF file under Hugging Face names, each dequantized when a layer takes it.

transformers' GGUF loader dequantizes the whole file into an fp32 model before anything
is built: some 32 GB for an 8B model, in every tensor-parallel rank. Here the builder takes
a tensor (``pop``) and only then are its quantization blocks read from the file's memory
map and dequantized; a tensor-parallel rank reads only its rows or columns of a weight
(``pop_rows``). GGUF stores a weight row by row -- a row is one of the HF layout's output
channels, a run of quantization blocks along the input dimension -- so a share of rows is
one slice of the file, and a share of columns is a slice of every row, widened to whole
blocks and cut after dequantization.

The values are transformers' (``load_gguf_checkpoint``): the same fp32 dequantization
(gguf-py's), the same names, and, where the file's architecture is ``llama``, q's and k's
rows put back in HF order -- llama.cpp's converter interleaves the two halves of each
head's rotary dimensions, so a head's rows are un-permuted within the head (a share of
whole heads, as tensor-parallel shares are, un-permutes alone).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .gguf_header import read_header
from .lazy_tensors import TakenTensors


class GgufTensors(TakenTensors):
    """The tensors of a GGUF file (``TakenTensors``), dequantized to fp32 as they are taken;
    ``bytes_read`` counts the file's bytes. Tensors the model does not name (llama.cpp's
    ``rope_freqs``) are left out."""

    def __init__(self, path: Path, config):
        from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

        header = read_header(path)  # (not gguf-py's reader, which parses every array: gguf_header.py)
        arch_name = header.fields["general.architecture"]
        arch = next((a for a, n in MODEL_ARCH_NAMES.items() if n == arch_name), None)
        if arch is None:
            raise ValueError(f"{path}: GGUF architecture {arch_name!r} is not one gguf-py knows")
        layers = config.num_hidden_layers
        names = get_tensor_name_map(arch, layers)
        hf = ["model.embed_tokens", "model.norm", "lm_head"]
        for i in range(layers):
            hf += [f"model.layers.{i}.{m}" for m in (
                "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
        to_hf = {}
        for base in hf:
            gguf_base = names.get_name(base)
            if gguf_base is not None:
                to_hf.update({gguf_base + s: base + s for s in (".weight", ".bias")})
        super().__init__({to_hf[t.name]: t for t in header.tensors if t.name in to_hf})
        # Rows per head of the tensors llama.cpp permuted (the number of heads is the
        # tensor's rows / head_dim, whatever the share)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self._permuted = {name: head_dim for name in self._where
                          if arch_name == "llama" and (".q_proj." in name or ".k_proj." in name)}

    def shape(self, name: str) -> list[int]:
        """A tensor's HF shape (GGUF lists its dimensions innermost first)."""
        return [int(d) for d in reversed(self._where[name].shape)]

    def _read_whole(self, name: str, t) -> torch.Tensor:
        if len(t.shape) > 1:
            return self._read(name, t, slice(None), slice(None))
        raw = np.ascontiguousarray(t.data).view(np.uint8)
        self.bytes_read += raw.nbytes
        return self._unpermuted(name, torch.from_numpy(self._dequantize(raw, t.tensor_type).copy()))

    @staticmethod
    def _dequantize(raw: np.ndarray, qtype) -> np.ndarray:
        from gguf import dequantize

        return dequantize(raw, qtype).astype(np.float32, copy=False)

    def _read(self, name: str, t, rows: slice, cols: slice) -> torch.Tensor:
        """Rows x cols of a 2-D tensor: the rows' bytes of the blocks that hold the columns
        (the memory map reads only those pages), dequantized, then cut to the columns."""
        from gguf import GGML_QUANT_SIZES

        block, block_bytes = GGML_QUANT_SIZES[t.tensor_type]
        K = int(t.shape[0])
        c0, c1, _ = cols.indices(K)
        b0, b1 = c0 // block, -(-c1 // block)
        data = t.data[rows]  # (rows, bytes of a row) for quantized types, (rows, K) for float ones
        raw = np.ascontiguousarray(data.view(np.uint8)[:, b0 * block_bytes:b1 * block_bytes])
        self.bytes_read += raw.nbytes
        w = self._dequantize(raw, t.tensor_type).reshape(raw.shape[0], -1)[:, c0 - b0 * block:c1 - b0 * block]
        return self._unpermuted(name, torch.from_numpy(np.ascontiguousarray(w)), rows)

    def _unpermuted(self, name: str, w: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
        """q's and k's rows (or bias) in HF order: each head's ``[half, 2]`` rows as ``[2, half]``."""
        head_dim = self._permuted.get(name)
        if head_dim is None:
            return w
        start = rows.start or 0
        if start % head_dim or w.shape[0] % head_dim:
            raise ValueError(f"{name}: rows {start}..{start + w.shape[0]} cut a head of {head_dim} rows")
        heads = w.shape[0] // head_dim
        return w.reshape(heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()
