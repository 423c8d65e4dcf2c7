"""Timing GPU work without launch gaps or cache effects: a CUDA graph of several calls (no launch gaps),
replayed a few times, median microseconds per call."""
from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path
from typing import Callable, Sequence

import torch

log = logging.getLogger("woq.kernels")


def graph_time_us(fns: Sequence[Callable[[], object]], calls: int = 20, reps: int = 15) -> float:
    """Median microseconds per call of a CUDA graph calling ``fns`` round-robin ``calls`` times.

    Passing one function per copy of a weight (rotation) keeps each call reading DRAM
    rather than L2, as a decode step that streams every layer once does.
    """
    for f in fns[:3]:
        f()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the capture stream (lazy inits, autotuning)
        for f in fns[:2]:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)


def measure_copy_bandwidth(device: torch.device | int | None = None, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written: the
    memory roofline a kernel's achieved bandwidth is set against."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device if device is not None else "cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize(a.device)
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * nbytes / statistics.median(times)


def copy_bandwidth(device: torch.device, cache_dir: Path) -> float:
    """``measure_copy_bandwidth`` of this GPU model, measured once (about a second, 2 GiB
    of memory for the moment) and cached in ``cache_dir/bandwidth.json``."""
    path = cache_dir / "bandwidth.json"
    name = torch.cuda.get_device_name(device)
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if name not in known:
        known[name] = measure_copy_bandwidth(device)
        log.info("measured the copy bandwidth of the %s: %.2f TB/s (cached in %s)", name, known[name] / 1e12, path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(known, indent=1))
        except OSError as exc:
            log.warning("could not cache the copy bandwidth in %s: %s", path, exc)
    return known[name]
