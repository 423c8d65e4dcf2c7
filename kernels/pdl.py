"""Programmatic dependent launch (PDL) of the decode kernels, on sm_90+.

A decode step is a few hundred short kernels. Launched plainly, each one waits for its
predecessor to finish and flush before its first block starts, then fills its pipeline
from DRAM: a few µs per boundary in which the memory bus idles. Launched
programmatically, a kernel's blocks start once every block of the previous kernel has
executed ``griddepcontrol.launch_dependents`` and wait (``griddepcontrol.wait``) only
before touching what the previous kernel writes. The woq GEMV and GEMM stream their
weights in meanwhile (``csrc/launch.cuh``); the Triton kernels of the decoder
(``fused.py``, ``decode_attention.py``) wait at their start, which hides their launch and
lets the next GEMV start early. ``RuntimeOptions.programmatic_launch`` turns it on or off
for all of them (measurements: docs/design/engine.md).
"""
from __future__ import annotations

import functools

import torch

from .device import sm_major


@functools.cache
def _triton_has_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def triton_kwargs(device: torch.device, programmatic: bool) -> dict:
    """Launch arguments for a Triton kernel of this package with a ``PDL`` constexpr:
    programmatic on sm_90+ when asked and the installed Triton can launch that way."""
    on = programmatic and device.type == "cuda" and sm_major(device) >= 9 and _triton_has_pdl()
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
