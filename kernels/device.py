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


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on ``device``; on CUDA copied from pinned memory, queued behind the GPU's
    work: a copy from pageable memory waits for that work to finish (a step queued ahead
    included), and torch's pinned-memory cache keeps the buffer until its copy has run."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
