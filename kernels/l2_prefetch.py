"""Warm the L2 cache with the next linear layer's weights while a decode step's small
kernels run (CUDA, decode only).

Why: a batch-1 decode step is bound by the weight bytes, but DRAM idles whenever no GEMV
streams: during RoPE, attention, the norms, SwiGLU's activation and every kernel boundary
-- ~20 µs of each Llama-3-8B layer's ~75 (docs/bench/decode_profile.md). A prefetch of the
next GEMV's weights into L2, issued on a side stream as soon as the previous GEMV ends,
moves bytes in those gaps; the GEMV then finds part of its weight in L2 and streams less
from DRAM.

What is prefetched: a fraction ``f`` of every tensor, spread evenly -- the first ``f`` of
each 16 KB window -- rather than the tensor's first ``f``: the GEMV cuts its weight into one
contiguous run per block (gemv.cuh, "stream-K"), so an even spread gives every block the
same share of L2 hits and all of them keep streaming from DRAM, where a prefix would let
some blocks finish early and leave their SMs idle. ``f`` = budget / the layer's bytes: the
budget is what DRAM can move in a gap (a few MB per µs) and what L2 (50 MB on an H100)
holds beside the running kernels.

How: ``cp.async.bulk.prefetch.L2`` (sm_90+, one instruction per window, fire and forget:
the kernel ends at once and the copy engine finishes the work) or ``prefetch.global.L2``
(one instruction per 128-byte line). Prefetches are hints: they change no value, only
where the next reads find their bytes.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .device import sm_major

WINDOW = 16 << 10  # bytes per window; the first f of each is prefetched
LINE = 128  # an L2 line
_BLOCK = 128  # prefetch instructions per program per iteration (one per thread)

_ASM = {
    # (instruction, bytes it covers per address); $1: address, $2: predicate, $3: size
    "line": "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
    "line_last": "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
    "noop": "{ mov.u32 $0, 0; }",
    "bulk": "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
}


@triton.jit
def _prefetch_kernel(BASE, nbytes, per_window, count, SINK, ASM: tl.constexpr, BULK: tl.constexpr,
                     WINDOW_BYTES: tl.constexpr, LINE_BYTES: tl.constexpr, BLOCK: tl.constexpr):
    # Item i: the i-th prefetch -- a window's prefix (bulk) or one line of it.
    pid = tl.program_id(0)
    done = tl.zeros([BLOCK], tl.int32)
    for start in range(pid * BLOCK, count, tl.num_programs(0) * BLOCK):
        i = start + tl.arange(0, BLOCK)
        if BULK:
            off = i.to(tl.int64) * WINDOW_BYTES
            size = tl.minimum(nbytes - off, per_window).to(tl.int32)
        else:
            off = (i // per_window).to(tl.int64) * WINDOW_BYTES + (i % per_window).to(tl.int64) * LINE_BYTES
            size = tl.full([BLOCK], LINE_BYTES, tl.int32)
        ok = (i < count) & (off < nbytes)
        done += tl.inline_asm_elementwise(ASM, "=r,l,r,r", [BASE + off, ok.to(tl.int32), size], dtype=tl.int32,
                                          is_pure=False, pack=1)
    # the asm's result is 0; storing it where it is not would keep a compiler from dropping it
    tl.store(SINK + tl.arange(0, BLOCK), done, mask=done != 0)


class L2Prefetcher:
    """Prefetches on a side stream of ``device``; ``join`` before the forward ends (a CUDA
    graph being captured must rejoin its forks)."""

    def __init__(self, device: torch.device, kind: str = "bulk"):
        if kind == "bulk" and sm_major(device) < 9:
            kind = "line"
        self.kind = kind
        self.stream = torch.cuda.Stream(device)
        self.sink = torch.zeros(_BLOCK, dtype=torch.int32, device=device)
        self.programs = torch.cuda.get_device_properties(device).multi_processor_count
        self.pending = False

    def prefetch(self, tensors: list[torch.Tensor], fraction: float) -> None:
        """Prefetch ``fraction`` of each tensor (contiguous), after what the current stream
        has queued so far."""
        if fraction <= 0:
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for t in tensors:
                self._launch(t, min(1.0, fraction))
        self.pending = True

    def _launch(self, t: torch.Tensor, fraction: float) -> None:
        nbytes = t.numel() * t.element_size()
        prefix = max(LINE, int(fraction * WINDOW) // LINE * LINE)
        windows = triton.cdiv(nbytes, WINDOW)
        bulk = self.kind == "bulk"
        per_window = prefix if bulk else prefix // LINE
        count = windows * (1 if bulk else per_window)
        grid = (min(self.programs, triton.cdiv(count, _BLOCK)),)
        _prefetch_kernel[grid](t.data_ptr(), nbytes, per_window, count, self.sink, ASM=_ASM[self.kind], BULK=bulk,
                               WINDOW_BYTES=WINDOW, LINE_BYTES=LINE, BLOCK=_BLOCK, num_warps=4)

    def join(self) -> None:
        if self.pending:
            torch.cuda.current_stream().wait_stream(self.stream)
            self.pending = False


@functools.cache
def prefetcher(device: torch.device, kind: str) -> L2Prefetcher:
    return L2Prefetcher(device, kind)
