"""Greedy decoding's argmax over the vocabulary, spread over the GPU (Triton).

torch's ``argmax(-1)`` over a vocabulary of 128256 logits -- 256 KB, a microsecond's worth
of bandwidth -- runs in one block and costs tens of µs. Here each row is cut into chunks of ``CHUNK`` logits, one program each (the
chunk's maximum and the first index holding it), and a second launch picks, per row, the
first chunk holding the row's maximum: the first index of the maximum, which is what
torch returns (docs/bench/decode_profile.md times it). NaN counts as the largest value (as
in torch) -- a NaN logit is a bug upstream, but it must not pick an arbitrary token.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 2048  # logits per program: 63 programs for 128256, 24 for SmolLM2's 49152


@triton.jit
def _chunk_max_kernel(X, Vals, Idx, V, stride_x, n_chunks, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(X + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN: the largest
    m, i = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(Vals + row * n_chunks + c, m)
    tl.store(Idx + row * n_chunks + c, c * CHUNK + i)


@triton.jit
def _first_chunk_kernel(Vals, Idx, Out, n_chunks, CHUNKS: tl.constexpr):
    row = tl.program_id(0)
    k = tl.arange(0, CHUNKS)
    v = tl.load(Vals + row * n_chunks + k, mask=k < n_chunks, other=float("-inf"))
    j = tl.argmax(v, 0, tie_break_left=True)  # the first chunk holding the maximum
    tl.store(Out + row, tl.load(Idx + row * n_chunks + j).to(tl.int64))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` (int64 ``[B]``) of CUDA ``logits`` ``[B, V]`` (fp16, bf16 or
    fp32, rows with unit stride)."""
    assert logits.dim() == 2 and logits.stride(-1) == 1 and logits.is_cuda
    B, V = logits.shape
    n_chunks = triton.cdiv(V, CHUNK)
    vals = torch.empty(B, n_chunks, device=logits.device, dtype=torch.float32)
    idx = torch.empty(B, n_chunks, device=logits.device, dtype=torch.int32)
    out = torch.empty(B, device=logits.device, dtype=torch.int64)
    _chunk_max_kernel[(B, n_chunks)](logits, vals, idx, V, logits.stride(0), n_chunks, CHUNK=CHUNK, num_warps=4)
    _first_chunk_kernel[(B,)](vals, idx, out, n_chunks, CHUNKS=max(16, triton.next_power_of_2(n_chunks)), num_warps=1)
    return out
