"""The CUDA library's own limits, read from it once (``csrc/torch_binding.cpp``: ``constant``,
``gemm_tile``, ``k_warps``, ``gemm_groups``): Python mirrors no kernel constant. Only
meaningful once the library is loaded (``build.load``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

# How the GEMV's weights reach the tensor cores (csrc/woq_kernels.h, GemvPipeline): a
# shared-memory ring of cp.async stages (any M), or streamed by each warp into registers.
GEMV_RING, GEMV_STREAM = 0, 1


@dataclass(frozen=True)
class Limits:
    gemv_warps: int  # warps of a GEMV block
    gemv_max_m: int  # rows the GEMV takes for any weight
    gemv_wide_max_m: int  # rows it takes for per-channel, g64 and g128 weights
    stream_max_m: int  # rows the register-stream pipeline takes
    dense_gemv_max_m: int
    dense_gemv_max_x_bytes: int  # bytes of x as fp32 a dense-GEMV block holds
    tuning_version: int  # bumped when a kernel's launch space or numerics change
    gemm_tiles: dict[int, tuple[int, int]]  # config -> (block rows, block channels)
    wgmma_configs: frozenset[int]  # configs that need an sm_90a build on sm_90
    gemm_groups: tuple[int, ...]  # group sizes the mixed GEMM takes (and per-channel)
    ring_k_warps: tuple[int, ...]  # k-warp counts of the ring GEMV up to gemv_max_m rows
    ring_wide_k_warps: tuple[int, ...]  # ... above it
    stream_k_warps: tuple[int, ...]

    def gemv_k_warps(self, m: int) -> tuple[int, ...]:
        return self.ring_k_warps if m <= self.gemv_max_m else self.ring_wide_k_warps


_limits: Limits | None = None


def limits() -> Limits:
    """The limits, read once (``build.load`` reads them at load, so that a torch.compile
    trace through an op wrapper finds a constant rather than calls into the library)."""
    global _limits
    if _limits is None:
        _limits = _read()
    return _limits


def _read() -> Limits:
    ops = torch.ops.woq
    tiles = {c: tuple(ops.gemm_tile(c)) for c in range(ops.constant("gemm_configs"))}
    return Limits(
        gemv_warps=ops.constant("gemv_warps"),
        gemv_max_m=(gemv_max_m := ops.constant("gemv_max_m")),
        gemv_wide_max_m=ops.constant("gemv_wide_max_m"),
        stream_max_m=ops.constant("stream_max_m"),
        dense_gemv_max_m=ops.constant("dense_gemv_max_m"),
        dense_gemv_max_x_bytes=ops.constant("dense_gemv_max_x_bytes"),
        tuning_version=ops.constant("tuning_version"),
        gemm_tiles={c: (bm, bn) for c, (bm, bn, _) in tiles.items()},
        wgmma_configs=frozenset(c for c, (_, _, wgmma) in tiles.items() if wgmma),
        gemm_groups=tuple(ops.gemm_groups()),
        ring_k_warps=tuple(ops.k_warps(gemv_max_m, GEMV_RING)),
        ring_wide_k_warps=tuple(ops.k_warps(gemv_max_m + 1, GEMV_RING)),
        stream_k_warps=tuple(ops.k_warps(1, GEMV_STREAM)),
    )
