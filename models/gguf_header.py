"""A GGUF file's scalar metadata and tensor table, read in one pass over its header.

gguf-py's ``GGUFReader`` builds a numpy view for every element of every metadata array:
a tokenizer's vocabulary, scores, token types and merges are ~150,000 of them in the
default model's file, and a parse takes seconds of CPU (docs/design/ci.md). Loading
weights needs none of the arrays, only the scalars (the architecture, the alignment) and
the tensor table, so this reader walks the header with ``struct`` and skips each array
by its length (a string array element by element: each string says its own length),
then maps the tensors as gguf-py does (its quantization sizes and byte shapes).

The layout (GGUF v2/v3, little-endian): magic ``GGUF``, version u32, tensor count u64,
metadata count u64; each metadata entry a key (u64 length + UTF-8), a value type u32 and
the value (an array: item type u32, count u64, items); then each tensor's name, number
of dimensions u32, dimensions u64 each (innermost first), type u32 and offset u64 from the
data section, which starts at the next multiple of ``general.alignment`` (default 32).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# GGUF metadata value types (gguf-py's ``GGUFValueType``, not imported here: the loader
# imports this module) -> the struct format of a scalar of that type
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",  # UINT8 .. BOOL
            10: "Q", 11: "q", 12: "d"}  # UINT64, INT64, FLOAT64
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


@dataclass
class GgufTensor:
    """One tensor of the table: ``shape`` as GGUF lists it (innermost first), ``data`` the
    file's bytes for it as gguf-py's ``ReaderTensor.data`` has them (float types typed and
    shaped outermost first; quantized ones as rows of bytes)."""
    name: str
    shape: tuple[int, ...]
    tensor_type: object  # gguf.GGMLQuantizationType
    n_bytes: int
    data: np.ndarray


@dataclass
class GgufHeader:
    fields: dict[str, object]  # the scalar and string metadata (arrays are skipped)
    tensors: list[GgufTensor]


class _Cursor:
    def __init__(self, buf) -> None:
        self.buf, self.at = buf, 0

    def take(self, fmt: str):
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        self.at += n
        return bytes(self.buf[self.at - n:self.at]).decode("utf-8")

    def skip_array(self, item_type: int, count: int) -> None:
        if item_type in _SCALARS:
            self.at += count * struct.calcsize(_SCALARS[item_type])
        elif item_type == _STRING:
            for _ in range(count):
                self.at += 8 + struct.unpack_from("<Q", self.buf, self.at)[0]
        elif item_type == _ARRAY:
            for _ in range(count):
                inner, n = self.take("I"), self.take("Q")
                self.skip_array(inner, n)
        else:
            raise ValueError(f"unknown GGUF value type {item_type}")


def read_header(path: Path) -> GgufHeader:
    """The metadata scalars and tensor table of the GGUF file at ``path``, its tensors'
    data mapped read-only (``ValueError`` for what is not a little-endian GGUF v2/v3, or a
    header cut short)."""
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    if bytes(mm[:4]) != b"GGUF":
        raise ValueError(f"{path}: no GGUF magic bytes")
    try:
        fields, table, end = _walk(_Cursor(memoryview(mm)), path)
    except struct.error as exc:  # (a read past the end)
        raise ValueError(f"{path}: the GGUF header is cut short") from exc
    return _tensors(mm, fields, table, end)


def _walk(cur: _Cursor, path: Path) -> tuple[dict[str, object], list[tuple], int]:
    """The scalar fields, the tensor table (name, dimensions, type, offset) and where the
    header ends."""
    from gguf import GGMLQuantizationType

    cur.at = 4
    version = cur.take("I")
    if version not in (2, 3):  # (a big-endian file reads as a huge version here)
        raise ValueError(f"{path}: GGUF version {version} (or big-endian) is not read here")
    n_tensors, n_fields = cur.take("Q"), cur.take("Q")
    fields: dict[str, object] = {}
    for _ in range(n_fields):
        key, kind = cur.string(), cur.take("I")
        if kind in _SCALARS:
            fields[key] = cur.take(_SCALARS[kind])
        elif kind == _STRING:
            fields[key] = cur.string()
        elif kind == _ARRAY:
            item_type, count = cur.take("I"), cur.take("Q")
            cur.skip_array(item_type, count)
        else:
            raise ValueError(f"{path}: unknown GGUF value type {kind} for {key}")
    table = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.take("Q") for _ in range(cur.take("I")))
        table.append((name, dims, GGMLQuantizationType(cur.take("I")), cur.take("Q")))
    return fields, table, cur.at


def _tensors(mm: np.memmap, fields: dict[str, object], table: list[tuple], end: int) -> GgufHeader:
    """The header, its tensors' data mapped from where the data section starts."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    alignment = int(fields.get("general.alignment", _DEFAULT_ALIGNMENT))
    start = -(-end // alignment) * alignment
    typed = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
             GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
             GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
             GGMLQuantizationType.I64: np.int64}
    tensors = []
    for name, dims, qtype, offset in table:
        n_elems = int(np.prod(dims))
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        n_bytes = n_elems * block_bytes // block
        outer_first = tuple(reversed(dims))
        raw = mm[start + offset:start + offset + n_bytes]
        if qtype in typed:
            data = raw.view(typed[qtype]).reshape(outer_first)
        else:
            data = raw.reshape(quant_shape_to_byte_shape(outer_first, qtype))
        tensors.append(GgufTensor(name, dims, qtype, n_bytes, data))
    return GgufHeader(fields, tensors)
