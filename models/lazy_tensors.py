"""A checkpoint's tensors, each read when a layer takes it (``TakenTensors``); here those of
safetensors files (``LazyTensors``; a GGUF file's: ``gguf_tensors.py``).

Reading every tensor up front holds a model's whole weight in host memory before its first
layer is built -- some 16 GB for an 8B fp16 checkpoint, 140 GB for a 70B one, and that in
every tensor-parallel rank. The builder takes a layer's tensors (``pop``), quantizes or
shards them and lets them go, so read on demand the host holds about one layer at a time;
a tensor-parallel rank takes only its rows or columns of a weight (``pop_rows``).
"""
from __future__ import annotations

from pathlib import Path

import torch


class TakenTensors:
    """A name -> tensor mapping for the builder whose tensors are read from a checkpoint's
    files when taken: ``pop`` reads a whole tensor (a tensor is taken once), ``pop_rows`` a
    2-D slice of it; ``in``, iteration and ``len`` cover the tensors not taken yet;
    ``bytes_read`` is what has been read so far. A format gives ``_read`` (a slice of one
    tensor, from where ``_where`` says it is) and ``_read_whole``."""

    def __init__(self, where: dict):
        self._where = where
        self.bytes_read = 0

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self):
        return iter(list(self._where))

    def __len__(self) -> int:
        return len(self._where)

    def keys(self) -> list[str]:
        return list(self._where)

    def pop_rows(self, name: str, rows: slice | list[slice] | None = None, cols: slice | None = None) -> torch.Tensor:
        """Take the tensor as ``pop``, reading only ``rows`` x ``cols`` of it (a 2-D slice:
        a tensor-parallel rank's share; the rest stays on disk). ``rows`` may be several
        runs, read one by one and joined in order (a fused qkv share: its q, k and v rows)."""
        source = self._where.pop(name)
        runs = rows if isinstance(rows, list) else [rows or slice(None)]
        pieces = [self._read(name, source, run, cols or slice(None)) for run in runs]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, 0)

    def pop(self, name: str, *default):
        if name not in self._where:
            if default:
                return default[0]
            raise KeyError(name)
        return self._read_whole(name, self._where.pop(name))

    def _read(self, name: str, source, rows: slice, cols: slice) -> torch.Tensor:
        raise NotImplementedError

    def _read_whole(self, name: str, source) -> torch.Tensor:
        raise NotImplementedError


class LazyTensors(TakenTensors):
    """The tensors of safetensors files (``TakenTensors``)."""

    def __init__(self, files: list[Path]):
        from safetensors import safe_open

        self._handles = [safe_open(str(f), framework="pt") for f in files]
        super().__init__({name: h for h in self._handles for name in h.keys()})

    def shape(self, name: str) -> list[int]:
        """A tensor's shape, read from its file's header (nothing of the data)."""
        return list(self._where[name].get_slice(name).get_shape())

    def _read(self, name: str, handle, rows: slice, cols: slice) -> torch.Tensor:
        t = handle.get_slice(name)[rows, cols]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def _read_whole(self, name: str, handle) -> torch.Tensor:
        t: torch.Tensor = handle.get_tensor(name)
        self.bytes_read += t.numel() * t.element_size()
        return t
