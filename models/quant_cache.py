"""The quantized-model cache: the first quantize-on-load of a model saves a woq checkpoint
under ``<cache>/quantized/``, and later loads of the same (source files, quantization,
activation dtype, checkpoint format and layout versions) read it instead of quantizing
again. The key holds each source file's size and modification time, so an edited or
replaced model is quantized anew."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from ..kernels.layout import LAYOUT_VERSION
from .checkpoint import FORMAT_VERSION, save_checkpoint
from .quant_config import QuantConfig

log = logging.getLogger("woq.models")


def entry(directory: Path, gguf_file: str | None, quant: QuantConfig, dtype: torch.dtype, cache: Path,
          name: str) -> Path:
    """Where the quantized checkpoint of this source and quantization lives (or would)."""
    files = [directory / gguf_file] if gguf_file else sorted(
        p for p in directory.iterdir() if p.suffix in (".safetensors", ".json"))
    key = {"files": [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files],
           "quant": [quant.mode, quant.group_size, quant.symmetric, quant.quantize_lm_head], "dtype": str(dtype),
           "format": FORMAT_VERSION, "layout": LAYOUT_VERSION}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    label = quant.describe().replace(" ", "-")
    return cache / "quantized" / f"{name}-{label}-{str(dtype).removeprefix('torch.')}-{digest}"


def store(model, hf_config, tokenizer, path: Path, source: str, quant: QuantConfig) -> None:
    """Save ``model`` (just quantized) at ``path``: written beside it, then renamed, so that
    a half-written entry is never read; a failure to write costs only the cache."""
    spec = quant.spec()
    info = {"method": "rtn", "bits": spec.bits, "group_size": spec.group_size or "channel", "symmetric": spec.symmetric}
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        save_checkpoint(model, hf_config, tokenizer, tmp, source, info)
        tmp.rename(path)
        log.info("saved the quantized model in %s: later loads read it instead of quantizing", path)
    except OSError as exc:
        log.warning("could not cache the quantized model in %s: %s", path, exc)
        shutil.rmtree(tmp, ignore_errors=True)
