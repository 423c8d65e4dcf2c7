"""Bit-exact CPU emulation of the GPU layout and of the fast converters (numpy).

It replays what ``csrc/convert.cuh`` and ``csrc/gemv.cuh`` do with the bits -- PRMT,
LOP3, shifts, the fp16/bf16/fp32 magic-number arithmetic, and which lane's registers land
where in the mma fragments -- so that CI, which has no GPU, checks the layout and the
converters exactly.
"""
from __future__ import annotations

import numpy as np
import torch

from woq.kernels.layout import INT4_NIBBLE_ORDER, INT8_BYTE_ORDER, SCALE_ROW_ORDER, GpuWeight, _COL_OFF, _ROW_OFF, tile_k

U32 = np.uint32


# --- instructions ------------------------------------------------------------------------


def lop3_and_or(a, b, c):
    """lop3.b32 with LUT (a & b) | c."""
    return (U32(a) & U32(b)) | U32(c)


def lop3_andnot_or(a, b, c):
    """lop3.b32 with LUT (~a & b) | c."""
    return (~U32(a) & U32(b)) | U32(c)


def prmt(a, b, selector: int):
    """prmt.b32 d, a, b, selector (default mode): byte i of d = byte sel_i of {b, a}."""
    a, b = np.asarray(a, dtype=U32), np.asarray(b, dtype=U32)
    pool = [(a >> U32(8 * i)) & U32(0xFF) for i in range(4)] + [(b >> U32(8 * i)) & U32(0xFF) for i in range(4)]
    out = np.zeros(np.broadcast(a, b).shape, dtype=U32)
    for i in range(4):
        sel = (selector >> (4 * i)) & 0xF
        assert sel < 8, "sign-replicate mode is not used"
        out |= pool[sel] << U32(8 * i)
    return out


def half2_values(reg) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) fp16 lanes of a 32-bit register, as float64."""
    reg = np.asarray(reg, dtype=U32)
    lo = (reg & U32(0xFFFF)).astype(np.uint16).view(np.float16)
    hi = (reg >> U32(16)).astype(np.uint16).view(np.float16)
    return lo.astype(np.float64), hi.astype(np.float64)


def bf16_values(reg) -> tuple[np.ndarray, np.ndarray]:
    reg = np.asarray(reg, dtype=U32)
    lo = ((reg & U32(0xFFFF)) << U32(16)).view(np.float32)
    hi = (reg & U32(0xFFFF0000)).view(np.float32)
    return lo.astype(np.float64), hi.astype(np.float64)


def _round_bf16(x: np.ndarray) -> np.ndarray:
    """float64 -> bf16 bits (uint32 in the low half), round to nearest even."""
    f = np.asarray(x, dtype=np.float32).view(U32)  # exact here: the values are small integers
    rounded = f + U32(0x7FFF) + ((f >> U32(16)) & U32(1))
    return rounded >> U32(16)


def _pack_half2(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Round two float64 lanes to fp16 (as the .rn instructions do) and pack them."""
    l = np.asarray(lo, dtype=np.float16).view(np.uint16).astype(U32)
    h = np.asarray(hi, dtype=np.float16).view(np.uint16).astype(U32)
    return l | (h << U32(16))


def hsub2(a, b):
    (al, ah), (bl, bh) = half2_values(a), half2_values(b)
    return _pack_half2(al - bl, ah - bh)


def hfma2(a, b, c):  # fused: one rounding of the exact a*b+c (exact in float64 here)
    (al, ah), (bl, bh), (cl, ch) = half2_values(a), half2_values(b), half2_values(c)
    return _pack_half2(al * bl + cl, ah * bh + ch)


def fma_bf16x2(a, b, c):
    (al, ah), (bl, bh), (cl, ch) = bf16_values(a), bf16_values(b), bf16_values(c)
    return _round_bf16(al * bl + cl) | (_round_bf16(ah * bh + ch) << U32(16))


def half2_const(v: float) -> np.ndarray:
    return _pack_half2(np.float64(v), np.float64(v))


def bf162_const(v: float) -> np.ndarray:
    b = _round_bf16(np.float64(v))
    return b | (b << U32(16))


# --- group scales on converted weights (csrc/gemm.cuh, RowScale) --------------------------


def row_scale_bf16_int4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """RowScale<bf16, 4>'s registers from fp16 scales: (bf16x2(hi, hi), bf16x2(lo, lo)) with
    hi = bf16(s) and lo = bf16(s - hi), computed in fp32 as the kernel does."""
    f = np.asarray(s, np.float16).astype(np.float32)
    hi = _round_bf16(f)
    lo = _round_bf16(f - (hi << U32(16)).view(np.float32))
    return hi * U32(0x10001), lo * U32(0x10001)


def apply_row_scale_bf16_int4(a: np.ndarray, hi2: np.ndarray, lo2: np.ndarray) -> np.ndarray:
    """fma(a, hi, fma(a, lo, -0)) on bf16x2 registers."""
    return fma_bf16x2(a, hi2, fma_bf16x2(a, lo2, np.full_like(a, 0x80008000)))


# --- converters (csrc/convert.cuh) -------------------------------------------------------


def convert_k16(words: list[np.ndarray], z_lo, z_hi, bits: int, dtype: torch.dtype) -> list[np.ndarray]:
    """The 4 A-fragment registers of one k16 block from its 1 (int4) or 2 (int8) words."""
    z_lo, z_hi = np.asarray(z_lo, np.float64), np.asarray(z_hi, np.float64)
    if dtype == torch.float16 and bits == 4:
        w = words[0]
        top = w >> U32(8)
        lo = lambda x: lop3_and_or(x, 0x000F000F, 0x64006400)  # noqa: E731
        hi = lambda x: lop3_and_or(x, 0x00F000F0, 0x64006400)  # noqa: E731
        sub_lo, sub_hi = _pack_half2(1024 + z_lo, 1024 + z_lo), _pack_half2(1024 + z_hi, 1024 + z_hi)
        add_hi = _pack_half2(-64 - z_hi, -64 - z_hi)
        sixteenth = half2_const(1 / 16)
        return [hsub2(lo(w), sub_lo), hfma2(hi(w), sixteenth, add_hi), hsub2(lo(top), sub_lo),
                hfma2(hi(top), sixteenth, add_hi)]
    if dtype == torch.bfloat16 and bits == 4:
        w = words[0]
        lo = lambda x: lop3_and_or(x, 0x000F000F, 0x43004300)  # noqa: E731
        neg_lo = _round_bf16(-128 - z_lo) * U32(0x10001)
        neg_hi = _round_bf16(-128 - z_hi) * U32(0x10001)
        one = bf162_const(1.0)
        return [fma_bf16x2(lo(w >> U32(4 * i)), one, neg_lo if i % 2 == 0 else neg_hi) for i in range(4)]
    if dtype == torch.float16 and bits == 8:
        sub_lo, sub_hi = _pack_half2(1024 + z_lo, 1024 + z_lo), _pack_half2(1024 + z_hi, 1024 + z_hi)
        out = []
        for w in words:
            out += [hsub2(prmt(w, 0x64646464, 0x5250), sub_lo), hsub2(prmt(w, 0x64646464, 0x5351), sub_hi)]
        return out
    if dtype == torch.bfloat16 and bits == 8:
        # A = 0x4300 | (code & 0x7f) = 128 + m; B = 0xc300 | (~code & 0x80) = -128 or -256.
        # (Symmetric kernels skip the last fma: it adds bf16(128 - 128) = 0, exactly.)
        one = bf162_const(1.0)
        add_lo = _round_bf16(128 - z_lo) * U32(0x10001)
        add_hi = _round_bf16(128 - z_hi) * U32(0x10001)
        out = []
        for w in words:
            for x, add in ((w, add_lo), (w >> U32(8), add_hi)):  # bytes 0, 2: row g; bytes 1, 3: row g + 8
                a = lop3_and_or(x, 0x007F007F, 0x43004300)
                b = lop3_andnot_or(x, 0x00800080, 0xC300C300)
                out.append(fma_bf16x2(fma_bf16x2(a, one, b), one, add))
        return out
    raise ValueError((bits, dtype))


def register_values(reg, dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray]:
    return half2_values(reg) if dtype == torch.float16 else bf16_values(reg)


# --- layout inverse and a fragment-level GEMV --------------------------------------------


def lane_words(gw: GpuWeight) -> np.ndarray:
    """uint32 [n_tiles, K_pad/KT, 32 lanes, 4 words] view of the packed bytes."""
    return gw.qweight.cpu().numpy().view("<u4")


def unpack_codes_gpu(gw: GpuWeight) -> np.ndarray:
    """Codes [N_pad, K_pad] back from the packed layout (inverse of ``pack_codes_gpu``)."""
    words = lane_words(gw)
    nt, nk = words.shape[:2]
    kt = tile_k(gw.bits)
    codes = np.zeros((nt * 16, nk * kt), dtype=np.uint8)
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    for j in range(kt // 16):
        if gw.bits == 4:
            w = words[..., j]
            elems = {el: (w >> U32(4 * nib)) & U32(0xF) for nib, el in enumerate(INT4_NIBBLE_ORDER)}
        else:
            elems = {}
            for h in range(2):
                w = words[..., 2 * j + h]
                elems.update({el + 4 * h: (w >> U32(8 * b)) & U32(0xFF) for b, el in enumerate(INT8_BYTE_ORDER)})
        for el in range(8):
            rows = (np.arange(nt)[:, None, None] * 16 + (g + _ROW_OFF[el])[None, None, :])
            cols = (np.arange(nk)[None, :, None] * kt + j * 16 + (2 * t + _COL_OFF[el])[None, None, :])
            codes[rows, cols] = elems[el]
    return codes


def _tile_rows(t: torch.Tensor) -> np.ndarray:
    """[n_tiles, groups, 16] pair-interleaved -> [N_pad, groups] float64."""
    a = t.float().cpu().numpy().astype(np.float64)
    out = np.empty_like(a)
    out[:, :, list(SCALE_ROW_ORDER)] = a
    return out.transpose(0, 2, 1).reshape(-1, a.shape[1])


def emulate_gemv(x: torch.Tensor, gw: GpuWeight) -> np.ndarray:
    """y = x @ W^T computed the kernel's way, in float64: every k16 block's A fragment is
    rebuilt from the packed words by the emulated converter and placed by the mma
    fragment map; group partial sums are scaled per group, as the kernel does."""
    words = lane_words(gw)
    nt, nk = words.shape[:2]
    kt, k16 = tile_k(gw.bits), tile_k(gw.bits) // 16
    G = gw.group_size
    s_rows = _tile_rows(gw.scales)
    z_rows = _tile_rows(gw.zeros) if gw.zeros is not None else np.full_like(s_rows, 8 if gw.bits == 4 else 128)
    M = x.shape[0]
    xp = np.zeros((M, nk * kt))
    xp[:, : gw.K] = x.double().numpy()
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    y = np.zeros((M, nt * 16))
    for n_tile in range(nt):
        rows = n_tile * 16 + np.arange(16)
        for k_tile in range(nk):
            for j in range(k16):
                k0 = k_tile * kt + j * 16
                grp = k0 // G
                z = z_rows[rows, grp]
                regs = convert_k16([words[n_tile, k_tile, :, j]] if gw.bits == 4 else
                                   [words[n_tile, k_tile, :, 2 * j], words[n_tile, k_tile, :, 2 * j + 1]],
                                   z[g], z[g + 8], gw.bits, gw.dtype)
                A = np.full((16, 16), np.nan)
                for r, reg in enumerate(regs):  # a[r]: rows g (+8 if r odd), cols 2t (+8 if r >= 2)
                    lo, hi = register_values(reg, gw.dtype)
                    rr, cc = g + 8 * (r % 2), 2 * t + 8 * (r // 2)
                    A[rr, cc], A[rr, cc + 1] = lo, hi
                assert not np.isnan(A).any(), "fragment map left a hole"
                y[:, rows] += (xp[:, k0 : k0 + 16] @ A.T) * s_rows[rows, grp][None, :]
    return y[:, : gw.N]
