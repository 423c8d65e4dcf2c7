"""Loading the CUDA kernels and calling them (imported lazily: CPU machines never need it).

Build: an ahead-of-time library (``kernels/_C*.so``, built by ``WOQ_BUILD_CUDA=1 pip
install``, e.g. in the Docker image for sm_75..sm_90) is used when present; otherwise the
sources are JIT-compiled once with torch's cpp_extension + ninja for the GPU at hand,
into ``$WOQ_CACHE/torch_extensions/<hash of sources, torch, arch>``.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from .cache import cache_dir
from .layout import GpuWeight, tile_k
from .paths import DEQUANT_CUBLAS, GEMV, MIXED_GEMM

log = logging.getLogger("woq.kernels")

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("woq_kernels.cu", "gemv_fp16.cu", "gemv_bf16.cu", "torch_binding.cpp")
GEMV_WARPS = 8  # n-tiles per block (csrc/gemv.cuh: kGemvWarps)
GEMV_STEPS = 4  # 16-byte lane loads per pipeline stage (kGemvSteps): split-K divides stages
GEMV_MAX_M = 16


def _source_hash() -> str:
    h = hashlib.sha256()
    for f in sorted(CSRC.iterdir()):
        if f.suffix in (".cu", ".cuh", ".cpp", ".h"):
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:12]


def _build_jit() -> None:
    from torch.utils.cpp_extension import load

    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}"
    tag = f"{_source_hash()}-torch{torch.__version__.split('+')[0]}-cu{torch.version.cuda}-sm{arch}"
    build_dir = cache_dir() / "torch_extensions" / tag
    build_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
    log.info("building woq CUDA kernels for sm_%s (once, cached in %s)", arch, build_dir)
    load(
        name=f"woq_kernels_{tag.replace('-', '_').replace('.', '_')}",
        sources=[str(CSRC / s) for s in SOURCES],
        # No -std flag: the binding must be compiled with the standard libtorch was built
        # with (a mismatched one crashed every TORCH_CHECK error path on the H100 image).
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "-Xptxas=-warn-spills"],
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
    return True


def available() -> bool:
    return load()


def _register_fakes() -> None:
    """Shape functions, so torch.compile can trace through the custom ops."""
    if getattr(_register_fakes, "done", False):
        return

    @torch.library.register_fake("woq::gemv")
    def _gemv_fake(x, qweight, scales, zeros, bias, bits, group_size, n, k, split_k, workspace, counters):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("woq::dequantize")
    def _dequantize_fake(qweight, scales, zeros, bits, group_size, n, k, out):
        return None

    _register_fakes.done = True


# --- per-device scratch: split-K workspace and counters, the dequantized-weight buffer ---


class _Scratch:
    """Buffers shared by every layer of a device, sized at load time for the largest layer
    (never reallocated while serving, so CUDA graphs can capture the pointers)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.workspace = torch.empty(0, dtype=torch.float32, device=device)
        self.counters = torch.zeros(0, dtype=torch.int32, device=device)
        self.dense: dict[torch.dtype, torch.Tensor] = {}

    def reserve(self, gw: GpuWeight) -> None:
        n_pad = gw.n_tiles * 16
        ws = gw.split_k * 16 * n_pad
        if self.workspace.numel() < ws:
            self.workspace = torch.empty(ws, dtype=torch.float32, device=self.device)
        cols = math.ceil(gw.n_tiles / GEMV_WARPS)
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


def default_split_k(gw: GpuWeight, sm_count: int | None = None) -> int:
    """Split K until the grid has about two blocks per SM (each block holds 8 n-tiles)."""
    sm_count = sm_count or torch.cuda.get_device_properties(gw.qweight.device).multi_processor_count
    columns = math.ceil(gw.n_tiles / GEMV_WARPS)
    stages = math.ceil(gw.K_pad / (GEMV_STEPS * tile_k(gw.bits)))
    return max(1, min(stages, math.ceil(2 * sm_count / columns)))


def prepare(gw: GpuWeight, split_k: int | None = None) -> GpuWeight:
    """Choose the layer's launch configuration and reserve the device scratch for it."""
    gw.split_k = split_k or default_split_k(gw)
    scratch(gw.qweight.device).reserve(gw)
    return gw


# --- calls -------------------------------------------------------------------------------


def gemv(x: torch.Tensor, gw: GpuWeight, bias: torch.Tensor | None = None, split_k: int | None = None) -> torch.Tensor:
    # Checked here as well as in C++: an error raised from the extension crashed the
    # process on the torch 2.11 image (benchmarks/check_errors.py), a Python one cannot.
    if x.dim() != 2 or not 1 <= x.shape[0] <= GEMV_MAX_M:
        raise ValueError(f"the GEMV takes 1 to {GEMV_MAX_M} rows, got shape {tuple(x.shape)}")
    if x.shape[1] != gw.K:
        raise ValueError(f"x has {x.shape[1]} features, the weight {gw.K}")
    s = scratch(x.device)
    return torch.ops.woq.gemv(x, gw.qweight, gw.scales, gw.zeros, bias, gw.bits, gw.group_size, gw.N, gw.K,
                              split_k or gw.split_k, s.workspace, s.counters)


def dequantize(gw: GpuWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """The dense ``[N, K]`` weight, written into the device's shared scratch buffer by default
    (valid until the next call)."""
    if out is None:
        out = scratch(gw.qweight.device).dense[gw.dtype][: gw.N * gw.K]
    torch.ops.woq.dequantize(gw.qweight, gw.scales, gw.zeros, gw.bits, gw.group_size, gw.N, gw.K, out)
    return out.view(gw.N, gw.K)


def run_path(path: str, x: torch.Tensor, gw: GpuWeight, bias: torch.Tensor | None) -> torch.Tensor:
    if x.dtype != gw.dtype:
        raise TypeError(f"activations are {x.dtype}, the weight was packed for {gw.dtype}")
    x = x.contiguous()
    if path == GEMV:
        return gemv(x, gw, bias)
    if path in (DEQUANT_CUBLAS, MIXED_GEMM):
        return F.linear(x, dequantize(gw), bias)
    raise ValueError(f"unknown kernel path {path!r}")
