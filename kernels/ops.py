"""Thin wrappers of the CUDA library's ops: argument checks, the device scratch, and the
launch a caller passes (a layer's plan passes its measured one: ``kernels/plans.py``).
Imported only where the library is loaded (``build.load``)."""
from __future__ import annotations

import contextlib
import math

import torch

from .device import sm_major
from .layout import GpuWeight
from .limits import GEMV_RING, GEMV_STREAM, limits  # noqa: F401 (re-exported)
from .scratch import scratch


def gemv_columns(n: int, k_warps: int, m: int = 1) -> int:
    """Blocks of output channels the ring GEMV cuts ``n`` channels into at ``m`` rows: each
    block has gemv_warps // k_warps n-tiles of 16 channels, twice as many above
    gemv_max_m rows at one k-warp (two n-tiles per warp: csrc/gemv.cuh)."""
    lim = limits()
    tiles_per_warp = 2 if m > lim.gemv_max_m and k_warps == 1 else 1
    return math.ceil(n / (16 * tiles_per_warp * (lim.gemv_warps // k_warps)))


def gemv_stream_columns(n: int, k_warps: int) -> int:
    """Blocks of output channels the register-stream GEMV cuts ``n`` channels into."""
    return math.ceil(n / (16 * (limits().gemv_warps // k_warps)))


def gemm_tiles(m: int, n: int, config: int) -> int:
    """Output tiles of the mixed GEMM for an ``m x n`` output (blocks without split-K)."""
    bm, bn = limits().gemm_tiles[config]
    return math.ceil(m / bm) * math.ceil(n / bn)


def wgmma_configs_available() -> bool:
    """Whether the GEMM's wgmma configurations run on the current device."""
    return torch.ops.woq.wgmma_available()


def gemm_configs() -> list[int]:
    """The mixed GEMM's tile configurations that run on the current device."""
    lim, wgmma = limits(), wgmma_configs_available()
    return [c for c in lim.gemm_tiles if wgmma or c not in lim.wgmma_configs]


def gemm_format(gw: GpuWeight) -> bool:
    """Per-channel, g64 or g128: the formats the mixed GEMM (and the GEMV past gemv_max_m
    rows) take."""
    return gw.per_channel or gw.group_size in limits().gemm_groups


def gemv_rows_limit(gw: GpuWeight) -> int:
    """Rows the GEMV kernel takes for this weight: gemv_wide_max_m for the mixed GEMM's
    formats (so that the tuner can choose between them), else gemv_max_m."""
    lim = limits()
    return lim.gemv_wide_max_m if gemm_format(gw) else lim.gemv_max_m


def supports_mixed_gemm(gw: GpuWeight) -> bool:
    """The mixed GEMM takes per-channel, g64 and g128 weights, on sm_80+ (a T4's 64 KB of
    shared memory hold 2 stages of few of its tiles; there, larger M runs dequant + cuBLAS)."""
    return sm_major(gw.qweight.device) >= 8 and gemm_format(gw)


@contextlib.contextmanager
def shared_memory_limit(nbytes: int):
    """Within the block, the kernels plan their shared-memory rings as if this GPU had at most
    ``nbytes`` per block and per SM (64 KiB: a T4; 99 KiB: an RTX 30/40 or L4; 163 KiB: an
    A100): a large GPU then runs the shallower rings a smaller one gets (tests)."""
    torch.ops.woq.set_shared_memory_limit(nbytes)
    try:
        yield
    finally:
        torch.ops.woq.set_shared_memory_limit(0)


def prepare(gw: GpuWeight) -> GpuWeight:
    """Reserve the device scratch for the layer (at load, before any graph capture)."""
    scratch(gw.qweight.device).reserve(gw)
    return gw


def kernel_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous and 16-byte aligned, as the kernels load it (16-byte units); a copy
    only where it is not (e.g. a view into the middle of a row)."""
    x = x.contiguous()
    if torch.compiler.is_compiling():  # (no data pointer to test in a trace; the op checks it)
        return x
    return x.clone() if x.data_ptr() % 16 else x


def _check_x(x: torch.Tensor, gw: GpuWeight, limit: int) -> None:
    m = x.shape[0] if x.dim() == 2 else 0
    if not 1 <= m <= limit:
        raise ValueError(f"the kernel takes 1 to {limit} rows, got shape {tuple(x.shape)}")
    if x.shape[1] != gw.K:
        raise ValueError(f"x has {x.shape[1]} features, the weight {gw.K}")
    if x.dtype != gw.dtype:
        raise TypeError(f"activations are {x.dtype}, the weight was packed for {gw.dtype}")


def gemv(x: torch.Tensor, gw: GpuWeight, bias: torch.Tensor | None = None, max_blocks: int = 0,
         k_warps: int = 0, pipeline: int = GEMV_RING, swiglu: bool = False,
         stamps: torch.Tensor | None = None) -> torch.Tensor:
    """The GEMV kernel (up to ``gemv_rows_limit(gw)`` rows) with this launch: ``pipeline``
    (GEMV_RING, GEMV_STREAM), ``max_blocks`` and ``k_warps`` (0: the kernel's own choice).
    ``swiglu`` (a ``swiglu_rows`` weight): ``silu(gate) * up``, ``[M, N / 2]``, instead of ``y``.
    ``stamps`` (int64, CUDA): each block's ``%globaltimer`` start and end, ``[blocks, 2]``
    flattened (``kernels/observe.py``; blocks past its length write none)."""
    if swiglu and not gw.swiglu_rows:
        raise ValueError("the SwiGLU epilogue needs a gate/up weight packed with pack_for_gpu(..., gate_up=True)")
    _check_x(x, gw, gemv_rows_limit(gw))
    s = scratch(x.device)
    return torch.ops.woq.gemv(kernel_rows(x), gw.qweight, gw.scales, gw.zeros, bias, gw.bits, gw.group_size, gw.N,
                              gw.K, max_blocks, k_warps, pipeline, swiglu, s.workspace, s.counters, stamps)


def gemm(x: torch.Tensor, gw: GpuWeight, bias: torch.Tensor | None = None, config: int = -1,
         splits: int = 0, stamps: torch.Tensor | None = None) -> torch.Tensor:
    """The mixed GEMM (any M; per-channel, g64, g128 weights) with tile ``config`` (-1: by M)
    and ``splits`` (0: stream-K over one resident wave, else blocks per output tile).
    ``stamps``: as the GEMV's, each block's ``%globaltimer`` start and end."""
    if not supports_mixed_gemm(gw):
        raise ValueError(f"the mixed GEMM takes per-channel or g{limits().gemm_groups} weights on sm_80+, "
                         f"not g{gw.group_size}")
    _check_x(x, gw, 1 << 24)
    s = scratch(x.device)
    return torch.ops.woq.gemm(kernel_rows(x), gw.qweight, gw.scales, gw.zeros, bias, gw.bits, gw.group_size, gw.N,
                              gw.K, config, splits, s.workspace, s.counters, stamps)


def dense_gemv_max_rows(weight: torch.Tensor) -> int:
    """Rows of x the dense GEMV takes for ``weight`` ``[N, K]`` (0: none -- not a contiguous
    16-byte aligned fp16/bf16 CUDA tensor with K a multiple of 8)."""
    n, k = weight.shape
    if not (weight.is_cuda and weight.dtype in (torch.float16, torch.bfloat16) and weight.is_contiguous()
            and weight.data_ptr() % 16 == 0 and k % 8 == 0 and k >= 8 and n >= 1):
        return 0
    lim = limits()
    return min(lim.dense_gemv_max_m, lim.dense_gemv_max_x_bytes // (4 * k))


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               float_out: bool = False) -> torch.Tensor:
    """``x @ weight.T + bias`` for an unquantized ``weight`` ``[N, K]`` and ``x`` ``[M, K]``,
    M <= ``dense_gemv_max_rows(weight)``: fp32 sums, the output rounded to the dtype (with
    ``float_out`` stored as float32 after that rounding: ``y.float()`` in one kernel)."""
    return torch.ops.woq.dense_gemv(kernel_rows(x), weight, bias, float_out)


def dequantize(gw: GpuWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """The dense ``[N, K]`` weight, written into the device's shared scratch buffer by default
    (valid until the next call)."""
    if out is None:
        out = scratch(gw.qweight.device).dense[gw.dtype][: gw.N * gw.K]
    torch.ops.woq.dequantize(gw.qweight, gw.scales, gw.zeros, gw.bits, gw.group_size, gw.N, gw.K, out)
    return out.view(gw.N, gw.K)
