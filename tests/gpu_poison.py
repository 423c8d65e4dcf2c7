"""Poisoned outputs for the GPU kernel tests."""
import torch


def poison_next_alloc(numel: int, dtype) -> None:
    """Leave a NaN-filled block in the caching allocator: the next output of this size
    reuses it, so an element the kernel forgets to write stays NaN."""
    t = torch.full((numel,), float("nan"), dtype=dtype, device="cuda")
    del t
