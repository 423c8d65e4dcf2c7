"""The CPU's fp32 linears (``kernels/cpu_linear.py``: oneDNN, the quantized layers' weight
dequantized once and packed), against fp64 math on the exactly dequantized weight, and a
packed layer's rows against themselves in batches of other sizes."""
import pytest
import torch

from woq.kernels import reference
from woq.kernels.cpu_linear import onednn_available
from woq.kernels.format import QuantSpec, quantize
from woq.kernels.options import RuntimeOptions
from woq.models.quant_linear import DenseLinear, WeightOnlyLinear

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")
SHAPES = [(96, 576), (100, 77), (257, 1536), (3072, 576)]
SPECS = [QuantSpec(4, 128, False), QuantSpec(4, 32, True), QuantSpec(8, None, True)]


def _layer(N, K, spec, bias, onednn=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    b = torch.randn(N, generator=g) if bias else None
    return WeightOnlyLinear(quantize(w, spec), b, "o", options=RuntimeOptions(cpu_onednn=onednn))


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32's error bound of a K-term dot product computed in any order (Higham's γ_K, with
    each product rounded once), per output: K·u·Σ|x||w|, u = 2^-24."""
    return x.shape[1] * 2.0**-24 * (x.abs().double() @ w.abs().double().T)


@pytest.mark.parametrize("onednn", [pytest.param(True, marks=needs_onednn), False], ids=["onednn", "f.linear"])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe().replace(" ", "-"))
@pytest.mark.parametrize("N,K", SHAPES)
def test_quantized_layer_matches_fp64_of_the_dequantized_weight(N, K, spec, onednn):
    layer = _layer(N, K, spec, bias=K % 2 == 1, onednn=onednn)
    w = reference.dequantize(layer.qweight, torch.float64)
    for M in (1, 5, 64):
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
        out = layer(x)
        assert out.shape == (M, N)
        ref = x.double() @ w.T + (0 if layer.bias is None else layer.bias.double())
        # (a NaN fails the comparison too)
        assert ((out.double() - ref).abs() <= _bound(x, w) + 1e-12).all(), (M, (out.double() - ref).abs().max())


@needs_onednn
@pytest.mark.parametrize("N,K", SHAPES)
def test_a_packed_layers_rows_do_not_depend_on_the_batch(N, K):
    """Each row of a call has the same bits as when it runs alone or among any other number
    of rows (the decode batch a request shares, a prompt's packed chunk)."""
    layer = _layer(N, K, SPECS[0], bias=True)
    x = torch.randn(300, K, generator=torch.Generator().manual_seed(1))
    whole = layer(x)
    for lo, hi in [(0, 1), (7, 8), (0, 2), (3, 6), (0, 16), (16, 49), (100, 300), (0, 300)]:
        assert torch.equal(layer(x[lo:hi]), whole[lo:hi]), (lo, hi)


@pytest.mark.parametrize("onednn", [pytest.param(True, marks=needs_onednn), False], ids=["onednn", "f.linear"])
def test_an_unquantized_lm_head_matches_fp64(onednn):
    """The dense path (an unquantized LM head's wide weight, read in place), fp32 logits."""
    g = torch.Generator().manual_seed(2)
    w, N, K = torch.randn(8192, 576, generator=g) * 0.05, 8192, 576
    head = DenseLinear(w, None, "lm_head", options=RuntimeOptions(cpu_onednn=onednn))
    for M in (1, 3, 16):
        x = torch.randn(M, K, generator=g)
        out = head.logits(x)
        ref = x.double() @ w.double().T
        assert out.dtype == torch.float32 and out.shape == (M, N)
        assert ((out.double() - ref).abs() <= _bound(x, w.double())).all()
