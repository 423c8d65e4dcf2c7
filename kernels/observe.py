"""Observing kernel calls: every linear-layer call counted by (path, layer kind, bits, M),
a sampled fraction timed. An observer (the service's Prometheus metrics) receives a
``KernelCall`` and, for the sampled calls, the latency. A model's layers get their plans
wrapped in ``ObservedPlan`` (``CausalLM.observe_kernels``); the plan itself never knows.

CUDA timings use events resolved later, once they have completed, so the decode loop never
synchronizes for a measurement; nothing is timed or counted while a CUDA graph is being
captured (a replay does not pass through Python).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from .plans import Epilogue

_M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


def m_bucket(m: int) -> str:
    """A label for M: the smallest power-of-two bound above it ("1", "2", "<=4", ..., ">4096")."""
    for b in _M_BUCKETS:
        if m <= b:
            return str(b) if b <= 2 else f"<={b}"
    return f">{_M_BUCKETS[-1]}"


@dataclass(frozen=True)
class KernelCall:
    path: str
    layer: str  # layer kind: qkv, o, gate_up, down, lm_head; decoder (the persistent step)
    bits: int  # 16 for unquantized
    m: int
    n: int
    k: int


class KernelObserver(Protocol):
    def record(self, call: KernelCall, seconds: float | None) -> None:
        """``seconds`` is None for calls that were counted but not timed."""


class KernelTiming:
    """Counts every call, times every ``sample_every``-th, and resolves CUDA events lazily.
    One per model (its layers share the sampling)."""

    def __init__(self, observer: KernelObserver, sample_every: int = 1):
        self.observer = observer
        self.sample_every = max(1, sample_every)
        self.count = 0
        self.pending: deque[tuple[KernelCall, torch.cuda.Event, torch.cuda.Event]] = deque()

    def drain(self, wait: bool = False) -> None:
        """Report the finished CUDA timings (with ``wait``: all of them)."""
        while self.pending and (wait or self.pending[0][2].query()):
            call, start, end = self.pending.popleft()
            end.synchronize()
            self.observer.record(call, start.elapsed_time(end) / 1e3)

    def run(self, call: KernelCall, compute: Callable[[], torch.Tensor], on_cuda: bool) -> torch.Tensor:
        if on_cuda and torch.cuda.is_current_stream_capturing():
            return compute()
        self.count += 1
        if self.count % self.sample_every:
            self.observer.record(call, None)
            return compute()
        if on_cuda:
            self.drain()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            y = compute()
            end.record()
            self.pending.append((call, start, end))
            return y
        t0 = time.perf_counter()
        y = compute()
        self.observer.record(call, time.perf_counter() - t0)
        return y


class ObservedPlan:
    """A layer's plan whose calls ``timing`` counts and samples."""

    def __init__(self, plan, timing: KernelTiming, layer_kind: str, n: int, k: int):
        self.plan, self.timing = plan, timing
        self.layer_kind, self.n, self.k = layer_kind, n, k
        self.bits = plan.bits
        self.swiglu_rows = plan.swiglu_rows

    def path(self, m: int) -> str:
        return self.plan.path(m)

    def __call__(self, x: torch.Tensor, epilogue: Epilogue = Epilogue.NONE) -> torch.Tensor:
        m = x.shape[0]
        call = KernelCall(self.plan.path(m), self.layer_kind, self.bits, m, self.n, self.k)
        return self.timing.run(call, lambda: self.plan(x, epilogue), x.is_cuda)
