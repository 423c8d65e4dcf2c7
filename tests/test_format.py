"""Quantizers, logical packing and the torch reference ops, against fp64 math."""
import itertools

import pytest
import torch

from woq.kernels import reference
from woq.kernels.format import (QuantizedWeight, QuantSpec, gate_up_row_order, interleave_gate_up, pack_codes, quantize,
                               unpack_codes)

SPECS = [QuantSpec(b, g, s) for b, g, s in itertools.product((8, 4), (None, 32, 64, 128), (True, False))]


def _weights(N=96, K=576, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g, dtype=torch.float64) * 0.05
    w[3] = 0.0  # an all-zero row: scales must stay finite and zeros exact
    w[5, :40] *= 30  # an outlier block
    return w


@pytest.mark.parametrize("K", [130, 131])
@pytest.mark.parametrize("bits", [8, 4])
def test_pack_unpack_roundtrip_bit_exact(bits, K):
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 1 << bits, (37, K), generator=g, dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (37, -(-K * bits // 8))  # (int4, odd K: half of the last byte is padding)
    assert torch.equal(unpack_codes(packed, bits, K), codes)
    if bits == 4:  # element 2j in the low nibble, 2j+1 in the high nibble
        assert int(packed[0, 0]) == int(codes[0, 0]) | int(codes[0, 1]) << 4


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe().replace(" ", "-"))
def test_quantize_error_bound_and_codes(spec):
    w = _weights()
    qw = quantize(w.float(), spec)
    N, K = w.shape
    G = spec.group_size or K
    assert qw.num_groups == -(-K // G) and qw.scales.shape == (N, qw.num_groups)
    codes = qw.codes().long()
    assert codes.max() < (1 << spec.bits)
    deq = reference.dequantize(qw, torch.float64)
    # fp64 reference of the same formula, independent of the implementation's grouping code
    s = qw.scales.double().repeat_interleave(G, 1)[:, :K]
    z = qw.zero_points().double().repeat_interleave(G, 1)[:, :K]
    assert torch.equal(deq, (codes.double() - z) * s)
    # round-to-nearest: every weight within half a step of its dequantized value (the
    # slack covers only the fp32 arithmetic of the quantizer)
    assert ((w - deq).abs() <= s / 2 + w.abs() * 2**-21).all()
    assert torch.equal(deq[3], torch.zeros(K, dtype=torch.float64))  # zero row stays zero
    if spec.symmetric:
        assert qw.zeros is None
        if spec.bits == 8:
            assert codes.min() >= 1  # int8 symmetric is [-127, 127] + 128


def test_asymmetric_uses_full_range_and_beats_symmetric_on_skewed_weights():
    w = torch.rand(64, 256, dtype=torch.float64) * 0.1 + 0.02  # all positive
    err = {}
    for sym in (True, False):
        qw = quantize(w.float(), QuantSpec(4, 64, sym))
        err[sym] = (reference.dequantize(qw, torch.float64) - w).pow(2).mean()
    assert err[False] < err[True] / 2


@pytest.mark.parametrize("K", [256, 77])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_linear_matches_fp64(dtype, K):
    w = _weights(N=80, K=K)
    qw = quantize(w.float(), QuantSpec(4, 64, False))
    x = torch.randn(7, K, dtype=torch.float64)
    bias = torch.randn(80, dtype=torch.float64)
    ref = x @ reference.dequantize(qw, torch.float64).T + bias
    out = reference.linear(x.to(dtype), qw, bias.to(dtype)).double()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out - ref).norm() / ref.norm() < tol


def test_validation_names_the_problem():
    qw = quantize(torch.randn(8, 64), QuantSpec(4, 32, False))
    with pytest.raises(ValueError, match="scales"):
        QuantizedWeight(qw.packed, qw.scales[:, :1], qw.zeros, 4, 32, 64, 8)
    with pytest.raises(ValueError, match="packed"):
        QuantizedWeight(qw.packed[:, :-1], qw.scales, qw.zeros, 4, 32, 64, 8)
    with pytest.raises(ValueError, match="bits"):
        QuantSpec(bits=3)


@pytest.mark.parametrize("spec", [QuantSpec(4, 64, False), QuantSpec(4, 64, True), QuantSpec(8, None, True)],
                         ids=lambda s: s.describe().replace(" ", "-"))
def test_clip_search_never_does_worse_than_min_max(spec):
    from woq.kernels.format import _grouped, clip_search_params, quantize_params, quantize_with_params

    w = _weights()
    G = spec.group_size or w.shape[1]

    def err(params):
        s, z = params
        q = quantize_with_params(w.float(), s, None if z is None else z.to(torch.uint8), spec.bits, G).double()
        zz = (torch.full_like(s, 128 if spec.bits == 8 else 8) if z is None else z).double()
        deq = (_grouped(q, G) - zz[..., None]) * s.double()[..., None]
        return (deq - _grouped(w, G)).abs().pow(2.4).sum((1, 2))  # per row

    searched, plain = err(clip_search_params(w, spec)), err(quantize_params(w, spec))
    assert (searched <= plain * (1 + 1e-6)).all() and searched.sum() < plain.sum()


def test_gate_up_interleave_pairs_each_gate_row_with_its_up_row():
    """The GPU layout's gate/up order (kernels/format.py): a permutation whose 16-row tiles
    hold gate rows 8j..8j+7 over up rows 8j..8j+7; the interleaved weight dequantizes to
    the permuted rows, and SwiGLU over the permuted output equals it over the plain one."""
    import torch.nn.functional as F

    inter, K = 40, 96
    qw = quantize(torch.randn(2 * inter, K), QuantSpec(4, 32, False))
    order = gate_up_row_order(2 * inter)
    assert sorted(order.tolist()) == list(range(2 * inter))
    tiles = order.view(-1, 2, 8)  # [tile, (gate, up), row]
    assert torch.equal(tiles[:, 0].reshape(-1), torch.arange(inter))
    assert torch.equal(tiles[:, 1] - tiles[:, 0], torch.full((inter // 8, 8), inter))
    assert torch.equal(reference.dequantize(interleave_gate_up(qw)), reference.dequantize(qw)[order])
    y = reference.linear(torch.randn(5, K), qw)
    torch.testing.assert_close(reference.silu_mul(y), F.silu(y[:, :inter]) * y[:, inter:], rtol=1e-6, atol=0)
    assert torch.equal(reference.silu_mul(y[:, order], interleaved=True), reference.silu_mul(y))
    with pytest.raises(ValueError, match="I % 8"):
        gate_up_row_order(2 * 20)
