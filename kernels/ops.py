"""Loading the CUDA kernels and calling them (imported lazily: CPU machines never need it).

Build: an ahead-of-time library (``kernels/_C*.so``, built by ``WOQ_BUILD_CUDA=1 pip
install``, e.g. in the Docker image for sm_75..sm_90) is used when present; otherwise the
sources are JIT-compiled once with torch's cpp_extension + ninja for the GPU at hand,
into ``$WOQ_CACHE/torch_extensions/<hash of sources, torch, arch>``.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from . import pdl
from .cache import cache_dir
from .device import sm_major
from .layout import GpuWeight
from .paths import DEQUANT_CUBLAS, GEMV, GEMV_MAX_M, GEMV_WIDE_MAX_M, MIXED_GEMM  # noqa: F401 (re-exported)

log = logging.getLogger("woq.kernels")

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(sorted(p.name for p in CSRC.glob("*.cu"))) + ("torch_binding.cpp",)  # = setup.py
GEMV_WARPS = 8  # warps per block (csrc/gemv.cuh: kGemvWarps)
K_WARPS = (1, 2, 4)  # warps splitting one n-tile's K (the GEMV; M > 16: gemv_k_warps)
# How the GEMV's weights reach the tensor cores (csrc/woq_kernels.h, GemvPipeline): a
# shared-memory ring of cp.async stages (any M), or streamed by each warp into registers
# (M <= 8, csrc/gemv_stream.cuh). The tuner measures both.
GEMV_RING, GEMV_STREAM = 0, 1
STREAM_MAX_M = 8
STREAM_K_WARPS = (1, 2, 4, 8)  # the register stream's warps per n-tile (8 // k_warps n-tiles per block)
GEMM_GROUPS = (64, 128)  # group sizes the mixed GEMM is instantiated for (and per-channel)
# Mixed-GEMM tile configurations: block rows x block channels (csrc/gemm.cuh); 5..9 use
# Hopper's wgmma and exist only where wgmma_configs_available() (an sm_90a build on sm_90)
GEMM_TILES = {0: (32, 256), 1: (64, 256), 2: (128, 128), 3: (64, 128), 4: (32, 128),
              5: (32, 256), 6: (64, 256), 7: (128, 128), 8: (128, 256), 9: (16, 256)}
GEMM_WGMMA_CONFIGS = (5, 6, 7, 8, 9)
GEMM_TILE_FLOATS = max(bm * bn for bm, bn in GEMM_TILES.values())


def gemv_columns(n: int, k_warps: int, m: int = 1) -> int:
    """Blocks of output channels ("columns") the GEMV cuts ``n`` channels into at ``m`` rows:
    each block has GEMV_WARPS // k_warps n-tiles of 16 channels, twice as many above 16
    rows at one k-warp (two n-tiles per warp: csrc/gemv.cuh, gemv_tiles_per_warp)."""
    tiles_per_warp = 2 if m > GEMV_MAX_M and k_warps == 1 else 1
    return math.ceil(n / (16 * tiles_per_warp * (GEMV_WARPS // k_warps)))


def gemv_stream_columns(n: int, k_warps: int) -> int:
    """Blocks of output channels the register-stream GEMV cuts ``n`` channels into: each
    block has GEMV_WARPS // k_warps n-tiles (its grid is these columns x the splits of K)."""
    return math.ceil(n / (16 * (GEMV_WARPS // k_warps)))


def gemm_tiles(m: int, n: int, config: int) -> int:
    """Output tiles of the mixed GEMM for an ``m x n`` output (blocks without split-K)."""
    bm, bn = GEMM_TILES[config]
    return math.ceil(m / bm) * math.ceil(n / bn)


def wgmma_configs_available() -> bool:
    """Whether the GEMM's wgmma configurations run on the current device."""
    return available() and torch.ops.woq.wgmma_available()


def gemm_configs() -> list[int]:
    """The mixed GEMM's tile configurations that run on the current device."""
    wgmma = wgmma_configs_available()
    return [c for c in GEMM_TILES if wgmma or c not in GEMM_WGMMA_CONFIGS]


def _source_hash() -> str:
    h = hashlib.sha256()
    for f in sorted(CSRC.iterdir()):
        if f.suffix in (".cu", ".cuh", ".cpp", ".h"):
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:12]


def _build_jit() -> None:
    from torch.utils.cpp_extension import load

    major, minor = torch.cuda.get_device_capability()
    # H100/H200: the sm_90a target, whose wgmma the mixed GEMM's configurations 5..9 use.
    # WOQ_BUILT_SM90A tells the host code that the library holds them: only when the arch
    # list really has 9.0a (a TORCH_CUDA_ARCH_LIST of plain 9.0 builds their bodies empty).
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}" + ("a" if (major, minor) == (9, 0) else ""))
    sm90a = "9.0a" in os.environ["TORCH_CUDA_ARCH_LIST"].replace(" ", ";").split(";")
    arch = f"{major}{minor}" + ("a" if sm90a else "")
    # WOQ_NVCC_FLAGS: extra nvcc flags for experiments (benchmarks/gemv_variants.py)
    extra = os.environ.get("WOQ_NVCC_FLAGS", "").split() + (["-DWOQ_BUILT_SM90A"] if sm90a else [])
    tag = f"{_source_hash()}-torch{torch.__version__.split('+')[0]}-cu{torch.version.cuda}-sm{arch}"
    if os.environ.get("WOQ_NVCC_FLAGS"):
        tag += "-x" + hashlib.sha256(" ".join(extra).encode()).hexdigest()[:8]
    build_dir = cache_dir() / "torch_extensions" / tag
    build_dir.mkdir(parents=True, exist_ok=True)
    log.info("building woq CUDA kernels for sm_%s (once, cached in %s)", arch, build_dir)
    load(
        name=f"woq_kernels_{tag.replace('-', '_').replace('.', '_')}",
        sources=[str(CSRC / s) for s in SOURCES],
        # No -std flag: cpp_extension picks the standard its torch headers need.
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "-Xptxas=-warn-spills", *extra],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=bool(os.environ.get("WOQ_VERBOSE_BUILD")),
    )


@functools.cache
def load() -> bool:
    """Load (building if needed) the kernels; False, with a warning, if that fails."""
    if not torch.cuda.is_available():
        return False
    aot = sorted(Path(__file__).parent.glob("_C*.so"))
    try:
        if aot and not os.environ.get("WOQ_FORCE_JIT"):
            torch.ops.load_library(str(aot[0]))
        else:
            _build_jit()
    except Exception as exc:  # no compiler, unsupported GPU...: the reference path still works
        log.warning("woq CUDA kernels unavailable (%s); using the torch reference path", exc)
        return False
    _register_fakes()
    torch.ops.woq.set_programmatic_launch(pdl.enabled())
    return True


def available() -> bool:
    return load()


def _register_fakes() -> None:
    """Shape functions, so torch.compile can trace through the custom ops."""
    if getattr(_register_fakes, "done", False):
        return

    @torch.library.register_fake("woq::gemv")
    def _gemv_fake(x, qweight, scales, zeros, bias, bits, group_size, n, k, max_blocks, k_warps, pipeline, swiglu,
                   workspace, counters):
        return x.new_empty(x.shape[0], n // 2 if swiglu else n)

    @torch.library.register_fake("woq::attention_gemv")
    def _attention_gemv_fake(qkv, positions, slots, lengths, cos, sin, k_cache, v_cache, heads, head_dim, part, lse,
                             merge_counters, flags, qweight, scales, zeros, bias, bits, group_size, n, k, max_blocks,
                             k_warps, workspace, counters):
        return qkv.new_empty(qkv.shape[0], n)

    @torch.library.register_fake("woq::gemm")
    def _gemm_fake(x, qweight, scales, zeros, bias, bits, group_size, n, k, config, splits, workspace, counters):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("woq::dense_gemv")
    def _dense_gemv_fake(x, weight, bias, float_out):
        return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32 if float_out else x.dtype)

    @torch.library.register_fake("woq::dequantize")
    def _dequantize_fake(qweight, scales, zeros, bits, group_size, n, k, out):
        return None

    _register_fakes.done = True


# --- per-device scratch: partial sums and counters, the dequantized-weight buffer ------


class _Scratch:
    """Buffers shared by every layer of a device, sized at load time for the largest layer
    (never reallocated while serving, so CUDA graphs can capture the pointers)."""

    def __init__(self, device: torch.device):
        self.device = device
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.sms = sms
        # Partial sums. GEMV: 2 x 32 rows x 128 channels per block, for up to 4 resident
        # blocks per SM (its 256-channel columns, above 16 rows at one k-warp, run 1 per
        # SM). Mixed GEMM: two tiles per block, one resident wave of its largest tiles
        # (128 x 128, one block per SM; twice as many of the 64 x 128 ones, two per SM).
        # The launchers cap their grids so as never to exceed it.
        floats = max(4 * sms * 2 * GEMV_WIDE_MAX_M * GEMV_WARPS * 16, 2 * sms * GEMM_TILE_FLOATS)
        self.workspace = torch.empty(floats, dtype=torch.float32, device=device)
        self.counters = torch.zeros(2 * sms, dtype=torch.int32, device=device)
        # attention_gemv: its 2 flags, then one merge counter per (sequence, KV head)
        self.attention_counters = torch.zeros(2 + ATTENTION_MAX_PAIRS, dtype=torch.int32, device=device)
        self.dense: dict[torch.dtype, torch.Tensor] = {}

    def reserve(self, gw: GpuWeight) -> None:
        from .tuning import GEMM_MS

        # GEMV: one counter per column (the narrowest columns, one n-tile of the register
        # stream: the most); the mixed GEMM: one per output tile, for its smallest tile up to
        # the largest M the tuner lets it serve (beyond, it runs one block per tile, which
        # needs none)
        cols = max(gemv_stream_columns(gw.N, max(STREAM_K_WARPS)), 2 * self.sms,
                   max(gemm_tiles(max(GEMM_MS), gw.N, c) for c in GEMM_TILES))
        if self.counters.numel() < cols:
            self.counters = torch.zeros(cols, dtype=torch.int32, device=self.device)
        dense = self.dense.get(gw.dtype)
        if dense is None or dense.numel() < gw.N * gw.K:
            self.dense[gw.dtype] = torch.empty(gw.N * gw.K, dtype=gw.dtype, device=self.device)


_scratch: dict[torch.device, _Scratch] = {}


def scratch(device: torch.device) -> _Scratch:
    if device not in _scratch:
        _scratch[device] = _Scratch(device)
    return _scratch[device]


# The M at which the GEMV's launch (k-warps, grid) is measured, each standing for the Ms
# up to it. The kernel's shared memory, hence the blocks an SM holds, grows with M
# (csrc/gemv.cuh), so a grid measured at M = 8 can crowd some SMs and idle others at M = 2
# (H100, 14336 x 4096 int8: 31.3 us at M = 2 against 27.3 at M = 8, same grid).
# 17, 24 and 32: the kernel's 3 and 4 row blocks, measured for the weights that allow them
# (17 as well as 24: where the GEMV loses to the mixed GEMM at 24 rows it can still win at
# 17, the first M past a decode batch of 16 -- H100, 14336 x 4096 int4 21.3 against 22.6 us,
# 4096 x 14336 int8 27.4 against 29.6 -- and the reach it is given follows the M measured).
GEMV_TUNED_MS = (1, 2, 4, 8, 16, 17, 24, 32)


def gemv_tuning_m(m: int) -> int:
    """The measured M whose GEMV launch serves M rows."""
    return next(t for t in GEMV_TUNED_MS if m <= t)


def gemv_tuned_grid(gw: GpuWeight, m: int) -> tuple[int, int, int]:
    """(k-warps, blocks, pipeline) measured for M rows: at ``gemv_tuning_m(m)``, else (a table
    from before that M was measured) at the next M measured, else (0, 0, ring): the kernel's
    own choice. A register-stream launch serves only the Ms it takes (<= STREAM_MAX_M)."""
    first = gemv_tuning_m(m)
    for t in GEMV_TUNED_MS:
        if t >= first and t in gw.grids:
            k_warps, blocks, *pipeline = gw.grids[t]  # (tables before the register stream: 2 entries)
            pipeline = pipeline[0] if pipeline else GEMV_RING
            if pipeline == GEMV_STREAM and m > STREAM_MAX_M:
                continue
            return k_warps, blocks, pipeline
    return 0, 0, GEMV_RING


def _gemm_format(gw: GpuWeight) -> bool:
    """Per-channel, g64 or g128: the formats the mixed GEMM (and the GEMV past 16 rows) take."""
    return gw.per_channel or gw.group_size in GEMM_GROUPS


def gemv_rows_limit(gw: GpuWeight) -> int:
    """Rows the GEMV kernel takes for this weight: 32 for per-channel, g64 and g128 weights
    (the formats the mixed GEMM takes too, so that the tuner can choose), else 16."""
    return GEMV_WIDE_MAX_M if _gemm_format(gw) else GEMV_MAX_M


def gemv_k_warps(m: int) -> tuple[int, ...]:
    """The k-warp counts the GEMV is built for at M = m: 1, 2, 4; above 16 rows 1, 2 (an
    int4 stage of 4 k-warps and 32 rows of x is ~82 KB: even an H100 holds only 2 stages)."""
    return K_WARPS if m <= GEMV_MAX_M else tuple(kw for kw in K_WARPS if kw <= 2)


def supports_mixed_gemm(gw: GpuWeight) -> bool:
    """The mixed GEMM takes per-channel, g64 and g128 weights, on sm_80+ (a T4's 64 KB of
    shared memory hold 2 stages of few of its tiles; there, M > 16 runs dequantize + cuBLAS)."""
    return sm_major(gw.qweight.device) >= 8 and _gemm_format(gw)


@contextlib.contextmanager
def shared_memory_limit(nbytes: int):
    """Within the block, the kernels plan their shared-memory rings as if this GPU had at most
    ``nbytes`` per block and per SM (64 KiB: a T4; 99 KiB: an RTX 30/40 or L4; 163 KiB: an
    A100): a large GPU then runs the shallower rings a smaller one gets (tests)."""
    if not load():
        raise RuntimeError("the woq CUDA kernels are not available")
    torch.ops.woq.set_shared_memory_limit(nbytes)
    try:
        yield
    finally:
        torch.ops.woq.set_shared_memory_limit(0)


def prepare(gw: GpuWeight, tune: bool = False) -> GpuWeight:
    """Reserve the device scratch for the layer and, with ``tune``, set its measured launches."""
    scratch(gw.qweight.device).reserve(gw)
    if tune:
        from .tuning import apply

        apply(gw)
    return gw


# --- calls -------------------------------------------------------------------------------


def _check_x(x: torch.Tensor, gw: GpuWeight, limit: int) -> None:
    m = x.shape[0] if x.dim() == 2 else 0
    if not 1 <= m <= limit:
        raise ValueError(f"the kernel takes 1 to {limit} rows, got shape {tuple(x.shape)}")
    if x.shape[1] != gw.K:
        raise ValueError(f"x has {x.shape[1]} features, the weight {gw.K}")


def gemv(x: torch.Tensor, gw: GpuWeight, bias: torch.Tensor | None = None, max_blocks: int | None = None,
         k_warps: int | None = None, pipeline: int | None = None, swiglu: bool = False) -> torch.Tensor:
    """The GEMV kernel (M <= 16; <= 32 for the weights ``gemv_rows_limit`` allows).
    Without overrides, the measured launch. ``pipeline`` (GEMV_RING, GEMV_STREAM; GEMV_RING
    when only a grid is given), ``max_blocks`` and ``k_warps`` override it (0: the kernel's
    own choice; the measured values fill in those not given where its pipeline matches).
    ``swiglu`` (a ``swiglu_rows`` weight): ``silu(gate) * up``, ``[M, N / 2]``, instead of ``y``."""
    if swiglu and not gw.swiglu_rows:
        raise ValueError("the SwiGLU epilogue needs a gate/up weight packed with pack_for_gpu(..., gate_up=True)")
    limit = gemv_rows_limit(gw)
    if x.dim() == 2 and x.shape[0] > limit:
        raise ValueError(f"the GEMV takes 1 to {limit} rows for this weight (up to {GEMV_WIDE_MAX_M} for per-channel, "
                         f"g64 and g128 weights), got shape {tuple(x.shape)}")
    _check_x(x, gw, limit)
    tuned_k_warps, tuned_blocks, tuned_pipeline = gemv_tuned_grid(gw, x.shape[0])
    if pipeline is None:
        pipeline = tuned_pipeline if max_blocks is None and k_warps is None else GEMV_RING
    if pipeline != tuned_pipeline:
        tuned_k_warps = tuned_blocks = 0
    blocks = tuned_blocks if max_blocks is None else max_blocks
    k_warps = tuned_k_warps if k_warps is None else k_warps
    s = scratch(x.device)
    return torch.ops.woq.gemv(x, gw.qweight, gw.scales, gw.zeros, bias, gw.bits, gw.group_size, gw.N, gw.K,
                              blocks, k_warps, pipeline, swiglu, s.workspace, s.counters)


# The GEMV that does a decode step's attention first (csrc/attention.cuh): its shares per
# (sequence, KV head) -- at most; the launcher fits them to the grid --, the (sequence, KV
# head) pairs its counters cover, and the weight formats it is built for.
ATTENTION_MAX_SPLITS = 16
ATTENTION_MAX_PAIRS = 4096
ATTENTION_MAX_GROUP = 8  # query heads per KV head
ATTENTION_MAX_GROUP_DIMS = 2048  # query heads per KV head x head_dim
ATTENTION_MAX_HEAD_DIM = 256


def attention_gemv_supported(gw: GpuWeight, batch: int, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether ``attention_gemv`` takes this o projection at this batch: the register-stream
    GEMV's rows, a per-channel or g128 weight, a head shape its roles take."""
    group = heads // kv_heads if kv_heads and heads % kv_heads == 0 else 0
    return (1 <= batch <= STREAM_MAX_M and batch * kv_heads <= ATTENTION_MAX_PAIRS and (gw.per_channel or gw.group_size == 128)
            and 1 <= group <= ATTENTION_MAX_GROUP and head_dim % 16 == 0 and head_dim <= ATTENTION_MAX_HEAD_DIM
            and group * head_dim <= ATTENTION_MAX_GROUP_DIMS
            and heads * head_dim == gw.K and not gw.swiglu_rows)


def attention_gemv(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int,
                   head_dim: int, gw: GpuWeight, bias: torch.Tensor | None = None, max_blocks: int | None = None,
                   k_warps: int | None = None) -> torch.Tensor:
    """A decode step's attention and the o projection ``gw`` of its output in one GEMV launch
    (csrc/attention.cuh): ``qkv`` ``[B, (heads + 2 kv_heads) head_dim]``, q and k rotated at
    ``positions`` ``[B]`` (``cos``/``sin``: fp32 ``[max_len, head_dim]``), k and v stored at
    that position of slot ``slots[b]`` of ``k_cache``/``v_cache`` ``[S, kv_heads, T, head_dim]``,
    attention over ``lengths[b]`` positions; ``[B, N]``. The measured register-stream launch
    of ``gw`` at B rows where there is one, else the kernel's own grid; ``max_blocks`` and
    ``k_warps`` override it (as ``gemv``'s; tests)."""
    B = qkv.shape[0]
    if not attention_gemv_supported(gw, B, heads, k_cache.shape[1], head_dim):
        raise ValueError("attention_gemv takes per-channel or g128 o projections at 1 to "
                         f"{STREAM_MAX_M} rows and at most {ATTENTION_MAX_GROUP} query heads per KV head")
    if qkv.dtype != gw.dtype:
        raise TypeError(f"activations are {qkv.dtype}, the weight was packed for {gw.dtype}")
    tuned_k_warps, tuned_blocks, pipeline = gemv_tuned_grid(gw, B)
    if pipeline != GEMV_STREAM:
        tuned_k_warps = tuned_blocks = 0
    blocks = tuned_blocks if max_blocks is None else max_blocks
    k_warps = tuned_k_warps if k_warps is None else k_warps
    s = scratch(qkv.device)
    part = torch.empty(B, ATTENTION_MAX_SPLITS, heads, head_dim, dtype=torch.float32, device=qkv.device)
    lse = torch.empty(B, ATTENTION_MAX_SPLITS, k_cache.shape[1], ATTENTION_MAX_GROUP, dtype=torch.float32,
                      device=qkv.device)  # (a KV head's group in one 32-byte slot: csrc/attention.cuh)
    flags, merge = s.attention_counters[:2], s.attention_counters[2:]
    return torch.ops.woq.attention_gemv(qkv, positions, slots, lengths, cos, sin, k_cache, v_cache, heads, head_dim,
                                        part, lse, merge, flags, gw.qweight, gw.scales, gw.zeros, bias, gw.bits,
                                        gw.group_size, gw.N, gw.K, blocks, k_warps, s.workspace, s.counters)


def gemm_launch(m: int, gw: GpuWeight) -> tuple[int, int]:
    """(tile config, split-K) for M rows: the measured plan's smallest bound >= M (its
    largest beyond them), or the kernel's own choice (-1, 0) without one. Split-K 0: one
    resident wave of blocks sharing the tiles' stages evenly (stream-K, csrc/gemm.cuh)."""
    if not gw.gemm_plan:
        return -1, 0
    bounds = sorted(gw.gemm_plan)
    bound = next((b for b in bounds if b >= m), bounds[-1])
    return tuple(gw.gemm_plan[bound])


def gemm(x: torch.Tensor, gw: GpuWeight, bias: torch.Tensor | None = None, config: int | None = None,
         splits: int | None = None) -> torch.Tensor:
    """The mixed GEMM (any M; per-channel, g64, g128 weights). ``config`` (GEMM_TILES) and
    ``splits`` override the measured launch (config -1: by M; splits 0: stream-K over
    one resident wave, else blocks per output tile)."""
    if not supports_mixed_gemm(gw):
        raise ValueError(f"the mixed GEMM takes per-channel or g{GEMM_GROUPS} weights on sm_80+, "
                         f"not g{gw.group_size}")
    _check_x(x, gw, 1 << 24)
    tuned_config, tuned_splits = gemm_launch(x.shape[0], gw)
    config = tuned_config if config is None else config
    splits = tuned_splits if splits is None else splits
    s = scratch(x.device)
    return torch.ops.woq.gemm(x, gw.qweight, gw.scales, gw.zeros, bias, gw.bits, gw.group_size, gw.N, gw.K,
                              config, splits, s.workspace, s.counters)


def _kernel_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous and 16-byte aligned, as the kernels load it (16-byte units); a copy
    only where it is not (e.g. a view into the middle of a row)."""
    x = x.contiguous()
    return x.clone() if x.data_ptr() % 16 else x


# The dense GEMV (csrc/dense_gemv.cuh): rows of x it takes, and the bytes of x as fp32 its
# blocks hold (csrc/woq_kernels.h, kDenseGemvMaxRows, kDenseGemvMaxXBytes).
DENSE_GEMV_MAX_M = 4
DENSE_GEMV_MAX_X_BYTES = 64 * 1024


def dense_gemv_max_rows(weight: torch.Tensor) -> int:
    """Rows of x the dense GEMV takes for ``weight`` ``[N, K]`` (0: none -- not a contiguous
    16-byte aligned fp16/bf16 CUDA tensor with K a multiple of 8)."""
    n, k = weight.shape
    if not (weight.is_cuda and weight.dtype in (torch.float16, torch.bfloat16) and weight.is_contiguous()
            and weight.data_ptr() % 16 == 0 and k % 8 == 0 and k >= 8 and n >= 1):
        return 0
    return min(DENSE_GEMV_MAX_M, DENSE_GEMV_MAX_X_BYTES // (4 * k))


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               float_out: bool = False) -> torch.Tensor:
    """``x @ weight.T + bias`` for an unquantized ``weight`` ``[N, K]`` and ``x`` ``[M, K]``,
    M <= ``dense_gemv_max_rows(weight)``: fp32 sums, the output rounded to the dtype (with
    ``float_out`` stored as float32 after that rounding: ``y.float()`` in one kernel)."""
    return torch.ops.woq.dense_gemv(_kernel_rows(x), weight, bias, float_out)


def dequantize(gw: GpuWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """The dense ``[N, K]`` weight, written into the device's shared scratch buffer by default
    (valid until the next call)."""
    if out is None:
        out = scratch(gw.qweight.device).dense[gw.dtype][: gw.N * gw.K]
    torch.ops.woq.dequantize(gw.qweight, gw.scales, gw.zeros, gw.bits, gw.group_size, gw.N, gw.K, out)
    return out.view(gw.N, gw.K)


def run_path(path: str, x: torch.Tensor, gw: GpuWeight, bias: torch.Tensor | None,
             swiglu: bool = False) -> torch.Tensor:
    """``y = x @ W.T + bias`` through ``path`` (rows in the weight's order: a ``swiglu_rows``
    weight's interleaved); with ``swiglu``, SwiGLU's ``silu(gate) * up`` of it, ``[M, N / 2]``:
    in the GEMV's epilogue where the rows allow, else by ``fused.silu_mul``."""
    if x.dtype != gw.dtype:
        raise TypeError(f"activations are {x.dtype}, the weight was packed for {gw.dtype}")
    x = _kernel_rows(x)
    if path == GEMV:
        epilogue = swiglu and gw.swiglu_rows
        y = gemv(x, gw, bias, swiglu=epilogue)
        if epilogue:
            return y
    elif path == MIXED_GEMM:
        y = gemm(x, gw, bias)
    elif path == DEQUANT_CUBLAS:
        y = F.linear(x, dequantize(gw), bias)
    else:
        raise ValueError(f"unknown kernel path {path!r}")
    if not swiglu:
        return y
    from .fused import silu_mul

    return silu_mul(y, interleaved=gw.swiglu_rows)
