"""Measurement helpers shared by the benchmarks (benchmarks/README.md, "How to read the
numbers": CUDA-graph replays timed with events, weights rotated past L2, medians, a
measured bandwidth ceiling)."""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Callable, Sequence

import torch


def copy_bandwidth() -> float:
    """The current GPU's device-to-device copy bandwidth in bytes/s (read plus written), the
    value the server sets its roofline gauges against: measured once per GPU model and
    cached in the cache directory (``woq.kernels.timing.copy_bandwidth``). One measurement
    moves from process to process by more than a benchmark and a live gauge may differ
    (docs/design/metrics.md), so a benchmark does not measure its own."""
    from woq.kernels.options import default_cache_dir
    from woq.kernels.timing import copy_bandwidth as cached

    return cached(torch.device("cuda", torch.cuda.current_device()), default_cache_dir())


def copies_to_defeat_l2(nbytes: int, factor: int = 4, cap: int = 64) -> int:
    """How many copies of a weight make the rotation exceed ``factor`` x L2."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(2, min(cap, math.ceil(factor * l2 / max(nbytes, 1))))


def time_calls(fns: Sequence[Callable[[], object]], calls_per_graph: int = 20, reps: int = 15) -> float:
    """Median µs per call of a CUDA graph replaying ``fns`` round-robin (``woq.kernels.timing``)."""
    from woq.kernels.timing import graph_time_us

    return graph_time_us(fns, calls_per_graph, reps)


def event_ms(fn: Callable[[], object], repeats: int = 7, warmup: int = 1) -> float:
    """Median milliseconds of ``fn`` timed with CUDA events, after ``warmup`` calls (a whole
    step, host preparation included, where ``time_calls`` times kernels in a graph)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _rank_main(rank: int, size: int, port: int, out: str, target: Callable, args: tuple) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")  # (never multicast)
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=size, device_id=device)
    try:
        result = target(rank, size, device, dist.new_group(backend="gloo"), *args)
        if rank == 0:
            torch.save(result, f"{out}/rank0.pt")
    finally:
        dist.destroy_process_group()


def on_ranks(target: Callable, size: int, *args):
    """``target(rank, size, device, control, *args)`` in ``size`` processes, one GPU each, in
    an NCCL group (``control``: a host-side gloo group beside it); rank 0's result.
    ``target`` must be a module-level function (the processes are spawned)."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank_main, args=(size, port, tmp, target, args), nprocs=size, join=True,
                           start_method="spawn")
        return torch.load(Path(tmp) / "rank0.pt")


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


def alternating_ms(settings: list[str], prepare: Callable[[str], dict[str, Callable[[], object]]],
                   rounds: int = 2) -> dict[str, dict[str, float]]:
    """{setting: {key: ms}}: every round, each setting in turn -- ``prepare(setting)`` sets it
    up and returns the calls to time by key (``event_ms``, 50 repeats) -- and the median of
    each across rounds. Alternating in one process keeps the settings' conditions alike."""
    times: dict[str, dict[str, list[float]]] = {}
    for _ in range(rounds):
        for setting in settings:
            calls = prepare(setting)
            for key, fn in calls.items():
                times.setdefault(setting, {}).setdefault(key, []).append(event_ms(fn, repeats=50, warmup=3))
            del calls  # (and the graphs they replay)
            torch.cuda.empty_cache()
            print(setting, {k: round(v[-1], 3) for k, v in times[setting].items()}, flush=True)
    return {s: {k: statistics.median(v) for k, v in per.items()} for s, per in times.items()}


def settings_table(times: dict[str, dict[str, float]], row_label: str) -> str:
    """``alternating_ms``' result as markdown: how it was timed, then a column per setting,
    each later column's ratio to the first in brackets."""
    settings = list(times)
    first = times[settings[0]]
    rows = [[key] + [f"{times[s][key]:.3f}" + (f" ({times[s][key] / first[key]:.3f})" if i else "")
                     for i, s in enumerate(settings)] for key in first]
    return ("ms, median over rounds of medians of 50 runs, the settings alternating in one process; in brackets "
            "against the first setting.\n\n" + markdown_table([row_label] + settings, rows))


def markdown_table(headers: list[str], rows: list[list]) -> str:
    def fmt(v):
        return f"{v:.1f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)
