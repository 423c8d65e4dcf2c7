"""The GPU layout and the fast converters, checked bit-exactly on the CPU (no GPU needed)."""
import itertools

import numpy as np
import pytest
import torch

import emulate
from woq.kernels import reference
from woq.kernels.format import QuantSpec, quantize
from woq.kernels.layout import INT4_NIBBLE_ORDER, INT8_BYTE_ORDER, pack_for_gpu, padded_codes

DTYPES = [torch.float16, torch.bfloat16]


def _int4_word(e):  # e: [n, 8] element codes -> interleaved 32-bit words
    return sum((e[:, el].astype(np.uint32) << np.uint32(4 * nib)) for nib, el in enumerate(INT4_NIBBLE_ORDER))


def _int8_words(e):
    w = [sum((e[:, el + 4 * h].astype(np.uint32) << np.uint32(8 * b)) for b, el in enumerate(INT8_BYTE_ORDER))
         for h in range(2)]
    return w


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [4, 8])
def test_converter_gives_the_exact_integer_for_every_code_and_zero_point(bits, dtype):
    q = 1 << bits
    # every code at every element position, against every zero point (row g and g+8 apart)
    v, z = np.meshgrid(np.arange(q), np.arange(q), indexing="ij")
    v, z_lo = v.ravel(), z.ravel()
    z_hi = (q - 1) - z_lo
    e = np.stack([(v + 5 * i) % q for i in range(8)], 1)
    words = [_int4_word(e)] if bits == 4 else _int8_words(e)
    regs = emulate.convert_k16(words, z_lo.astype(float), z_hi.astype(float), bits, dtype)
    row_z = [z_lo, z_hi, z_lo, z_hi]  # a[0], a[2]: row g; a[1], a[3]: row g + 8
    for r, reg in enumerate(regs):
        lo, hi = emulate.register_values(reg, dtype)
        np.testing.assert_array_equal(lo, e[:, 2 * r] - row_z[r])
        np.testing.assert_array_equal(hi, e[:, 2 * r + 1] - row_z[r])


SHAPES = [(40, 200), (16, 64), (33, 576)]


@pytest.mark.parametrize("bits,group,sym", list(itertools.product([4, 8], [None, 32, 128], [True, False])))
def test_unpack_of_pack_is_identity(bits, group, sym):
    for N, K in SHAPES:
        qw = quantize(torch.randn(N, K), QuantSpec(bits, group, sym))
        gw = pack_for_gpu(qw, torch.float16)
        codes, N_pad, K_pad, G, _ = padded_codes(qw)
        assert gw.qweight.shape == (N_pad // 16, K_pad // (64 if bits == 4 else 32), 32, 16)
        back = emulate.unpack_codes_gpu(gw)
        np.testing.assert_array_equal(back, codes.numpy())
        np.testing.assert_array_equal(back[:N, :K], qw.codes().numpy())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits,group,sym", list(itertools.product([4, 8], [None, 32, 128], [True, False])))
def test_fragment_level_gemv_emulation_matches_fp64(bits, group, sym, dtype):
    """The kernel's data path (layout -> converter -> mma fragment map -> group scaling)
    reproduces x @ dequant(W)^T in float64 exactly up to float64 rounding."""
    g = torch.Generator().manual_seed(bits * 100 + (group or 0))
    N, K = 40, 200 if group != 128 else 576
    qw = quantize(torch.randn(N, K, generator=g), QuantSpec(bits, group, sym))  # (fp16 scales, as models have)
    gw = pack_for_gpu(qw, dtype)
    x = torch.randn(3, K, generator=g, dtype=torch.float64)
    ref = (x @ reference.dequantize(qw, torch.float64).T).numpy()
    out = emulate.emulate_gemv(x, gw)
    np.testing.assert_allclose(out, ref, rtol=1e-10, atol=1e-10)


def test_bf16_group_scaling_rounds_the_exact_product_once_for_every_fp16_scale():
    """The mixed GEMM scales bf16 int4 weights (code - z) by the fp16 scale split into
    bf16 hi + lo (csrc/gemm.cuh, RowScale): for every finite fp16 scale and every
    |code - z| <= 15 the result is the exact product rounded once to bf16 -- what
    dequantize + cuBLAS multiplies -- where a bf16 copy of the scale would not be."""
    s = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    s = s[np.isfinite(s)]
    hi2, lo2 = emulate.row_scale_bf16_int4(s)
    rounded_scale = emulate.bf16_values(hi2)[0]
    differs = 0
    for qz in range(-15, 16):
        a = emulate.bf162_const(float(qz)) * np.ones(s.shape, np.uint32)
        got = emulate.bf16_values(emulate.apply_row_scale_bf16_int4(a, hi2, lo2))[0]
        exact = qz * s.astype(np.float64)  # (at most 4 + 11 significant bits: exact)
        want = emulate.bf16_values(emulate._round_bf16(exact))[0]
        np.testing.assert_array_equal(got, want, err_msg=f"code - z = {qz}")
        differs += int((emulate.bf16_values(emulate._round_bf16(qz * rounded_scale))[0] != want).sum())
    assert differs > 0  # (the bf16-rounded scale is wrong for some: the split is what makes it exact)


def test_gpu_layout_keeps_fp16_scales_and_refuses_inexact_ones():
    from woq.kernels.layout import refusal_of
    from woq.kernels.options import RuntimeOptions
    from woq.models.quant_linear import WeightOnlyLinear

    qw = quantize(torch.randn(32, 64), QuantSpec(4, 32, False))
    gw = pack_for_gpu(qw, torch.bfloat16)
    assert gw.scales.dtype == torch.float16 and gw.zeros.dtype == torch.bfloat16
    np.testing.assert_array_equal(emulate._tile_rows(gw.scales)[:32, :2], qw.scales.double().numpy())
    # bf16 scales are exact in fp16 within its range; 1e-30 is not
    small = quantize(torch.randn(32, 64) * 1e-28, QuantSpec(4, 32, False, scale_dtype=torch.bfloat16))
    assert refusal_of(small) is not None and "fp16" in refusal_of(small)
    with pytest.raises(ValueError, match="not all exact in fp16"):
        pack_for_gpu(small, torch.bfloat16)
    layer = WeightOnlyLinear(small, None, "o")
    layer.bind(torch.bfloat16, RuntimeOptions(), gpu=True)  # refused: the torch reference, no CUDA needed
    assert layer.gpu is None


def test_layout_requirements_are_checked():
    with pytest.raises(ValueError, match="% 8"):
        pack_for_gpu(quantize(torch.randn(16, 36), QuantSpec(8)), torch.float16)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        pack_for_gpu(quantize(torch.randn(16, 64), QuantSpec(8)), torch.float32)
