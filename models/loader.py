"""Load a model by name or path: config, tokenizer and weights from local files only.

Accepted sources:
* ``smollm2-135m-instruct`` (the default): fetched once into the cache (``models/fetch.py``);
* a Hugging Face directory: ``config.json`` + ``*.safetensors`` (sharded or not) + tokenizer;
* a ``.gguf`` file: its config and tokenizer through transformers' ``gguf_file=`` loader
  (kept in the cache after the first load: ``gguf_config_cache.py``), its tensors read one
  by one as the builder takes them (``models/gguf_tensors.py``).
Nothing is ever fetched from a model hub.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..kernels.options import RuntimeOptions
from . import gguf_config_cache, quant_cache
from .builder import build_model
from .checkpoint import describe, is_woq_checkpoint, read_metadata
from .checkpoint import read_checkpoint as read_woq
from .fetch import DEFAULT_MODEL, fetch_default_model
from .gguf_tensors import GgufTensors
from .importers import import_quantized, quantization_config
from .lazy_tensors import LazyTensors
from .llama import CausalLM
from .quant_config import QuantConfig
from .sharding import TensorParallel

log = logging.getLogger("woq.models")

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only, whatever a caller forgets


class DeviceError(ValueError):
    """A device this machine does not have, or no device at all."""


class ModelSourceError(FileNotFoundError):
    pass


@dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: object
    hf_config: object
    name: str
    load_seconds: float
    quantization: str  # what the weights are, e.g. "int4 g128 asym" ("..., gptq" for a checkpoint)
    from_cache: bool = False  # read from the quantized-model cache (quant_cache.py)


def resolve_source(model: str, cache: Path | None = None) -> tuple[Path, str | None]:
    """(directory, gguf file name or None) for a model name or path (the default model is
    fetched into ``cache``)."""
    if model == DEFAULT_MODEL:
        return fetch_default_model(cache), None
    p = Path(model).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return p.parent, p.name
    if p.is_dir() and (p / "config.json").exists():
        return p, None
    raise ModelSourceError(
        f"model {model!r} is neither {DEFAULT_MODEL!r}, a Hugging Face directory with config.json, nor a .gguf file"
    )


def read_safetensors(directory: Path) -> LazyTensors:
    """The tensors of ``directory``'s safetensors files (its index's, or every one), read as
    the builder takes them."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise ModelSourceError(f"no *.safetensors weights in {directory}")
    return LazyTensors([directory / f for f in files])


def _read_config(directory: Path, gguf_file: str | None, cache: Path | None, tokenizer: bool = True):
    """(HF config, tokenizer or None) from local files; a GGUF file's are kept in ``cache``
    (``gguf_config_cache.py``), where the tokenizer comes with the config anyway."""
    from transformers import AutoConfig, AutoTokenizer

    if gguf_file:
        with open(directory / gguf_file, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelSourceError(f"{directory / gguf_file} is not a GGUF file (no GGUF magic bytes at its start)")
    try:
        if gguf_file:
            return gguf_config_cache.config_and_tokenizer(directory / gguf_file, cache)
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
        return config, AutoTokenizer.from_pretrained(directory, local_files_only=True) if tokenizer else None
    except (OSError, ValueError, KeyError) as exc:  # transformers' word for a directory it cannot read
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelSourceError(f"cannot read the model in {directory / (gguf_file or '')}: {first}") from exc


def read_config(model: str, cache: Path | None = None):
    """The HF config of ``model`` (a name, directory or GGUF file), without its weights:
    what is checked before the work of a load starts (``models/sharding.check_split``)."""
    return _read_config(*resolve_source(model, cache), cache, tokenizer=False)[0]


def read_checkpoint(directory: Path, gguf_file: str | None, cache: Path | None = None):
    """HF config, tokenizer, state dict (HF tensor names; from safetensors files a
    ``LazyTensors``, from a GGUF file a ``GgufTensors``: each tensor read as the builder
    takes it) and the already quantized linears (a woq checkpoint's, or a GPTQ/AWQ
    checkpoint's imported) from local files. A GGUF file's config and tokenizer are kept
    in ``cache`` (``gguf_config_cache.py``)."""
    config, tokenizer = _read_config(directory, gguf_file, cache)
    quantized: dict = {}
    if gguf_file:
        state = GgufTensors(directory / gguf_file, config)
    elif is_woq_checkpoint(directory):
        state, quantized, meta = read_woq(directory)
        log.info("woq checkpoint: %s", meta.get("quantizer"))
    else:
        state = read_safetensors(directory)
        qc = quantization_config(directory, config)
        if qc is not None:
            quantized = import_quantized(state, qc, config)
            log.info("imported a %s checkpoint (%d quantized linears)", qc.get("quant_method"), len(quantized))
    return config, tokenizer, state, quantized


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.float16 if device.type == "cuda" else torch.float32


def resolve_device(device: str) -> torch.device:
    """``auto`` (CUDA where torch sees a GPU, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``;
    a CUDA device this machine does not have is refused here, before anything is built."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not (device == "cpu" or device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
        raise DeviceError(f"unknown device {device!r}: use auto, cpu, cuda or cuda:N")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"--device {device}: torch sees no CUDA GPU on this machine "
                              f"(torch {torch.__version__}); use --device cpu or auto")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeviceError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return dev


def load_model(
    model: str = DEFAULT_MODEL,
    quant: QuantConfig = QuantConfig(),
    dtype: torch.dtype | None = None,
    device: str | torch.device = "auto",
    max_seq_len: int | None = None,
    progress: bool = True,
    options: RuntimeOptions | None = None,
    tp: TensorParallel | None = None,
) -> LoadedModel:
    """The model ``model`` (a name, directory or GGUF file) built for ``device``, quantized
    as ``quant`` asks (read from the quantized-model cache where it was quantized before);
    with ``tp``, this rank's shard of it (a shard is not stored in the cache)."""
    t0 = time.perf_counter()
    device = resolve_device(device) if isinstance(device, str) else device
    dtype = dtype or default_dtype(device)
    options = options or RuntimeOptions()
    directory, gguf_file = resolve_source(model, options.cache_dir)
    cached = None  # the quantized-model cache's entry for what is quantized here
    if quant.spec() is not None and not is_woq_checkpoint(directory):
        cached = quant_cache.entry(directory, gguf_file, quant, dtype, options.cache_dir, model_name(model))
        if is_woq_checkpoint(cached):
            directory, gguf_file = cached, None  # quantized before: read, not quantized again
    config, tokenizer, state, quantized = read_checkpoint(directory, gguf_file, options.cache_dir)
    from .config import ArchConfig

    limit = ArchConfig.from_hf(config).context_limit
    max_seq_len = min(max_seq_len or limit, limit)
    built = build_model(config, state, quant, dtype, device, max_seq_len, progress=progress, prequantized=quantized,
                        options=options, tp=tp)
    if cached is not None and directory != cached and not quantized and tp is None:
        quant_cache.store(built, config, tokenizer, cached, model, quant)
    if is_woq_checkpoint(directory):  # served under its source model's name, described as stored
        meta = read_metadata(directory)
        name, quantization = model_name(meta.get("source_model") or str(directory)), describe(meta)
    else:
        name = model_name(model)
        if quantized:
            quantization = "imported: " + describe({"linears": {n: _linear_meta(q) for n, q in quantized.items()}})
        else:
            quantization = "none (dense)" if quant.spec() is None else quant.describe()
    return LoadedModel(built, tokenizer, config, name, time.perf_counter() - t0, quantization,
                       from_cache=cached is not None and directory == cached)


def model_name(model: str) -> str:
    """The name a model is served under: the alias, a .gguf file's stem, a directory's name."""
    if model == DEFAULT_MODEL:
        return DEFAULT_MODEL
    p = Path(model)
    return p.stem if p.suffix == ".gguf" else p.name


def _linear_meta(q) -> dict:
    """The description's fields of a quantized weight or of an import not read yet."""
    return {"bits": q.bits, "group_size": q.group_size, "in_features": q.in_features, "symmetric": q.symmetric}
