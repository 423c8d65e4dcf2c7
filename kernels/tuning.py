"""Measured launch choices per weight shape, on the GPU at hand (once, then cached).

For each (GPU, kernel build, N, K, bits, group, zeros, dtype) we time, on the real weight:
  * the GEMV launch at M = 1, 2, 4, 8, 16 (each call after a small dependent kernel, as
    in a decode step: ``_decode_neighbour``) and at 17, 24, 32 where the weight's format
    allows them (each M standing for the Ms up to it):
    k-warps per n-tile (1, 2 or 4 warps splitting each tile's K, so columns of 128, 64 or
    32 channels) and the grid (one resident wave, one block per SM, one block per column,
    ...) -- which wins depends on how many columns the weight has against the SM count
    and on M (the kernel's shared memory, hence the blocks an SM holds, follows M); up to
    8 rows also the register-stream pipeline, at 1, 2, 4 or 8 k-warps and its columns cut
    into 1, 2, 4, ... runs of K (``_stream_candidates``);
  * the mixed GEMM over an M grid (16 .. 1024): each tile configuration x split-K, and
    dequantize + cuBLAS at the same M; the plan keeps the fastest launch per M, and the
    crossover is the largest M of the grid at which the kernel still wins (we stop at
    the first loss: beyond it the dense GEMM's reuse only grows);
  * the GEMV's reach: 8, 16, 17, 24 or 32, whichever keeps each M measured from 16 up
    closest to its fastest path (the mixed GEMM is timed at 16 rows too, after the same
    small kernel as the GEMV; ``_gemv_reach``).
Results persist as JSON in ``$WOQ_CACHE/tuning/<gpu>-<kernel hash>.json`` (shipped
defaults for measured GPUs: ``kernels/tuned/``). ``WOQ_TUNE=0`` disables measuring; the
kernel's own default grid and a fixed crossover are used then.
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

from .cache import cache_dir
from .layout import GpuWeight
from .paths import GEMV_MAX_M
from .timing import graph_time_us

log = logging.getLogger("woq.kernels")

DEFAULT_MAX_KERNEL_M = 128  # without measurements (WOQ_TUNE=0)
# 16: the GEMV's rival at a decode batch of 16 (config 9's 16-row tile); 17: at its measured 17 rows
GEMM_MS = (16, 17, 24, 32, 64, 128, 256, 512, 1024)
POWER_CAPPED_M, POWER_CAPPED_ROUNDS = 512, 3  # the GEMM against dequantize + cuBLAS (measure)
_tables: dict[str, dict] = {}


def _table_path() -> Path:
    from .ops import _source_hash

    name = torch.cuda.get_device_name().replace(" ", "_").replace("/", "_")
    return cache_dir() / "tuning" / f"{name}-{_source_hash()}.json"


def _shipped_path() -> Path:
    from .ops import _source_hash

    name = torch.cuda.get_device_name().replace(" ", "_").replace("/", "_")
    return Path(__file__).parent / "tuned" / f"{name}-{_source_hash()}.json"


def _table() -> dict:
    path = _table_path()
    key = str(path)
    if key not in _tables:
        table: dict = {}
        for p in (_shipped_path(), path):
            if p.exists():
                table.update(json.loads(p.read_text()))
        _tables[key] = table
    return _tables[key]


def _save() -> None:
    path = _table_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(_table(), indent=1, sort_keys=True))
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
    """A small dependent kernel to run before each timed decode GEMV (M <= 16): in a decode
    step every GEMV follows one (RMSNorm, attention) and precedes another -- except down,
    which since the SwiGLU epilogue follows the gate/up GEMV itself (its launches were
    measured with this neighbour before that, and not again).
    Timed back to back alone, GEMVs overlap their successors through programmatic launches
    and reward grids that leave an SM room for the next call's blocks, which a decode step
    never runs (H100, Llama-3-8B int4, batch-16 graph step: 4078 us with the grids chosen
    that way, 3703 with only gate_up's 28672 x 4096 at one resident wave instead of one
    block per SM; re-tuned with this neighbour, 3878 -> 3292 us, int8 4708 -> 4410, batch
    1 unchanged). Its time is the same for every candidate: it only changes the ranking."""
    from .fused import add_rms_norm

    weight = torch.ones(x.shape[1], device=x.device, dtype=x.dtype)
    return lambda: add_rms_norm(x, None, weight, 1e-5)


def _stream_candidates(n: int, sms: int) -> list[tuple[int, int]]:
    """(k_warps, blocks) of the register-stream GEMV worth timing: each k-warp count with its
    columns cut into 1, 2, 3, 4, 6, ... runs of K, up to about 4 blocks per SM (its grid is
    not persistent: how the blocks fill the waves matters), and the kernel's own split
    (blocks 0: about 2 per SM)."""
    from . import ops

    out = []
    for kw in ops.STREAM_K_WARPS:
        columns = ops.gemv_stream_columns(n, kw)
        out += [(kw, 0)] + [(kw, columns * s) for s in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
                            if s == 1 or columns * s <= 4 * sms]
    return out


def _gemm_candidates(m: int, n: int, sms: int) -> list[tuple[int, int]]:
    """(config, splits) worth timing at M = m: configurations whose block rows are not
    mostly padding, each as stream-K over one resident wave (splits 0) and with split-K
    while the tiles leave SMs idle."""
    from . import ops

    configs = [c for c in ops.gemm_configs() if (bm := ops.GEMM_TILES[c][0]) <= max(32, 2 * m) and (m <= 64 or bm >= 64)]
    out = []
    for c in configs:
        tiles = ops.gemm_tiles(m, n, c)
        # (up to ~3 waves: on 21504 x 14336, M = 32, the 32 x 128 tile's 168 tiles ran
        # fastest cut in two, 336 blocks)
        out += [(c, s) for s in (0, 1, 2, 3, 4, 6, 8) if s <= 1 or tiles * s <= 3 * sms]
    return out


def _measure_gemv(gw: GpuWeight, copies: list[GpuWeight], ms) -> tuple[dict[str, list[int]], dict[int, float]]:
    """The fastest GEMV launch (k-warps, blocks, pipeline) at each of ``ms`` and its time."""
    from . import ops

    sms = torch.cuda.get_device_properties(gw.qweight.device).multi_processor_count
    grids: dict[str, list[int]] = {}
    gemv_us: dict[int, float] = {}
    for m in ms:
        x = torch.randn(m, gw.K, device="cuda", dtype=gw.dtype)
        before = _decode_neighbour(x) if m <= ops.GEMV_MAX_M else (lambda: None)
        t = {}
        candidates = [(kw, b, ops.GEMV_RING) for kw in ops.gemv_k_warps(m)
                      for b in sorted({0, sms, 2 * sms, ops.gemv_columns(gw.N, kw, m), max(1, sms // 2)})]
        if m <= ops.STREAM_MAX_M:
            candidates += [(kw, b, ops.GEMV_STREAM) for kw, b in _stream_candidates(gw.N, sms)]
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

    from . import ops

    sms = torch.cuda.get_device_properties(gw.qweight.device).multi_processor_count
    copies = _rotation(gw)
    grids, gemv_us = _measure_gemv(gw, copies, [m for m in ops.GEMV_TUNED_MS if m <= ops.gemv_rows_limit(gw)])
    plan: dict[str, list[int]] = {}
    gemm_us: dict[int, float] = {}
    dense_us: dict[int, float] = {}
    max_m = ops.GEMV_MAX_M  # the GEMV beats dequantize + cuBLAS at M <= 16
    if ops.supports_mixed_gemm(gw):
        for m in GEMM_MS:
            x = torch.randn(m, gw.K, device="cuda", dtype=gw.dtype)
            before = _decode_neighbour(x) if m <= ops.GEMV_MAX_M else (lambda: None)  # timed as the GEMV is
            t = {}
            for c, s in _gemm_candidates(m, gw.N, sms):
                t[c, s] = _time_us(lambda g, c=c, s=s, before=before: (before(), ops.gemm(x, g, config=c, splits=s)),
                                   copies)
            best = min(t, key=t.get)
            if math.isinf(t[best]):  # no tile fits this GPU (not seen: config 4 fits 99 KB)
                break
            plan[str(m)] = list(best)
            gemm_us[m] = t[best]
            if m <= ops.GEMV_MAX_M:  # decode rows: only the GEMV's rival (below)
                continue
            # The fastest of ~20 noisy timings reads low (it is also the luckiest): timed once
            # more, alone, before it meets dequantize + cuBLAS. Without this the H100 table sent
            # 4096 x 14336 int4 at M = 1024 to the GEMM, which the M-sweep then timed 9 % slower
            # than dequantize + cuBLAS (238.4 against 218.5 us). From M = 512 on both run at
            # the card's power cap, whose clock drifts by up to ~10 % within seconds
            # (docs/bench/dequant.md): there they alternate over rounds and meet round by round.
            rounds = [(_time_us(lambda g, c=best[0], s=best[1]: ops.gemm(x, g, config=c, splits=s), copies),
                       _time_us(lambda g: F.linear(x, ops.dequantize(g)), copies))
                      for _ in range(POWER_CAPPED_ROUNDS if m >= POWER_CAPPED_M else 1)]
            gemm_us[m] = statistics.median(g for g, _ in rounds)
            dense_us[m] = statistics.median(d for _, d in rounds)
            if statistics.median(g / d for g, d in rounds) > 1:
                break
            max_m = m
    del copies
    gemv_max_m = _gemv_reach(gemv_us, gemm_us, dense_us)
    return {"grids": grids, "gemm": plan, "max_kernel_m": max(max_m, gemv_max_m), "gemv_max_m": gemv_max_m}


def _gemv_reach(gemv_us: dict[int, float], gemm_us: dict[int, float], dense_us: dict[int, float]) -> int:
    """The largest M the GEMV serves: 8 (the mixed GEMM takes 9..16, which the engine pads
    to 16) or one of the GEMV's measured Ms from 16 up -- whichever keeps the served time
    closest to the fastest path at every M measured from 16 up (the smallest worst ratio;
    then the least time). One threshold cannot follow every measurement: on the H100 a
    GEMM faster at 16 rows can lose to the GEMV at 17 (4096 x 14336 int8: 26.6 against 27.1
    us at 16, 29.4 against 27.4 at 17), and "the GEMM from where it first wins" served 17
    rows 7 % slower than the GEMV. Past 16 rows only Ms where a rival was measured count
    (an M the GEMM loop did not reach ends the GEMV's reach too)."""
    def rival(m: int) -> float:
        return min([d[m] for d in (gemm_us, dense_us) if m in d], default=math.inf)

    ms = []
    for m in sorted(m for m in gemv_us if m >= GEMV_MAX_M):
        if m > GEMV_MAX_M and math.isinf(rival(m)):
            break
        ms.append(m)

    def cost(reach: int) -> tuple[float, float]:
        served = [gemv_us[m] if m <= reach else rival(m) for m in ms]
        return max((t / min(gemv_us[m], rival(m)) for t, m in zip(served, ms)), default=1.0), sum(served)

    below = [m for m in gemv_us if m < GEMV_MAX_M]
    return min(([max(below)] if below else []) + (ms or [GEMV_MAX_M]), key=cost)


def remeasure_gemv(gw: GpuWeight, entry: dict, ms) -> dict:
    """``entry`` (a table's choices for this weight's shape) with the GEMV launches at ``ms``
    measured anew, the rest kept: after a kernel change that touches only those launches
    (the register stream added M <= 8 launches and left the ring and the GEMM as they
    were), so that re-tuning does not re-time what did not change. Stored as this build's."""
    from . import ops

    grids, _ = _measure_gemv(gw, _rotation(gw), ms)
    entry = dict(entry, grids={**entry["grids"], **grids})
    entry["grids"] = {m: (g if len(g) == 3 else [*g, ops.GEMV_RING]) for m, g in entry["grids"].items()}
    _table()[shape_key(gw)] = entry
    _save()
    return entry


def tuned(gw: GpuWeight) -> dict:
    """The measured choices for this weight's shape (measured now if new and allowed)."""
    key = shape_key(gw)
    table = _table()
    if key not in table:
        if os.environ.get("WOQ_TUNE", "1") == "0":
            return {"grids": {}, "gemm": {}, "max_kernel_m": DEFAULT_MAX_KERNEL_M, "gemv_max_m": GEMV_MAX_M}
        log.info("tuning the woq kernels for %s on %s", key, torch.cuda.get_device_name())
        table[key] = measure(gw)
        _save()
    return table[key]


def all_tables() -> dict[str, dict]:
    """Every table on this machine (cache and shipped), by file stem (GPU name + kernel hash)."""
    tables: dict[str, dict] = {}
    for d in (Path(__file__).parent / "tuned", cache_dir() / "tuning"):
        for f in sorted(d.glob("*.json")) if d.exists() else []:
            tables.setdefault(f.stem, {}).update(json.loads(f.read_text()))
    return tables


def apply(gw: GpuWeight) -> GpuWeight:
    """Set the weight's measured launches: GEMV grids and reach, mixed-GEMM plan, crossover."""
    entry = tuned(gw)
    gw.max_kernel_m = entry["max_kernel_m"]
    gw.gemv_max_m = entry.get("gemv_max_m", GEMV_MAX_M)
    gw.grids = {int(k): tuple(v) for k, v in entry["grids"].items()}
    gw.gemm_plan = {int(k): tuple(v) for k, v in entry.get("gemm", {}).items()}
    return gw
