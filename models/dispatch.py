"""The single dispatch point of every linear layer.

Each call of a linear layer comes here with its activations ``x`` (``[M, K]``: M rows =
batch × tokens). ``choose_path`` picks the implementation from (device, M, shape, bits):

=================  ===========================================================
path               when
=================  ===========================================================
``dense``          unquantized layer (``--quant none``, an unquantized LM head):
                   ``F.linear``
``dense_gemv``     unquantized layer, CUDA, M <= 2 (decode): the in-repo dense GEMV
``cpu_reference``  quantized layer off CUDA, or CUDA without the compiled kernels
``gemv``           CUDA, M <= 16 (decode): the weight-only GEMV kernel; up to 32
                   rows, or only 8, as measured against the mixed GEMM for the shape
``mixed_gemm``     CUDA, from there to the measured crossover: the tensor-core GEMM
                   with fused dequantization
``dequant_cublas`` CUDA, larger M (prefill): dequantize to a scratch buffer + cuBLAS
``attention_gemv`` CUDA decode step, the o projection: the GEMV whose grid does the
                   step's attention first (``attention_linear``; the model asks)
``decode_step``    CUDA batch-1 decode step: every decoder layer in one persistent
                   kernel (``decoder_step``; the model asks), layer kind ``decoder``
=================  ===========================================================

The decision is observable: an observer (the service's Prometheus metrics) receives a
``KernelCall`` (path, layer kind, bits, M, N, K) and, for a sampled fraction of calls, the
call's latency. Timing on CUDA uses events that are resolved later, when they have
completed, so the decode loop never synchronizes for a measurement; nothing is timed
while a CUDA graph is being captured.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from ..kernels.paths import (  # noqa: F401
    ATTENTION_GEMV, CPU_REFERENCE, DECODE_STEP, DENSE, DENSE_GEMV, DEQUANT_CUBLAS, GEMV, GEMV_MAX_M, MIXED_GEMM, PATHS,
)

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
    layer: str  # layer kind: qkv, o, gate_up, down, lm_head
    bits: int  # 16 for unquantized
    m: int
    n: int
    k: int


class KernelObserver(Protocol):
    def record(self, call: KernelCall, seconds: float | None) -> None:
        """``seconds`` is None for calls that were counted but not timed."""


class Dispatchable(Protocol):
    """What a linear layer exposes to the dispatcher (see ``models/quant_linear.py``)."""

    layer_kind: str
    bits: int  # 16 when unquantized
    in_features: int
    out_features: int

    def has_gpu_kernels(self) -> bool:
        """Whether the layer holds its weight in the GPU kernels' layout."""

    def gemv_max_rows(self) -> int:
        """Largest M the layer's GEMV serves (16; 8 or up to 32 as measured for the shape; an
        unquantized layer: the dense GEMV's, 0 where it does not run)."""

    def kernel_max_rows(self) -> int:
        """Largest M the layer's kernels serve before dequantize + cuBLAS is faster."""

    def run(self, path: str, x: torch.Tensor, swiglu: bool = False, float_out: bool = False) -> torch.Tensor:
        """Compute the layer through ``path`` (with ``swiglu``: SwiGLU's ``silu(gate) * up`` of it;
        with ``float_out``: as float32, the values those of ``y.float()``)."""


def choose_path(x: torch.Tensor, layer: Dispatchable) -> str:
    """The path for this call, from (device, M, shape, bits)."""
    if layer.bits == 16:
        return DENSE_GEMV if x.is_cuda and x.shape[0] <= layer.gemv_max_rows() else DENSE
    if not (x.is_cuda and layer.has_gpu_kernels()):
        return CPU_REFERENCE
    m = x.shape[0]
    if m <= layer.gemv_max_rows():
        return GEMV
    if m <= layer.kernel_max_rows():
        return MIXED_GEMM
    return DEQUANT_CUBLAS


class _Timing:
    """Counts every call, times every ``sample_every``-th, and resolves CUDA events lazily."""

    def __init__(self, observer: KernelObserver, sample_every: int):
        self.observer = observer
        self.sample_every = max(1, sample_every)
        self.count = 0
        self.pending: deque[tuple[KernelCall, torch.cuda.Event, torch.cuda.Event]] = deque()

    def drain(self, wait: bool = False) -> None:
        while self.pending and (wait or self.pending[0][2].query()):
            call, start, end = self.pending.popleft()
            end.synchronize()
            self.observer.record(call, start.elapsed_time(end) / 1e3)

    def run(self, call: KernelCall, compute: Callable[[], torch.Tensor], on_cuda: bool) -> torch.Tensor:
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


_timing: _Timing | None = None


def set_observer(observer: KernelObserver | None, sample_every: int = 1) -> None:
    """Install (or remove, with None) the observer of kernel calls."""
    global _timing
    _timing = None if observer is None else _Timing(observer, sample_every)


def flush_observer() -> None:
    """Wait for and report every pending CUDA timing (for tests and shutdown)."""
    if _timing is not None:
        _timing.drain(wait=True)


def linear(x: torch.Tensor, layer: Dispatchable, swiglu: bool = False, float_out: bool = False) -> torch.Tensor:
    """``y = layer(x)`` for 2-D ``x``, through the path chosen for this call; with ``swiglu``
    (a SwiGLU MLP's fused gate/up layer) ``silu(gate) * up`` of it, which the timing includes;
    with ``float_out`` (logits) ``y.float()``, converted by the kernel where it can."""
    path = choose_path(x, layer)
    timing = _timing
    if timing is None or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return layer.run(path, x, swiglu, float_out)
    call = KernelCall(path, layer.layer_kind, layer.bits, x.shape[0], layer.out_features, layer.in_features)
    return timing.run(call, lambda: layer.run(path, x, swiglu, float_out), x.is_cuda)


def attention_linear(layer: Dispatchable, m: int, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The o projection ``layer`` of ``m`` rows computed by ``compute()`` together with the
    decode step's attention (path ``attention_gemv``), observed like ``linear``'s calls."""
    timing = _timing
    if timing is None or torch.cuda.is_current_stream_capturing():
        return compute()
    call = KernelCall(ATTENTION_GEMV, layer.layer_kind, layer.bits, m, layer.out_features, layer.in_features)
    return timing.run(call, compute, True)


def decoder_step(bits: int, hidden: int, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A batch-1 decode step's decoder layers, all in one kernel launched by ``compute()``
    (path ``decode_step``, layer kind ``decoder``, M = 1, N = K = ``hidden``), observed like
    ``linear``'s calls."""
    timing = _timing
    if timing is None or torch.cuda.is_current_stream_capturing():
        return compute()
    return timing.run(KernelCall(DECODE_STEP, "decoder", bits, 1, hidden, hidden), compute, True)
