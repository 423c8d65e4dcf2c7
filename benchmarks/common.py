"""Measurement helpers shared by the benchmarks (benchmarks/README.md, "How to read the
numbers": CUDA-graph replays timed with events, weights rotated past L2, medians, a
measured bandwidth ceiling)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Sequence

import torch


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    from woq.kernels.timing import measure_copy_bandwidth

    return measure_copy_bandwidth(None, nbytes, reps)


def copies_to_defeat_l2(nbytes: int, factor: int = 4, cap: int = 64) -> int:
    """How many copies of a weight make the rotation exceed ``factor`` x L2."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(2, min(cap, math.ceil(factor * l2 / max(nbytes, 1))))


def time_calls(fns: Sequence[Callable[[], object]], calls_per_graph: int = 20, reps: int = 15) -> float:
    """Median µs per call of a CUDA graph replaying ``fns`` round-robin (``woq.kernels.timing``)."""
    from woq.kernels.timing import graph_time_us

    return graph_time_us(fns, calls_per_graph, reps)


def gpu_info() -> dict:
    p = torch.cuda.get_device_properties(0)
    return {"gpu": p.name, "sms": p.multi_processor_count, "l2_bytes": p.L2_cache_size,
            "torch": torch.__version__, "cuda": torch.version.cuda}


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


def save_results(out: Path, name: str, result: dict, summary, plot=None) -> None:
    """A benchmark's results as ``out/name.{json,md,png}`` (``summary(result)``: the markdown,
    also printed; ``plot(result, path)``: the figure)."""
    write_json(out / f"{name}.json", result)
    (out / f"{name}.md").write_text(summary(result))
    if plot is not None:
        plot(result, out / f"{name}.png")
    print(summary(result))


def markdown_table(headers: list[str], rows: list[list]) -> str:
    def fmt(v):
        return f"{v:.1f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)
