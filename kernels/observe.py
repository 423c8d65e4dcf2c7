"""Observing kernel calls: every linear-layer call counted by (path, layer kind, bits, M),
a sampled fraction timed, eager or replayed from a CUDA graph. An observer (the service's
Prometheus metrics) receives ``KernelCall``s: counted, and for the sampled ones timed. A
model's layers get their plans wrapped in ``ObservedPlan`` (``CausalLM.observe_kernels``);
the plan itself never knows.

* **Eager calls**: one call in ``sample_every`` is timed, with CUDA events resolved later,
  once they have completed, so that the decode loop never synchronizes for a measurement.
* **CUDA graphs**: a replay does not pass through Python, so a graph's calls are recorded
  while it is captured (``recording``, a ``Captured``), and every replay adds them
  (``Captured.replayed``; added to the observer in bulk by ``flush``, at a scrape). A graph
  is also captured a second time with one call of each kind timed (path, layer kind, bits,
  shape: the decoder layers repeat them), and with event nodes around the whole step: its
  *timed twin*. A GEMV or mixed-GEMM call is timed by its blocks' ``%globaltimer`` stamps
  (``BlockStampRows``: the third decoder layer's, run between calls of the second and the
  first layer's of its kind, see there), other calls by event nodes around the first call
  of their kind. One replay in ``sample_every`` of each graph runs
  its twin instead, which keeps the latencies flowing while the fast graph itself stays
  free of event nodes (an event node between two kernels ends their programmatic overlap,
  and adds its launch to the call it times: the GEMVs and mixed GEMMs, most of a step,
  are stamped for that reason; docs/design/metrics.md).
* **The persistent decode step** is one kernel for every decoder layer. Its stages are
  counted as the layers' calls (path ``decode_step``), and a timed step has the kernel
  stamp ``%globaltimer`` at the end of each stage (``StageStamps``): the gap between two
  consecutive stamps is that stage's latency.
"""
from __future__ import annotations

import contextlib
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import torch

from .plans import GEMV, MIXED_GEMM, Epilogue

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
    layer: str  # layer kind: qkv, o, gate_up, down, lm_head; attention (a persistent step's stage)
    bits: int  # 16 for unquantized
    m: int
    n: int
    k: int
    group_size: int = 0  # 0: per channel (or unquantized)
    zeros: bool = False  # asymmetric: zero points beside the scales

    def weight_bytes(self, dtype_bytes: int = 2) -> int:
        """The weight's bytes with its scales (and zero points where asymmetric: counted as
        scales, as the GPU layout stores them)."""
        if self.bits == 16:
            return self.n * self.k * dtype_bytes
        groups = -(-self.k // self.group_size) if self.group_size else 1
        return self.n * self.k * self.bits // 8 + self.n * groups * dtype_bytes * (2 if self.zeros else 1)

    def bytes_moved(self, dtype_bytes: int = 2) -> int:
        """The bytes a call must move at least: the weight (scales, zeros), x and y (an
        attention stage: not counted, 0)."""
        if self.layer == "attention":
            return 0
        return self.weight_bytes(dtype_bytes) + self.m * (self.k + self.n) * dtype_bytes


class KernelObserver(Protocol):
    def count(self, call: KernelCall, calls: int) -> None:
        """``calls`` calls made (one eager call, a graph's calls times its replays, a
        persistent step's stages)."""

    def time(self, call: KernelCall, seconds: float) -> None:
        """The latency of one sampled call (counted already)."""

    def record_step(self, batch: int, seconds: float, weight_bytes: int) -> None:
        """A sampled decode step of ``batch`` rows (a timed graph replay) and the weight
        bytes its calls read."""


@dataclass(eq=False)
class Captured:
    """The linear-layer calls of one captured CUDA graph, and how often it was replayed.
    A timed twin also holds the event pairs its capture recorded (around the first call of
    each kind, and around a decode step) and the persistent step's stamps."""

    counts: Counter = field(default_factory=Counter)
    events: list[tuple[KernelCall, torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)
    stamps: list["StageStamps"] = field(default_factory=list)
    replays: int = 0
    flushed: int = 0
    offered: int = 0  # a timed twin: replays of its graph pair (take_timed), timed or not
    in_flight: torch.cuda.Event | None = None  # a timed replay not yet read back
    step: tuple[int, torch.cuda.Event, torch.cuda.Event] | None = None  # a timed twin's (batch, start, end)
    blocks: "BlockStampRows | None" = None  # a timed twin's GEMV and mixed-GEMM calls' block stamps
    # a timed twin: each stamped kind's partners (its two previous layers' kernels, run again
    # around the reported call: BlockStampRows) until that call is captured, and the weight
    # bytes the partners add to the twin's step (uncounted calls: not in ``counts``)
    partners: dict = field(default_factory=dict)
    partner_bytes: int = 0

    def replayed(self) -> None:
        self.replays += 1

    def begin_step(self) -> None:
        """Inside a timed twin's capture, before its forward: an event node at its start."""
        start = torch.cuda.Event(enable_timing=True, external=True)
        start.record()
        self.step = (0, start, start)

    def end_step(self, batch: int) -> None:
        end = torch.cuda.Event(enable_timing=True, external=True)
        end.record()
        self.step = (batch, self.step[1], end)

    def end_capture(self) -> None:
        """Inside a timed twin's capture, after its forward: the block stamps' copy out."""
        if self.blocks is not None and self.blocks.calls:
            self.blocks.copy_out()
        self.partners.clear()  # (their inputs stay alive while they are held)

    def weight_bytes(self) -> int:
        """The weight bytes one replay reads (a timed twin's partners' calls included)."""
        return self.partner_bytes + sum(call.weight_bytes() * n for call, n in self.counts.items()
                                        if call.layer != "attention")


class BlockStampRows:
    """The block stamps of a timed twin's GEMV and mixed-GEMM calls: each stamped call has a
    row of ``buffer`` (int64, zeroed once before the capture), its ``[blocks, 2]`` (start,
    end) pairs, rewritten by the same blocks at every replay (a graph's grids are fixed);
    blocks that never write leave zeros. Copied to pinned host memory at the end of each
    timed replay.

    In place, a call's time runs from its blocks' first return from the wait for the
    previous kernel to its last block's end. Under programmatic launches its first weight
    stages stream in before that wait, during whatever ran before it, and the next kernel's
    first stages stream in during its own tail: each kind's time holds some of its
    neighbours' loads (qkv's prologue runs during the norm and the previous down, down's
    during gate_up), and the first layer's qkv follows the embedding
    (docs/design/metrics.md). So by default (``KernelTiming``'s ``paired``) the twin times a
    call as the kernel benchmark's chain does: the kind's ``stamped_layers``-th call (by
    default the third decoder layer's) runs between two other layers' kernels of its kind,
    the second layer's just before it (its *leader*, stamped too) and the first layer's
    just after it, each without a SwiGLU that runs as a kernel of its own
    (``KernelPlan.epilogue_in_kernel``: nothing runs between the leader's end and the
    call's wait). Its time runs from the leader's last block's end to its own last block's
    end, the interval a chain's call takes (the wait's own latency included). Its prologue
    and tail then overlap calls like itself, each on weights of its own that left L2 a layer
    or more ago (one partner run twice would find its weights in L2 the second time: an 8B
    model's o weights take 8.4 MB), so its time is its own weights' and the roofline gauges
    read the kernel's rate on the live shapes. The calls before it are stamped in place; a
    kind's last stamped call is the one reported (with fewer layers the last one, paired
    with what layers it has before it). Without pairing every stamped call is timed in place
    (``benchmarks/gemv_in_place.py`` compares the two ways)."""

    # Layer kinds a twin stamps (qkv, o, gate_up, down: each on one path in a graph, its M
    # fixed), then events; blocks a call stamps at most (a GEMM's grid is one resident wave
    # or tiles x splits, a GEMV's a wave)
    KINDS, BLOCKS = 4, 4096

    def __init__(self, device: torch.device, layers: int):
        # (a row a kind and layer, and one a kind for a paired call's leader)
        self.buffer = torch.zeros(self.KINDS * (layers + 1), 2 * self.BLOCKS, dtype=torch.int64, device=device)
        self.host = torch.zeros(self.buffer.shape, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.calls: list[KernelCall] = []  # the stamped calls, in call order (a leader is not one)
        self._rows: list[int] = []  # each call's row
        self._leaders: dict[int, int] = {}  # a paired call's index in ``calls``: its leader's row
        self._taken = 0

    def _row(self) -> int | None:
        if self._taken == len(self.buffer):
            return None
        self._taken += 1
        return self._taken - 1

    def take(self, call: KernelCall) -> torch.Tensor | None:
        """The stamps row of ``call``, or None when every row is taken."""
        row = self._row()
        if row is None:
            return None
        self.calls.append(call)
        self._rows.append(row)
        return self.buffer[row]

    def take_paired(self, call: KernelCall) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The stamps rows of a paired ``call``'s leader and of ``call``, or None when fewer
        than two rows are left."""
        if self._taken + 2 > len(self.buffer):
            return None
        leader = self._row()
        self._leaders[len(self.calls)] = leader
        return self.buffer[leader], self.take(call)

    def copy_out(self) -> None:
        self.host.copy_(self.buffer, non_blocking=True)

    def _pairs(self, row: int) -> torch.Tensor:
        pairs = self.host[row].view(-1, 2)
        return pairs[pairs[:, 0] > 0]

    def every_call(self) -> list[tuple[KernelCall, float]]:
        """Each stamped call's latency in seconds, in call order: its last block's end minus
        its leader's last block's end (a paired call whose leader stamped), else minus its
        first block's start."""
        out = []
        for i, call in enumerate(self.calls):
            pairs = self._pairs(self._rows[i])
            if not len(pairs):
                continue
            start = int(pairs[:, 0].min())
            if i in self._leaders:
                leader = self._pairs(self._leaders[i])
                if len(leader):
                    start = int(leader[:, 1].max())
            out.append((call, max(int(pairs[:, 1].max()) - start, 0) / 1e9))
        return out

    def latencies(self) -> list[tuple[KernelCall, float]]:
        """Each kind's latency in seconds, from its last stamped call."""
        return list(dict(self.every_call()).items())


class StageStamps:
    """``%globaltimer`` stamps of the persistent decode step: ``buffer`` (int64 ``[layers x
    stages + 1, SMs]`` on the GPU, written by the kernel of a timed step: each block's end of
    each (layer, stage), then the start) copied to pinned host memory after the step and read
    once that copy is done."""

    STAGES = ("qkv", "attention", "o", "gate_up", "down")  # (decode_step.cuh's kQkv .. kDown)

    def __init__(self, buffer: torch.Tensor, calls: list[KernelCall]):
        self.buffer, self.calls = buffer, calls  # calls: one per stage, in STAGES order
        self.host = torch.empty(buffer.shape, dtype=buffer.dtype, pin_memory=True)

    def copy_out(self) -> None:
        self.host.copy_(self.buffer, non_blocking=True)

    def latencies(self) -> list[tuple[KernelCall, float]]:
        """Each stage's latency in seconds, layer after layer: the gap since the previous stage's
        end (a stage ends with its last block's stamp, the latest of its row)."""
        stamps = self.host.amax(dim=1).tolist()
        ends, previous, out = stamps[:-1], stamps[-1], []
        for i, end in enumerate(ends):
            out.append((self.calls[i % len(self.calls)], max(end - previous, 0) / 1e9))
            previous = end
        return out


class KernelTiming:
    """Counts every call and times a sampled ``1 / sample_every`` of them (eager calls one in
    ``sample_every``, graphs their timed twin one replay in ``sample_every``). One per model
    (its layers share the sampling)."""

    def __init__(self, observer: KernelObserver, sample_every: int = 1, stamped_layers: int = 3,
                 paired: bool = True):
        """``stamped_layers``: which of each GEMV or mixed-GEMM kind's calls a timed twin
        reports (the last of that many); ``paired``: time it between calls of the two before
        it, else stamp all of them in place (``BlockStampRows``)."""
        self.observer = observer
        self.sample_every = max(1, sample_every)
        self.stamped_layers = max(1, stamped_layers)
        self.paired = paired
        self.count = 0
        self.pending: deque[tuple[KernelCall, torch.cuda.Event, torch.cuda.Event]] = deque()
        self.pending_stamps: deque[tuple[StageStamps, torch.cuda.Event]] = deque()
        self.captured: list[Captured] = []
        self._recording: Captured | None = None
        self._timed_capture = False
        self._quiet = 0

    # -- eager calls -------------------------------------------------------------------------
    def run(self, call: KernelCall, compute: Callable[[torch.Tensor | None], torch.Tensor],
            on_cuda: bool, kernel: Callable[[torch.Tensor | None], torch.Tensor] | None = None) -> torch.Tensor:
        """``compute(stamps)`` makes the call; ``stamps`` (a GEMV's or GEMM's block stamps) or
        None. ``kernel(stamps)``: the call's kernel alone, without an epilogue that runs as a
        kernel of its own (a timed twin's partner: ``BlockStampRows``; default ``compute``)."""
        if on_cuda and torch.cuda.is_current_stream_capturing():
            return self._captured_call(call, compute, kernel or compute)
        if self._quiet:
            return compute(None)
        self.count += 1
        self.observer.count(call, 1)
        if self.count % self.sample_every:
            return compute(None)
        if on_cuda:
            self.drain()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            y = compute(None)
            end.record()
            self.pending.append((call, start, end))
            return y
        t0 = time.perf_counter()
        y = compute(None)
        self.observer.time(call, time.perf_counter() - t0)
        return y

    def stages(self, calls: list[KernelCall], layers: int, launch: Callable[[torch.Tensor | None], None],
               stamps: torch.Tensor) -> None:
        """A persistent decode step: ``launch(stamps or None)`` runs it; its ``layers`` x
        ``calls`` stages (one call per ``StageStamps.STAGES``) are counted, and timed from the
        kernel's stamps in ``stamps`` where this step is sampled."""
        if torch.cuda.is_current_stream_capturing():
            if self._recording is None:
                return launch(None)
            for call in calls:
                self._recording.counts[call] += layers
            if not self._timed_capture:
                return launch(None)
            launch(stamps)
            s = StageStamps(stamps, calls)
            s.copy_out()
            self._recording.stamps.append(s)
            return None
        if self._quiet:
            return launch(None)
        self.count += 1
        for call in calls:
            self.observer.count(call, layers)
        if self.count % self.sample_every:
            return launch(None)
        # (stream order keeps this step's stamps from overwriting a previous one's before its copy)
        launch(stamps)
        s = StageStamps(stamps, calls)
        s.copy_out()
        done = torch.cuda.Event()
        done.record()
        self.pending_stamps.append((s, done))
        return None

    def drain(self, wait: bool = False) -> None:
        """Report the finished CUDA timings (with ``wait``: all of them)."""
        while self.pending and (wait or self.pending[0][2].query()):
            call, start, end = self.pending.popleft()
            end.synchronize()
            self.observer.time(call, start.elapsed_time(end) / 1e3)
        while self.pending_stamps and (wait or self.pending_stamps[0][1].query()):
            s, done = self.pending_stamps.popleft()
            done.synchronize()
            for call, seconds in s.latencies():
                self.observer.time(call, seconds)
        for c in self.captured:
            if c.in_flight is not None and (wait or c.in_flight.query()):
                c.in_flight.synchronize()
                c.in_flight = None
                for call, start, end in c.events:
                    self.observer.time(call, start.elapsed_time(end) / 1e3)
                for s in c.stamps + ([c.blocks] if c.blocks is not None else []):
                    for call, seconds in s.latencies():
                        self.observer.time(call, seconds)
                if c.step is not None:
                    batch, start, end = c.step
                    self.observer.record_step(batch, start.elapsed_time(end) / 1e3, c.weight_bytes())

    @property
    def quieted(self) -> bool:
        """Inside ``quiet``: graph replays are not counted either (``cuda_graphs.Graph``)."""
        return self._quiet > 0

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Calls made inside are neither counted nor timed (warm-up runs, not served work)."""
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    # -- CUDA graphs ------------------------------------------------------------------------
    @contextlib.contextmanager
    def recording(self, timed: bool = False) -> Iterator[Captured]:
        """Record the calls of the graph captured inside (``timed``: its timed twin, one call
        of each kind timed)."""
        captured = Captured()
        if timed:  # (allocated before the capture: zeroing inside it would add a kernel node)
            captured.blocks = BlockStampRows(torch.device("cuda", torch.cuda.current_device()), self.stamped_layers)
        self._recording, self._timed_capture = captured, timed
        try:
            yield captured
        finally:
            self._recording, self._timed_capture = None, False
        self.captured.append(captured)

    def _captured_call(self, call: KernelCall, compute: Callable[[torch.Tensor | None], torch.Tensor],
                       kernel: Callable[[torch.Tensor | None], torch.Tensor]) -> torch.Tensor:
        if self._recording is None:
            return compute(None)
        occurrence = self._recording.counts[call]
        self._recording.counts[call] += 1
        if not self._timed_capture:
            return compute(None)
        if call.path in (GEMV, MIXED_GEMM) and occurrence < self.stamped_layers:
            rec = self._recording
            partners = rec.partners.setdefault(call, [])
            if self.paired and partners and occurrence == self.stamped_layers - 1:
                rows = rec.blocks.take_paired(call)
                if rows is not None:
                    partners[-1](rows[0])  # (the leader; the partners' outputs are not used, their calls not counted)
                    y = compute(rows[1])
                    partners[0](None)  # (the one before: with one layer before this, the same one again)
                    rec.partner_bytes += 2 * call.weight_bytes()
                    return y
            stamps = rec.blocks.take(call)
            if stamps is not None:  # (in place)
                if self.paired:
                    # (the two latest before the reported call; their kernels alone, so that
                    # nothing runs between the leader's end and the reported call's wait)
                    partners[:] = (partners + [kernel])[-2:]
                return compute(stamps)
        if occurrence:
            return compute(None)
        start = torch.cuda.Event(enable_timing=True, external=True)
        end = torch.cuda.Event(enable_timing=True, external=True)
        start.record()
        y = compute(None)
        end.record()
        self._recording.events.append((call, start, end))
        return y

    def take_timed(self, twin: Captured) -> bool:
        """Whether this replay should be the timed twin's: one in ``sample_every`` replays of
        this graph (counted per graph: under a steady load the graphs of the batch sizes
        alternate in a fixed pattern, and one count over all of them can step over a graph
        every time), and only once the twin's previous timings have been read."""
        twin.offered += 1
        if twin.offered % self.sample_every:
            return False
        self.drain()  # (the timings of the twin replayed sample_every replays ago, done by now)
        return twin.in_flight is None

    def timed_replayed(self, twin: Captured) -> None:
        """After a replay of the timed twin: its events are read once the step is done."""
        twin.replayed()
        twin.in_flight = torch.cuda.Event()
        twin.in_flight.record()

    def flush(self) -> None:
        """Add the replays since the last flush to the observer's counts."""
        for c in self.captured:
            n = c.replays - c.flushed
            if n:
                c.flushed += n
                for call, calls in c.counts.items():
                    self.observer.count(call, calls * n)


class ObservedPlan:
    """A layer's plan whose calls ``timing`` counts and samples."""

    def __init__(self, plan, timing: KernelTiming, layer_kind: str, n: int, k: int, group_size: int = 0,
                 zeros: bool = False):
        self.plan, self.timing = plan, timing
        self.layer_kind, self.n, self.k, self.group_size, self.zeros = layer_kind, n, k, group_size, zeros
        self.bits = plan.bits
        self.swiglu_rows = plan.swiglu_rows

    def path(self, m: int) -> str:
        return self.plan.path(m)

    def __call__(self, x: torch.Tensor, epilogue: Epilogue = Epilogue.NONE) -> torch.Tensor:
        m = x.shape[0]
        call = KernelCall(self.plan.path(m), self.layer_kind, self.bits, m, self.n, self.k, self.group_size, self.zeros)
        def compute(stamps: torch.Tensor | None, epilogue: Epilogue = epilogue) -> torch.Tensor:
            return self.plan(x, epilogue) if stamps is None else self.plan(x, epilogue, stamps=stamps)

        def kernel(stamps: torch.Tensor | None) -> torch.Tensor:  # (a GEMV's or mixed GEMM's: KernelPlan)
            return compute(stamps, epilogue if self.plan.epilogue_in_kernel(m, epilogue) else Epilogue.NONE)

        return self.timing.run(call, compute, x.is_cuda, kernel)
