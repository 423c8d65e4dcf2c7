"""Programmatic dependent launch (PDL) of the decode kernels, on sm_90+.

A decode step is ~300 short kernels. Launched plainly, each one waits for its predecessor
to finish and flush before its first block starts, then fills its pipeline from DRAM:
a few µs per boundary in which the memory bus idles. Launched programmatically, a
kernel's blocks start once every block of the previous kernel has executed
``griddepcontrol.launch_dependents`` (our kernels do so first thing) and wait
(``griddepcontrol.wait``) only before touching what the previous kernel writes. The woq
GEMV and GEMM stream their weights in meanwhile (``csrc/launch.cuh``); the Triton kernels
of the decoder (``fused.py``, ``decode_attention.py``) wait at their start, which hides
their launch and lets the next GEMV start early -- except the norm before gate/up, which
lets it launch once it has read its inputs: a GEMV's early blocks put their first weight
chunks in flight at once (~15 MB for gate/up), and a small kernel's reads issued right
after are served behind them (``fused.LAUNCH_NEXT``, models/llama.py,
docs/bench/decode_timeline.md).

One switch for all of them: ``WOQ_PDL=0`` in the environment, or ``set_enabled(False)``
(the benchmarks time both).

Tried and dropped: prefetching the next GEMV's weights into L2 on a side stream after each
GEMV of a decode step, to use the gaps this overlap leaves (commit cad9da2,
``benchmarks/l2_prefetch_ab.py`` there). H100, Llama-3-8B-shaped int4, batch-1 graph step:
2702 µs without, 2959 µs with 4 MB per gap (``prefetch.global.L2``), 3202 µs with
``cp.async.bulk.prefetch.L2``, and 2873 µs for the side-stream fork/join alone (no
prefetch issued). A weight already in L2 made a lone GEMV only ~20 % faster (4096 x 4096
int4: 11.0 -> 8.7 µs, one launch), and here the next GEMV streams its first stages early
anyway. Tried again inside the GEMV (each block, after its last weight copy, pulling a
share of the next layer's weight prefix into L2 with ``cp.async.bulk.prefetch.L2``):
no consistent gain, and slower the more it pulled (batch 1 at position 128: 2541 µs
without, 2579 / 2621 / 2686 with 1/8, 1/4, 1/2 of the L2; docs/bench/l2_prefetch_in_gemv.md).
"""
from __future__ import annotations

import functools
import os

import torch

from .device import sm_major

_enabled = os.environ.get("WOQ_PDL", "1") != "0"


def enabled() -> bool:
    return _enabled


def set_enabled(flag: bool) -> None:
    """Turn programmatic launches on or off for every kernel launched from now on (CUDA
    graphs keep the launches they captured)."""
    global _enabled
    _enabled = bool(flag)
    from . import ops  # (lazy: ops imports this module)

    if ops.available():
        torch.ops.woq.set_programmatic_launch(_enabled)


@functools.cache
def _triton_has_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def triton_kwargs(device: torch.device) -> dict:
    """Launch arguments for a Triton kernel of this package with a ``PDL`` constexpr:
    programmatic on sm_90+ when enabled and the installed Triton can launch that way."""
    on = _enabled and device.type == "cuda" and sm_major(device) >= 9 and _triton_has_pdl()
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
