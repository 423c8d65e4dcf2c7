"""Timing GPU work without launch gaps or cache effects: a CUDA graph of several calls (no launch gaps),
replayed a few times, median microseconds per call."""
from __future__ import annotations

import statistics
from typing import Callable, Sequence

import torch


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
