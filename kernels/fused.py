"""Fused elementwise kernels of the decoder (Triton), so a decode step is its GEMVs plus a
few small kernels instead of ~50 launches per layer.

At decode a layer's non-GEMV work is tiny (a few KB per token) but, written as torch ops,
it is ~40 kernels: RMSNorm alone is 8 (cast, square, mean, add, rsqrt, mul, cast, mul),
each RoPE 9, the KV-cache write 4, and every kernel of a CUDA graph costs a few µs however
small: a small model's decode step was mostly these. Here:

* ``add_rms_norm``: residual add + RMSNorm in one pass (vLLM-style residual stream);
* ``rope_and_cache``: RoPE on q and k, k and v stored in the KV cache, q written out (a
  prefill's tokens; a decode step does this inside its attention kernel,
  ``decode_attention.rope_cache_attention``, with ``rope_rotate`` below);
* ``silu_mul``: SwiGLU's ``silu(gate) * up`` where the GEMM or cuBLAS computed gate/up (a
  decode GEMV applies it in its epilogue: ``ops.gemv(..., swiglu=True)``, csrc/gemv.cuh).

Numerics follow the torch code they replace (``models/llama.py``, the CPU path): fp32
math, with the roundings to fp16/bf16 that change results visibly -- the residual sum is
rounded exactly as torch rounds it (bit-equal stream), the normalised value is rounded
before the weight multiply, SiLU before the product. Tests (``tests/test_gpu_fused.py``):
outputs within 2 ulp of the torch ops and at least as close to an fp64 reference; for RoPE,
where the compiler may keep the two products in fp32 rather than rounding each, within
2 ulp of the fp64 rotation.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl


def _warps(block: int) -> int:
    return 1 if block <= 256 else 2 if block <= 1024 else 4 if block <= 4096 else 8


@triton.jit
def programmatic_prologue(PDL: tl.constexpr):
    # Launched programmatically (kernels/pdl.py): let the next kernel launch now -- it
    # waits for this one to complete before using its output -- and wait for the previous
    # one before reading anything. Every program waits, so this kernel completes only
    # after its predecessor.
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


# When a kernel lets the next one launch (``launch_next``; the kernels' LAUNCH constexpr):
# at its start, once its own inputs are in, or at its end. The next GEMV's blocks put their
# first weight chunks in flight as soon as they start, and reads this kernel issues just
# after are served behind them (docs/design/engine.md).
LAUNCH_NEXT = {"start": 0, "inputs": 1, "end": 2}


@triton.jit
def _add_rms_norm_kernel(X, R, W, Y, ROUT, stride_x, stride_r, stride_y, stride_rout, N, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                         LAUNCH: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    if PDL and LAUNCH == 0:
        tl.extra.cuda.gdc_launch_dependents()
    w = tl.load(W + cols, mask=mask, other=0.0)  # (before the wait: no kernel writes it)
    if PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)  # torch's x + r: one rounding
        tl.store(ROUT + row * stride_rout + cols, x, mask=mask)
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, 0) / N + eps)
    if PDL and LAUNCH == 1:  # (after the sum: x is in)
        tl.extra.cuda.gdc_launch_dependents()
    h = h.to(X.dtype.element_ty)  # the reference casts back before the weight
    tl.store(Y + row * stride_y + cols, (w.to(tl.float32) * h.to(tl.float32)).to(X.dtype.element_ty), mask=mask)
    if PDL and LAUNCH == 2:
        tl.extra.cuda.gdc_launch_dependents()


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, launch_next: str = "start", programmatic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual) * weight, x + residual)``; without ``residual``, ``x`` itself
    is the residual stream (``x`` and ``residual``: ``[..., N]``). ``launch_next``: when the
    next kernel may launch programmatically ("start", "inputs", "end": ``LAUNCH_NEXT``);
    ``programmatic``: launched so itself (``pdl.py``)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    n = x2.shape[1]
    y = torch.empty_like(x2)
    if residual is None:
        r2 = rout = x2
    else:
        r2 = residual.reshape(-1, n)
        rout = torch.empty_like(x2)
    block = triton.next_power_of_2(n)
    _add_rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, y, rout, x2.stride(0), r2.stride(0), y.stride(0), rout.stride(0), n, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, LAUNCH=LAUNCH_NEXT[launch_next], num_warps=_warps(block),
        **pdl.triton_kwargs(x.device, programmatic),
    )
    return y.view(shape), (x if residual is None else rout.view(shape))


@triton.jit
def rope_rotate(x, partner, d, cos, sin, D: tl.constexpr):
    """RoPE of head vectors ``x`` (``[..., D]``, last axis ``d``) given ``partner``, each
    element's rotate_half partner (``x`` at ``(d + D/2) % D``), and one position's cos/sin
    rows (fp32, as loaded from the tables). Rounded as the torch reference (``Rotary``) is:
    cos/sin to the activation type, then each product and the sum."""
    rotated = tl.where(d < D // 2, -partner, partner)  # rotate_half: the first half negated
    c = cos.to(x.dtype).to(tl.float32)
    s = sin.to(x.dtype).to(tl.float32)
    a = (x.to(tl.float32) * c).to(x.dtype).to(tl.float32)
    b = (rotated.to(tl.float32) * s).to(x.dtype).to(tl.float32)
    return (a + b).to(x.dtype)


@triton.jit
def _rope_and_cache_kernel(QKV, COS, SIN, positions, slots, Table, Q, KC, VC,
                           stride_qkv, stride_q, stride_qh, stride_cb, stride_ch, stride_ct, stride_table, stride_rope,
                           H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HEADS: tl.constexpr,
                           BS: tl.constexpr, PDL: tl.constexpr):
    # One token's HEADS consecutive heads of q, k, v (in that order) per program: a
    # prefill's rows are thousands of tokens, and a program per (token, head) spent
    # several times the bandwidth time.
    programmatic_prologue(PDL)
    tok = tl.program_id(0)
    head = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    pos = tl.load(positions + tok)
    # The paged cache (models/kv_cache.py): the token's row of the block table names the
    # block of its position (int64 offsets: one layer's pool may pass 2^31 elements).
    block = tl.load(Table + tl.load(slots + tok) * stride_table + pos // BS).to(tl.int64)
    d = tl.arange(0, D)
    src = QKV + tok * stride_qkv + head[:, None] * D
    live = head[:, None] < H + 2 * HKV
    x = tl.load(src + d[None, :], mask=live, other=0.0)
    partner = tl.load(src + ((d + D // 2) % D)[None, :], mask=live & (head[:, None] < H + HKV), other=0.0)
    cos, sin = tl.load(COS + pos * stride_rope + d), tl.load(SIN + pos * stride_rope + d)
    y = rope_rotate(x, partner, d[None, :], cos, sin, D)
    is_q = head[:, None] < H
    is_k = (head[:, None] >= H) & (head[:, None] < H + HKV)
    is_v = (head[:, None] >= H + HKV) & live
    cache = block * stride_cb + (pos % BS) * stride_ct + d[None, :]  # (masked rows' offsets are never used)
    tl.store(Q + tok * stride_q + head[:, None] * stride_qh + d[None, :], y, mask=is_q)
    tl.store(KC + cache + (head[:, None] - H) * stride_ch, y, mask=is_k)
    tl.store(VC + cache + (head[:, None] - H - HKV) * stride_ch, x, mask=is_v)


def rope_and_cache(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                   heads: int, kv_heads: int, head_dim: int, programmatic: bool = False) -> torch.Tensor:
    """One token per row: rotate q and k of ``qkv`` ``[B, (H + 2 Hkv) D]`` at ``positions``
    ``[B]``, store k and v at that position of block-table row ``slots[b]`` (``k_cache``/
    ``v_cache``: one layer's blocks ``[N, Hkv, BS, D]``, BS a power of two; ``block_table``:
    int32 ``[rows, blocks_per_row]``, position t of row r in block ``block_table[r, t //
    BS]`` at offset ``t % BS``), and return the rotated q ``[B, H, D]``."""
    assert v_cache.stride() == k_cache.stride() and k_cache.stride(3) == 1, "k and v caches of one layout"
    assert block_table.stride(1) == 1, "block-table rows must be contiguous"
    B = qkv.shape[0]
    q = torch.empty(B, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    total = heads + 2 * kv_heads
    per_program = min(triton.next_power_of_2(total), max(1, 2048 // head_dim))  # ~2K elements a program
    _rope_and_cache_kernel[(B, triton.cdiv(total, per_program))](
        qkv, cos, sin, positions, slots, block_table, q, k_cache, v_cache,
        qkv.stride(0), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0), cos.stride(0), H=heads, HKV=kv_heads, D=head_dim, HEADS=per_program,
        BS=k_cache.shape[2], num_warps=4,
        **pdl.triton_kwargs(qkv.device, programmatic),
    )
    return q


@triton.jit
def _silu_mul_kernel(GU, Y, stride_gu, stride_y, N, BLOCK: tl.constexpr, INTERLEAVED: tl.constexpr,
                     PDL: tl.constexpr):
    programmatic_prologue(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    if INTERLEAVED:  # gate rows 8j..8j+7, then up rows 8j..8j+7 (format.gate_up_row_order)
        gate_cols = (cols // 8) * 16 + cols % 8
        up_cols = gate_cols + 8
    else:
        gate_cols = cols
        up_cols = N + cols
    g = tl.load(GU + row * stride_gu + gate_cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + up_cols, mask=mask, other=0.0)
    silu = (g / (1.0 + tl.exp(-g))).to(u.dtype)  # F.silu rounds its result
    tl.store(Y + row * stride_y + cols, (silu.to(tl.float32) * u.to(tl.float32)).to(u.dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor, interleaved: bool = False, programmatic: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` ``[..., 2 I]``: gate first, or (``interleaved``) their
    rows in blocks of eight (``format.gate_up_row_order``, the GPU layout's order); ``[..., I]``.
    (A decode GEMV does this in its epilogue: ``ops.gemv(..., swiglu=True)``.)"""
    shape = gate_up.shape
    gu = gate_up.reshape(-1, shape[-1])
    n = shape[-1] // 2
    y = torch.empty(gu.shape[0], n, dtype=gu.dtype, device=gu.device)
    block = min(2048, triton.next_power_of_2(n))
    _silu_mul_kernel[(gu.shape[0], triton.cdiv(n, block))](gu, y, gu.stride(0), y.stride(0), n, BLOCK=block,
                                                           INTERLEAVED=interleaved, num_warps=_warps(block),
                                                           **pdl.triton_kwargs(gu.device, programmatic))
    return y.view(*shape[:-1], n)
