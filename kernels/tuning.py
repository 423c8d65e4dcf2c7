"""Measured launch choices per weight shape, on the GPU at hand (once, then cached).

For each (GPU, kernel version, N, K, bits, group, zeros, dtype) we time, on the real weight:
  * the GEMV launch at M = 1, 2, 4, 8, 16 (each call after a small dependent kernel, as
    in a decode step: ``_decode_neighbour``) and at 17, 24, 32 where the weight's format
    allows them (each M standing for the Ms up to it): k-warps per n-tile and the grid,
    and up to 8 rows also the register-stream pipeline (``_stream_candidates``);
  * the mixed GEMM over an M grid (16 .. 1024): each tile configuration x split-K, and
    dequantize + cuBLAS at the same M; the plan keeps the fastest launch per M, and the
    crossover is the largest M of the grid at which the kernel still wins (we stop at
    the first loss: beyond it the dense GEMM's reuse only grows);
  * the GEMV's reach: 8, 16, 17, 24 or 32, whichever keeps each M measured from 16 up
    closest to its fastest path (``_gemv_reach``).
Tables are JSON files named ``<gpu>-v<kernel version>.json`` (``limits().tuning_version``,
bumped in csrc/woq_kernels.h when a kernel's launch space or numerics change): measured
ones in ``<cache>/tuning/``, shipped defaults for measured GPUs in ``kernels/tuned/``.
With ``RuntimeOptions.tune`` off, a shape missing from both gets the kernels' own
launches and a fixed crossover.
"""
from __future__ import annotations

import json
import logging
import math
import os
import statistics
from dataclasses import replace
from pathlib import Path

import torch

from . import ops
from .layout import GpuWeight
from .limits import GEMV_RING, GEMV_STREAM, limits
from .options import RuntimeOptions
from .scratch import MAX_GEMM_M
from .timing import graph_time_us

log = logging.getLogger("woq.kernels")

DEFAULT_MAX_KERNEL_M = 128  # without measurements (tuning off)
# 16: the GEMV's rival at a decode batch of 16 (config 9's 16-row tile); 17: at its measured 17 rows.
# From 128 on, every 64 rows up to 512: the counts the engine pads its packed steps to
# (engine/cuda_graphs.py, prefill_buckets). A count between two measured Ms would run the larger
# one's launch, whose tiles and splits were chosen for that M's grid of blocks, not its own
# (docs/design/mixed_gemm.md, "The launches at the engine's step sizes").
GEMM_MS = (16, 17, 24, 32, 64, 128, 192, 256, 320, 384, 448, 512, MAX_GEMM_M)
POWER_CAPPED_M, POWER_CAPPED_ROUNDS = 512, 3  # the GEMM against dequantize + cuBLAS (measure)
# The Ms at which the GEMV's launch is measured, each standing for the Ms up to it: the
# kernel's shared memory, hence the blocks an SM holds, grows with M, so a grid measured at
# M = 8 can crowd some SMs and idle others at M = 2. 17 and 24: the first Ms past a decode
# batch of 16, where the GEMV can still win against the mixed GEMM.
GEMV_TUNED_MS = (1, 2, 4, 8, 16, 17, 24, 32)
_tables: dict[tuple[Path, bool], dict] = {}


def table_name() -> str:
    """``<gpu>-v<kernel version>``: the file stem of this GPU's tables."""
    gpu = torch.cuda.get_device_name().replace(" ", "_").replace("/", "_")
    return f"{gpu}-v{limits().tuning_version}"


def shipped_dir() -> Path:
    return Path(__file__).parent / "tuned"


def _table(options: RuntimeOptions) -> dict:
    path = options.tuning_dir() / f"{table_name()}.json"
    if (path, options.shipped_tables) not in _tables:
        table: dict = {}
        for p in ([shipped_dir() / path.name] if options.shipped_tables else []) + [path]:
            if p.exists():
                table.update(json.loads(p.read_text()))
        _tables[path, options.shipped_tables] = table
    return _tables[path, options.shipped_tables]


def _save(options: RuntimeOptions) -> None:
    path = options.tuning_dir() / f"{table_name()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    # (a file of this process's own: tensor-parallel ranks tune their shards at the same time
    # and write the same table; the last rename wins whole)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(_table(options), indent=1, sort_keys=True))
    tmp.replace(path)


def shape_key(gw: GpuWeight) -> str:
    g = "ch" if gw.per_channel else str(gw.group_size)
    return f"{gw.N}x{gw.K}-int{gw.bits}-g{g}-{'zeros' if gw.zeros is not None else 'sym'}-{str(gw.dtype)[6:]}"


def _rotation(gw: GpuWeight) -> list[GpuWeight]:
    """Copies of a small weight, so that a timed sequence reads each from DRAM rather than
    L2 (a decode step streams every layer once: weights are cold)."""
    l2 = torch.cuda.get_device_properties(gw.qweight.device).L2_cache_size
    n = max(1, min(8, math.ceil(2 * l2 / gw.nbytes())))

    def clone(t):
        return None if t is None else t.clone()

    return [gw] + [replace(gw, qweight=gw.qweight.clone(), scales=gw.scales.clone(), zeros=clone(gw.zeros))
                   for _ in range(n - 1)]


def _time_us(fn, copies: list[GpuWeight]) -> float:
    """Median microseconds per call of ``fn(copy)`` over the rotated copies; infinite for
    a launch this GPU refuses (e.g. a shared-memory ring larger than it has)."""
    try:
        fn(copies[0])  # (graph_time_us calls it eagerly too; a refusal must not reach a capture)
    except (ValueError, RuntimeError) as exc:
        log.debug("launch refused: %s", exc)
        return math.inf
    # 11 replays: launch choices a few % apart must not be picked by noise
    return graph_time_us([lambda g=g: fn(g) for g in copies], calls=16, reps=11)


def _decode_neighbour(x: torch.Tensor):
    """A small dependent kernel to run before each timed decode GEMV (M <= 16), as in a
    decode step, where every GEMV follows a small kernel (RMSNorm, attention). Timed back
    to back alone, GEMVs overlap their successors through programmatic launches and reward
    grids that leave an SM room for the next call's blocks, which a decode step never runs
    (docs/design/gemv.md). Its time is the same for every candidate: it only changes the
    ranking."""
    from .fused import add_rms_norm

    weight = torch.ones(x.shape[1], device=x.device, dtype=x.dtype)
    return lambda: add_rms_norm(x, None, weight, 1e-5)


def _stream_candidates(n: int, sms: int) -> list[tuple[int, int]]:
    """(k_warps, blocks) of the register-stream GEMV worth timing: each k-warp count with its
    columns cut into 1, 2, 3, 4, 6, ... runs of K, up to about 4 blocks per SM (its grid is
    not persistent: how the blocks fill the waves matters), and the kernel's own split
    (blocks 0: about 2 per SM)."""
    out = []
    for kw in limits().stream_k_warps:
        columns = ops.gemv_stream_columns(n, kw)
        out += [(kw, 0)] + [(kw, columns * s) for s in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
                            if s == 1 or columns * s <= 4 * sms]
    return out


def _gemm_candidates(m: int, n: int, sms: int) -> list[tuple[int, int]]:
    """(config, splits) worth timing at M = m: configurations whose block rows are not
    mostly padding, each as stream-K over one resident wave (splits 0) and with split-K
    while the tiles leave SMs idle."""
    configs = [c for c in ops.gemm_configs() if (bm := limits().gemm_tiles[c][0]) <= max(32, 2 * m) and (m <= 64 or bm >= 64)]
    out = []
    for c in configs:
        tiles = ops.gemm_tiles(m, n, c)
        # (up to ~3 waves: on 21504 x 14336, M = 32, the 32 x 128 tile's 168 tiles ran
        # fastest cut in two, 336 blocks)
        out += [(c, s) for s in (0, 1, 2, 3, 4, 6, 8) if s <= 1 or tiles * s <= 3 * sms]
    return out


def _measure_gemv(gw: GpuWeight, copies: list[GpuWeight], ms) -> tuple[dict[str, list[int]], dict[int, float]]:
    """The fastest GEMV launch (k-warps, blocks, pipeline) at each of ``ms`` and its time."""
    lim = limits()
    sms = torch.cuda.get_device_properties(gw.qweight.device).multi_processor_count
    grids: dict[str, list[int]] = {}
    gemv_us: dict[int, float] = {}
    for m in ms:
        x = torch.randn(m, gw.K, device="cuda", dtype=gw.dtype)
        before = _decode_neighbour(x) if m <= lim.gemv_max_m else (lambda: None)
        t = {}
        candidates = [(kw, b, GEMV_RING) for kw in lim.gemv_k_warps(m)
                      for b in sorted({0, sms, 2 * sms, ops.gemv_columns(gw.N, kw, m), max(1, sms // 2)})]
        if m <= lim.stream_max_m:
            candidates += [(kw, b, GEMV_STREAM) for kw, b in _stream_candidates(gw.N, sms)]
        for kw, b, pipe in candidates:
            t[kw, b, pipe] = _time_us(
                lambda g, b=b, kw=kw, pipe=pipe, before=before: (before(), ops.gemv(x, g, max_blocks=b, k_warps=kw,
                                                                                    pipeline=pipe)),
                copies)
        best = min(t, key=t.get)
        if math.isinf(t[best]):  # no launch fits this GPU at this M
            continue
        grids[str(m)] = list(best)
        gemv_us[m] = t[best]
    return grids, gemv_us


def measure(gw: GpuWeight) -> dict:
    """Time the choices for one weight (well under a second of GPU time for most shapes)."""
    import torch.nn.functional as F

    lim = limits()
    sms = torch.cuda.get_device_properties(gw.qweight.device).multi_processor_count
    copies = _rotation(gw)
    grids, gemv_us = _measure_gemv(gw, copies, [m for m in GEMV_TUNED_MS if m <= ops.gemv_rows_limit(gw)])
    plan: dict[str, list[int]] = {}
    gemm_us: dict[int, float] = {}
    dense_us: dict[int, float] = {}
    max_m = lim.gemv_max_m  # the GEMV beats dequantize + cuBLAS at M <= 16
    if ops.supports_mixed_gemm(gw):
        for m in GEMM_MS:
            x = torch.randn(m, gw.K, device="cuda", dtype=gw.dtype)
            before = _decode_neighbour(x) if m <= lim.gemv_max_m else (lambda: None)  # timed as the GEMV is
            t = {}
            for c, s in _gemm_candidates(m, gw.N, sms):
                t[c, s] = _time_us(lambda g, c=c, s=s, before=before: (before(), ops.gemm(x, g, config=c, splits=s)),
                                   copies)
            best = min(t, key=t.get)
            if math.isinf(t[best]):  # no tile fits this GPU (not seen: config 4 fits 99 KB)
                break
            plan[str(m)] = list(best)
            gemm_us[m] = t[best]
            if m <= lim.gemv_max_m:  # decode rows: only the GEMV's rival (below)
                continue
            # The fastest of ~20 noisy timings reads low (it is also the luckiest): timed once
            # more, alone, before it meets dequantize + cuBLAS. From M = 512 on both run at
            # the card's power cap, whose clock drifts within seconds (docs/design/dequant.md):
            # there they alternate over rounds and meet round by round.
            rounds = [(_time_us(lambda g, c=best[0], s=best[1]: ops.gemm(x, g, config=c, splits=s), copies),
                       _time_us(lambda g: F.linear(x, ops.dequantize(g)), copies))
                      for _ in range(POWER_CAPPED_ROUNDS if m >= POWER_CAPPED_M else 1)]
            gemm_us[m] = statistics.median(g for g, _ in rounds)
            dense_us[m] = statistics.median(d for _, d in rounds)
            if statistics.median(g / d for g, d in rounds) > 1:
                break
            max_m = m
    del copies
    gemv_max_m = _gemv_reach(gemv_us, gemm_us, dense_us, lim.gemv_max_m)
    return {"grids": grids, "gemm": plan, "max_kernel_m": max(max_m, gemv_max_m), "gemv_max_m": gemv_max_m}


def _gemv_reach(gemv_us: dict[int, float], gemm_us: dict[int, float], dense_us: dict[int, float],
                gemv_max_m: int) -> int:
    """The largest M the GEMV serves: 8 (the mixed GEMM takes 9..16, which the engine pads
    to 16) or one of the GEMV's measured Ms from 16 up -- whichever keeps the served time
    closest to the fastest path at every M measured from 16 up (the smallest worst ratio;
    then the least time). One threshold cannot follow every measurement: a GEMM faster at
    16 rows can lose to the GEMV at 17 (tests/test_tuning_table.py has such a case). Past
    16 rows only Ms where a rival was measured count (an M the GEMM loop did not reach ends
    the GEMV's reach too)."""
    def rival(m: int) -> float:
        return min([d[m] for d in (gemm_us, dense_us) if m in d], default=math.inf)

    ms = []
    for m in sorted(m for m in gemv_us if m >= gemv_max_m):
        if m > gemv_max_m and math.isinf(rival(m)):
            break
        ms.append(m)

    def cost(reach: int) -> tuple[float, float]:
        served = [gemv_us[m] if m <= reach else rival(m) for m in ms]
        return max((t / min(gemv_us[m], rival(m)) for t, m in zip(served, ms)), default=1.0), sum(served)

    below = [m for m in gemv_us if m < gemv_max_m]
    return min(([max(below)] if below else []) + (ms or [gemv_max_m]), key=cost)


def tuned(gw: GpuWeight, options: RuntimeOptions) -> dict:
    """The measured choices for this weight's shape (measured now if new and allowed)."""
    key = shape_key(gw)
    table = _table(options)
    if key not in table:
        if not options.tune:
            return {"grids": {}, "gemm": {}, "max_kernel_m": DEFAULT_MAX_KERNEL_M, "gemv_max_m": limits().gemv_max_m}
        log.info("tuning the woq kernels for %s on %s", key, torch.cuda.get_device_name())
        table[key] = measure(gw)
        _save(options)
    return table[key]


def all_tables(options: RuntimeOptions) -> dict[str, dict]:
    """Every table on this machine (cache and shipped), by file stem (GPU name + kernel version)."""
    tables: dict[str, dict] = {}
    for d in (shipped_dir(), options.tuning_dir()):
        for f in sorted(d.glob("*.json")) if d.exists() else []:
            tables.setdefault(f.stem, {}).update(json.loads(f.read_text()))
    return tables
