"""A one-shot all-reduce over peer GPU memory, for tensor parallelism's small messages.

A decode step all-reduces two row-parallel outputs a layer, each batch x hidden values:
8 KiB at batch 1 of an 8B model. NCCL's ring pays several protocol steps for that; here
every rank copies its tensor into its own buffer, which the other ranks map through CUDA
IPC, each GPU then reads every rank's copy and sums them (``csrc/peer_all_reduce.cu``: the
layout and the epoch protocol). Larger messages, and groups whose GPUs cannot reach each
other's memory (PCIe without peer access, other hosts), go through NCCL. Every rank picks
the same path for the same tensor (its size and dtype decide), or the group would hang.

Graph-capturable: the buffers and the epochs are device state. No multicast (NVLS) object
is created.

Each rank's allocation also holds an area of the persistent decode step's (``step_areas``:
its counters and rows under tensor parallelism, ``csrc/decode_step.cuh``), opened by the
other ranks with the rest.
"""
from __future__ import annotations

import logging
import socket

import torch
import torch.distributed as dist

log = logging.getLogger("woq.kernels")

# Bytes of each of a rank's two data buffers: the largest message taken. A decode step of
# 64 rows of an 8192-wide model is 1 MiB in fp16.
DEFAULT_CAPACITY = 1 << 20


class PeerAllReduce:
    """This rank's side of the group's peer buffers (``open``); ``takes(x)`` says whether a
    tensor goes through it, ``__call__`` all-reduces it in place."""

    def __init__(self, bases: list[int], rank: int, capacity: int, device: torch.device):
        self.bases, self.rank, self.capacity = bases, rank, capacity
        self.counters = torch.zeros(torch.ops.woq.constant("peer_blocks"), dtype=torch.int32, device=device)

    @classmethod
    def open(cls, rank: int, size: int, device: torch.device, loaded: bool, group=None,
             capacity: int = DEFAULT_CAPACITY) -> "PeerAllReduce | None":
        """Allocate this rank's buffers and map the others' (a collective: every rank of
        ``group``, a host-side one that carries the handles, calls it); None on every rank
        unless every rank has the kernels ``loaded``, all share one host and each GPU can
        reach every other's memory."""
        where = (socket.gethostname(), device.index)
        everyone = [None] * size
        dist.all_gather_object(everyone, where, group=group)
        same_host = all(host == where[0] for host, _ in everyone)
        reach = loaded and same_host and size <= torch.ops.woq.constant("peer_max_ranks") and all(
            torch.cuda.can_device_access_peer(device.index, other) for _, other in everyone if other != device.index)
        votes = [None] * size
        dist.all_gather_object(votes, reach, group=group)
        if not all(votes):
            log.info("peer all-reduce off: not every rank's GPU reaches the others' memory; NCCL for every size")
            return None
        signal = torch.ops.woq.constant("peer_signal_bytes")
        with torch.cuda.device(device):
            own = torch.ops.woq.peer_alloc(signal + 2 * capacity + torch.ops.woq.constant("step_peer_area_bytes"))
            handle = torch.ops.woq.peer_handle(own).tolist()
        handles = [None] * size
        dist.all_gather_object(handles, handle, group=group)
        with torch.cuda.device(device):
            bases = [own if r == rank else torch.ops.woq.peer_open(torch.tensor(h, dtype=torch.uint8))
                     for r, h in enumerate(handles)]
        return cls(bases, rank, capacity, device)

    @property
    def step_areas(self) -> list[int]:
        """Every rank's decode-step area (after its signals and two data buffers), as opened here."""
        offset = torch.ops.woq.constant("peer_signal_bytes") + 2 * self.capacity
        return [base + offset for base in self.bases]

    def takes(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through the peer buffers: by its size and dtype alone, so that
        every rank decides alike."""
        nbytes = x.numel() * x.element_size()
        return x.dtype in (torch.float16, torch.bfloat16, torch.float32) and nbytes <= self.capacity and nbytes % 16 == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """All-reduce ``x`` (``takes(x)``) in place."""
        if x.is_contiguous() and x.data_ptr() % 16 == 0:
            torch.ops.woq.peer_all_reduce(x, self.bases, self.counters, self.rank, self.capacity)
        else:  # (the kernel moves 16-byte units)
            x.copy_(self(x.clone(memory_format=torch.contiguous_format)))
        return x
