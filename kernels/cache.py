"""The cache directory of the whole stack: fetched models, compiled kernels, tuning tables."""
import os
from pathlib import Path


def cache_dir() -> Path:
    """``$WOQ_CACHE``, default ``~/.cache/woq``."""
    return Path(os.environ.get("WOQ_CACHE", Path.home() / ".cache" / "woq")).expanduser()
