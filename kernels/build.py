"""Loading the CUDA library: the ahead-of-time build when installed, else a JIT build.

An ahead-of-time library (``kernels/_C*.so``, built by ``WOQ_BUILD_CUDA=1 pip install``,
e.g. in the Docker image for sm_75..sm_90a) is used when present; otherwise the sources
are compiled once with torch's cpp_extension + ninja for the GPU at hand, into
``<cache>/torch_extensions/<hash of the sources, torch, arch>``. CPU machines never
import this module's CUDA side: ``available`` is False without CUDA.
"""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch

from .options import RuntimeOptions

log = logging.getLogger("woq.kernels")

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(sorted(p.name for p in CSRC.glob("*.cu"))) + ("torch_binding.cpp",)  # = setup.py


def source_hash() -> str:
    """A hash of every source byte: names the JIT build (any edit rebuilds)."""
    h = hashlib.sha256()
    for f in sorted(CSRC.iterdir()):
        if f.suffix in (".cu", ".cuh", ".cpp", ".h"):
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:12]


def _build_jit(build_root: Path) -> None:
    from torch.utils.cpp_extension import load

    major, minor = torch.cuda.get_device_capability()
    # H100/H200: the sm_90a target, whose wgmma the mixed GEMM's configurations 5..9 use;
    # WOQ_BUILT_SM90A tells the host code that the library holds them. An explicit -gencode
    # makes cpp_extension add no arch flags of its own.
    arch = f"{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")
    gencode = [f"-gencode=arch=compute_{arch},code=sm_{arch}"] + (["-DWOQ_BUILT_SM90A"] if arch == "90a" else [])
    tag = f"{source_hash()}-torch{torch.__version__.split('+')[0]}-cu{torch.version.cuda}-sm{arch}"
    build_dir = build_root / tag
    build_dir.mkdir(parents=True, exist_ok=True)
    log.info("building woq CUDA kernels for sm_%s (once, cached in %s)", arch, build_dir)
    load(
        name=f"woq_kernels_{tag.replace('-', '_').replace('.', '_')}",
        sources=[str(CSRC / s) for s in SOURCES],
        # No -std flag: cpp_extension picks the standard its torch headers need.
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "-Xptxas=-warn-spills", *gencode],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=bool(os.environ.get("WOQ_VERBOSE_BUILD")),
    )


_loaded: bool | None = None  # whether the library is in this process (decided by the first load)


def _load(build_root: Path) -> bool:
    """Load the library once per process: its ops are registered process-wide, so a later
    load with another cache directory uses the library already there."""
    global _loaded
    if _loaded is None:
        _loaded = _load_once(build_root)
    return _loaded


def _load_once(build_root: Path) -> bool:
    if not torch.cuda.is_available():
        return False
    aot = sorted(Path(__file__).parent.glob("_C*.so"))
    try:
        if aot and not os.environ.get("WOQ_FORCE_JIT"):
            torch.ops.load_library(str(aot[0]))
        else:
            _build_jit(build_root)
    except Exception as exc:  # no compiler, unsupported GPU...: the reference path still works
        log.warning("woq CUDA kernels unavailable (%s); using the torch reference path", exc)
        return False
    _register_fakes()
    return True


def load(options: RuntimeOptions) -> bool:
    """Load (building if needed) the kernels and apply the options' launch settings; False,
    with a warning, where that fails. The library is process-wide: the programmatic-launch
    setting is its launch attribute for every kernel launched from then on (CUDA graphs keep
    the launches they captured)."""
    if not _load(options.extensions_dir()):
        return False
    torch.ops.woq.set_programmatic_launch(options.programmatic_launch)
    from .limits import limits

    limits()
    return True


def _register_fakes() -> None:
    """Shape functions, so torch.compile can trace through the custom ops."""

    @torch.library.register_fake("woq::gemv")
    def _gemv_fake(x, qweight, scales, zeros, bias, bits, group_size, n, k, max_blocks, k_warps, pipeline, swiglu,
                   workspace, counters, stamps=None):
        return x.new_empty(x.shape[0], n // 2 if swiglu else n)

    @torch.library.register_fake("woq::gemm")
    def _gemm_fake(x, qweight, scales, zeros, bias, bits, group_size, n, k, config, splits, workspace, counters):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("woq::dense_gemv")
    def _dense_gemv_fake(x, weight, bias, float_out):
        return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32 if float_out else x.dtype)

    @torch.library.register_fake("woq::dequantize")
    def _dequantize_fake(qweight, scales, zeros, bits, group_size, n, k, out):
        return None
