"""A GGUF file's Hugging Face config and tokenizer, kept in the cache.

transformers builds both from the file's metadata (``gguf_file=``), and each of the two
reads parses all of it through gguf-py: seconds for a large vocabulary, at every load of
the file (docs/design/ci.md has the times). The first load saves the two as Hugging Face
files under ``<cache>/gguf/``; later loads of the same file read those. The key holds the
file's path, size and modification time (an edited or replaced file is read anew) and
transformers' version (whose GGUF conversion made the files).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger("woq.models")


def entry(gguf: Path, cache: Path) -> Path:
    """Where ``gguf``'s config and tokenizer are kept (or would be)."""
    import transformers

    st = gguf.stat()
    key = {"file": [str(gguf.resolve()), st.st_size, st.st_mtime_ns], "transformers": transformers.__version__}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return cache / "gguf" / f"{gguf.stem}-{digest}"


def config_and_tokenizer(gguf: Path, cache: Path | None):
    """``gguf``'s (config, tokenizer): read from the cache's entry where there is one, else
    through transformers' GGUF loader, then saved there (``cache`` None: never saved)."""
    from transformers import AutoConfig, AutoTokenizer

    kept = entry(gguf, cache) if cache is not None else None
    if kept is not None and (kept / "config.json").exists():
        return (AutoConfig.from_pretrained(kept, local_files_only=True),
                AutoTokenizer.from_pretrained(kept, local_files_only=True))
    kw = dict(gguf_file=gguf.name, local_files_only=True)
    config = AutoConfig.from_pretrained(gguf.parent, **kw)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    if kept is not None:
        _store(config, tokenizer, kept)
    return config, tokenizer


def _store(config, tokenizer, path: Path) -> None:
    """Written beside ``path``, then renamed: a half-written entry is never read, and of two
    processes storing the same file's at once, the second's rename fails harmlessly. A failure
    to write costs only the cache."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        tmp.mkdir(parents=True)
        tokenizer.save_pretrained(tmp)
        config.save_pretrained(tmp)
        tmp.rename(path)
    except OSError as exc:
        if not (path / "config.json").exists():
            log.warning("could not keep the GGUF file's config and tokenizer in %s: %s", path, exc)
        shutil.rmtree(tmp, ignore_errors=True)
