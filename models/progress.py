"""Progress of the long steps of loading (building layers, packing for the GPU, GPTQ,
perplexity): a tqdm bar on a terminal; elsewhere (a log file, a container) a line when the
step starts and one when it ends, rather than bars glued into one line."""
from __future__ import annotations

import logging
import sys
import time
from typing import Iterable, Iterator, TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")
log = logging.getLogger("woq.progress")


def progress(items: Iterable[T], desc: str, enabled: bool = True, total: int | None = None) -> Iterator[T]:
    if not enabled:
        yield from items
        return
    if sys.stderr.isatty():
        yield from tqdm(items, desc=desc, total=total)
        return
    total = total if total is not None else (len(items) if hasattr(items, "__len__") else None)
    log.info("%s: %s", desc, f"{total} steps" if total is not None else "started")
    t0, n = time.perf_counter(), 0
    for n, item in enumerate(items, 1):
        yield item
    log.info("%s: %d done in %.1f s", desc, n, time.perf_counter() - t0)
