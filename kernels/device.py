"""Facts about a CUDA device, queried once per device: a query costs ~20 µs of host time,
and these are asked on hot paths (every linear call's dispatch, every Triton launch)."""
from __future__ import annotations

import functools

import torch


@functools.cache
def sm_major(device: torch.device) -> int:
    """The compute capability's major version (8: A100, 9: H100)."""
    return torch.cuda.get_device_capability(device)[0]


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors (1 off CUDA)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
