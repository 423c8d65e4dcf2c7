"""The dense (unquantized) GEMV against fp64, and its place in a layer's plan (skipped without a GPU)."""
import pytest
import torch
import torch.nn.functional as F

from gpu_poison import poison_next_alloc
from woq.kernels import build, ops
from woq.kernels.options import RuntimeOptions

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module", autouse=True)
def kernels_built():
    assert build.load(RuntimeOptions()), "the CUDA kernels failed to build"


# (N, K): N not a multiple of the block's 8 rows; K short of one 32-lane pass, of several
# passes with a partial last one (U = 4, 8, 16), an LM head's
SHAPES = [(1001, 72), (4099, 1544), (517, 2056), (3001, 14336), (49157, 576), (32003, 4096)]
EPS = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}  # half an ulp, relative


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    """y against x @ w.T + bias in fp64: within y's rounding plus the fp32 sums' error."""
    x64, w64 = x.double(), w.double()
    ref = x64 @ w64.T + (0 if bias is None else bias.double())
    magnitude = x64.abs() @ w64.abs().T  # (the sum of |terms| bounds the fp32 sums' error)
    tol = EPS[y.dtype] * ref.abs() + 2.0 ** -20 * magnitude + 1e-30
    err = (y.double() - ref).abs()
    assert not torch.isnan(y).any(), "an output the kernel did not write (poisoned)"
    assert (err <= tol).all(), f"worst error {(err / tol).max().item():.2f}x the tolerance"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("M", [1, 2, 3, 4])
def test_dense_gemv_matches_fp64(dtype, N, K, M):
    if M * K * 4 > ops.limits().dense_gemv_max_x_bytes:
        pytest.skip("x does not fit the kernel's shared memory at this M")
    g = torch.Generator(device="cuda").manual_seed(N + K + M)
    w = (torch.randn(N, K, device="cuda", generator=g) * 0.05).to(dtype)
    x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
    bias = torch.randn(N, device="cuda", generator=g).to(dtype) if N % 2 else None
    assert ops.dense_gemv_max_rows(w) >= M
    poison_next_alloc(M * N, dtype)
    y = ops.dense_gemv(x, w, bias)
    assert y.shape == (M, N) and y.dtype == dtype
    _check(y, x, w, bias)
    poison_next_alloc(M * N, torch.float32)
    logits = ops.dense_gemv(x, w, bias, float_out=True)  # (the same values, stored as float32)
    assert logits.dtype == torch.float32 and torch.equal(logits, y.float())


def test_dense_gemv_refuses_what_it_does_not_take():
    w = torch.randn(64, 4096, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="M must be 1..4"):
        ops.dense_gemv(torch.randn(5, 4096, device="cuda", dtype=torch.float16), w)
    with pytest.raises(ValueError, match="one dtype"):
        ops.dense_gemv(torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16), w)
    assert ops.dense_gemv_max_rows(torch.randn(64, 100, device="cuda", dtype=torch.float16)) == 0  # K % 8
    assert ops.dense_gemv_max_rows(torch.randn(64, 14336, device="cuda", dtype=torch.float16)) == 1  # x's bytes
    assert ops.dense_gemv_max_rows(w.float()) == 0


def test_an_unquantized_layer_takes_the_dense_gemv_at_decode_rows():
    """DenseLinear (an unquantized LM head) on CUDA: M <= RuntimeOptions.dense_gemv_rows (2)
    through the dense GEMV, more through cuBLAS; both against fp64, and the observed calls
    report the path."""
    from woq.kernels import plans
    from woq.kernels.observe import KernelTiming
    from woq.models.quant_linear import DenseLinear

    g = torch.Generator(device="cuda").manual_seed(1)
    w = (torch.randn(5003, 1024, device="cuda", generator=g) * 0.05).half()
    layer = DenseLinear(w, None, "lm_head")
    options = RuntimeOptions()
    assert options.dense_gemv_rows == 2  # (the default)
    layer.bind(options, kernels=True)  # (the library is loaded: kernels_built)
    seen = []

    class Observer:
        def count(self, call, calls):
            seen.extend([call.path] * calls)

        def time(self, call, seconds):
            pass

    timing = KernelTiming(Observer())  # (every call timed)
    layer.observe(timing)
    try:
        for m in (1, 2, 3):
            x = torch.randn(m, 1024, device="cuda", generator=g).half()
            y = layer(x)
            _check(y, x, w, None)
            assert torch.equal(layer.logits(x), y.float())
        timing.drain(wait=True)
    finally:
        layer.observe(None)
    assert seen == [plans.DENSE_GEMV] * 4 + [plans.DENSE] * 2
    layer.bind(RuntimeOptions(dense_gemv_rows=0), kernels=True)  # cuBLAS only
    assert layer.plan.path(1) == plans.DENSE
    x = torch.randn(1, 1024, device="cuda", generator=g).half()
    assert torch.equal(layer(x), F.linear(x, w))
    layer.bind(options, kernels=True)
    assert layer.plan.path(2) == plans.DENSE_GEMV
    x = torch.randn(2, 1024, device="cuda", generator=g).half()
    assert torch.allclose(layer(x).float(), F.linear(x, w).float(), rtol=2e-3, atol=2e-3)
