"""The fused Triton kernels of the decoder (``kernels/fused.py``) against the torch ops they
replace (``models/llama.py``, the CPU path) and an fp64 reference (skipped without a GPU)."""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from gpu_poison import poison_next_alloc

from woq.kernels.options import RuntimeOptions
from woq.models.attention import Rotary
from woq.models.batches import Decode, Prefill
from woq.models.builder import bind_kernels
from woq.models.kv_cache import KVCache
from woq.models.llama import RMSNorm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DTYPES = [torch.float16, torch.bfloat16]


def ulp(dtype: torch.dtype) -> float:
    return 2.0 ** -(10 if dtype == torch.float16 else 7)


def assert_same_rounding(out: torch.Tensor, torch_ops: torch.Tensor, exact: torch.Tensor) -> None:
    """``out`` equals the torch ops' result except for rare last-bit differences (an fp32 exp or
    rsqrt that differs in its last bit, carried through a second rounding: at most 2 ulp), and
    is as close to the fp64 value as they are."""
    diff = (out.double() - torch_ops.double()).abs()
    rel = diff / torch_ops.double().abs().clamp_min(1e-3)
    differ = (diff > 0).double().mean().item()
    err_out = (out.double() - exact).abs().mean().item()
    err_ref = (torch_ops.double() - exact).abs().mean().item()
    report = f"max rel diff {rel.max().item():.2e}, {100 * differ:.2f} % differ, error {err_out:.3e} vs {err_ref:.3e}"
    assert rel.max().item() <= 2.01 * ulp(out.dtype), report
    assert differ < 0.01, report
    assert err_out <= 1.01 * err_ref + 1e-12, report


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,n", [(1, 576), (5, 4096), (16, 1000), (3, 8192)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm(dtype, rows, n, with_residual):
    from woq.kernels.fused import add_rms_norm

    g = torch.Generator(device="cuda").manual_seed(rows * n)
    x = (3 * torch.randn(rows, n, device="cuda", generator=g)).to(dtype)
    res = torch.randn(rows, n, device="cuda", generator=g).to(dtype) if with_residual else None
    w = (torch.rand(n, device="cuda", generator=g) + 0.5).to(dtype)
    norm = RMSNorm(w, 1e-5)
    y, stream = add_rms_norm(x, res, w, 1e-5)
    want_stream = x + res if with_residual else x
    assert torch.equal(stream, want_stream)  # one rounding of the sum, as torch does
    h = want_stream.double()
    exact = w.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert_same_rounding(y, norm(want_stream), exact)
    for launch_next in ("inputs", "end"):  # where it lets the next kernel launch changes nothing it writes
        y2, stream2 = add_rms_norm(x, res, w, 1e-5, launch_next)
        assert torch.equal(y2, y) and torch.equal(stream2, stream), launch_next
    for launch_next in ("start", "inputs", "end"):  # nor does launching it programmatically (sm_90+)
        y2, stream2 = add_rms_norm(x, res, w, 1e-5, launch_next, programmatic=True)
        assert torch.equal(y2, y) and torch.equal(stream2, stream), (launch_next, "programmatic")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (7, 14336), (16, 1000)])
@pytest.mark.parametrize("interleaved", [False, True])
def test_silu_mul(dtype, rows, inter, interleaved):
    from woq.kernels.format import gate_up_row_order
    from woq.kernels.fused import silu_mul

    g = torch.Generator(device="cuda").manual_seed(inter)
    gate_up = (2 * torch.randn(rows, 2 * inter, device="cuda", generator=g)).to(dtype)
    gate, up = gate_up.chunk(2, -1)
    exact = F.silu(gate.double()) * up.double()
    stored = gate_up[:, gate_up_row_order(2 * inter, "cuda")] if interleaved else gate_up  # the GPU layout's order
    out = silu_mul(stored, interleaved)
    assert_same_rounding(out, F.silu(gate) * up, exact)
    assert torch.equal(silu_mul(stored, interleaved, programmatic=True), out)  # (launched programmatically)


SWIGLU_FORMATS = [(4, 128, False), (4, None, True), (8, None, True), (8, 64, False)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits,group,sym", SWIGLU_FORMATS)
@pytest.mark.parametrize("inter,K", [(1000, 576), (1536, 4096), (24, 128)])
def test_gemv_swiglu_epilogue(inter, K, bits, group, sym, dtype):
    """The GEMV's SwiGLU epilogue (gate/up rows interleaved in eights) for every launch the
    GEMV has at M = 1..16 -- both pipelines, each k-warp count, K whole per block or split
    (partials added by a column's last block) -- against the same launch's plain output
    activated by the torch ops (same sums: at most the last-bit differences of an fp32
    exp) and against fp64; a poisoned output must be wholly overwritten."""
    from woq.kernels import build, ops, reference
    from woq.kernels.format import QuantSpec, gate_up_row_order, quantize
    from woq.kernels.layout import pack_for_gpu

    assert build.load(RuntimeOptions()), "the CUDA kernels failed to build"
    lim = ops.limits()
    g = torch.Generator(device="cuda").manual_seed(inter + K + bits)
    qw = quantize(torch.randn(2 * inter, K, device="cuda", generator=g) * 0.05, QuantSpec(bits, group, sym))
    w64 = reference.dequantize(qw, torch.float64)
    gw = ops.prepare(pack_for_gpu(qw, dtype, gate_up=True))
    assert gw.swiglu_rows
    order = gate_up_row_order(2 * inter, "cuda")
    for M in range(1, 17):
        x = (2 * torch.randn(M, K, device="cuda", generator=g)).to(dtype)
        bias = torch.randn(2 * inter, device="cuda", generator=g).to(dtype) if M % 2 else None
        gate_up = x.double() @ w64.T + (bias.double() if bias is not None else 0)
        exact = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        bias_rows = None if bias is None else bias[order]
        launches = [(ops.GEMV_RING, kw, b) for kw in lim.gemv_k_warps(M) for b in (0, ops.gemv_columns(2 * inter, kw, M))]
        if M <= lim.stream_max_m:
            launches += [(ops.GEMV_STREAM, kw, b) for kw in lim.stream_k_warps
                         for b in (0, ops.gemv_stream_columns(2 * inter, kw), 3 * ops.gemv_stream_columns(2 * inter, kw))]
        for pipeline, kw, blocks in launches:
            case = f"M={M} pipeline={pipeline} k_warps={kw} blocks={blocks}"
            launch = dict(max_blocks=blocks, k_warps=kw, pipeline=pipeline)
            plain = ops.gemv(x, gw, bias_rows, **launch)  # [M, 2 I], interleaved rows
            poison_next_alloc(M * inter, dtype)
            out = ops.gemv(x, gw, bias_rows, swiglu=True, **launch)
            assert out.shape == (M, inter) and torch.isfinite(out).all(), f"{case}: unwritten output"
            assert_same_rounding(out, reference.silu_mul(plain, interleaved=True), exact)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (32, 8, 128)])
def test_rope_and_cache_writes_only_its_positions(dtype, heads, kv_heads, dim):
    from woq.kernels.fused import rope_and_cache

    g = torch.Generator(device="cuda").manual_seed(heads)
    S, T, B = 6, 300, 4
    rope = Rotary(1.0 / (500000 ** (torch.arange(0, dim, 2).float() / dim)), 1.0, T).cuda()
    qkv = torch.randn(B, (heads + 2 * kv_heads) * dim, device="cuda", generator=g).to(dtype)
    positions = torch.tensor([0, 17, 299, 128], device="cuda")
    slots = torch.tensor([5, 0, 2, 3], device="cuda")
    ours, ref = (KVCache(2, S, kv_heads, T, dim, dtype, "cuda") for _ in range(2))
    for c in (ours, ref):  # poisoned: every position not written must stay NaN
        c.k.fill_(float("nan"))
        c.v.fill_(float("nan"))
    q = rope_and_cache(qkv, positions, slots, rope.cos, rope.sin, ours.k[1], ours.v[1], heads, kv_heads, dim)

    qr, kr, vr = qkv.view(B, 1, -1).split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    pos = positions[:, None]
    q_ref = rope(qr.view(B, 1, heads, dim).transpose(1, 2), pos)[:, :, 0]
    ref.write(1, slots, positions, rope(kr.view(B, 1, kv_heads, dim).transpose(1, 2), pos)[:, :, 0],
              vr.view(B, kv_heads, dim))

    cos = rope.cos[positions].to(dtype).double()[:, None]  # the tables rounded as torch rounds them
    sin = rope.sin[positions].to(dtype).double()[:, None]

    def assert_rotation(out, torch_ops, x):
        """Within 2 ulp of the terms' magnitudes of the fp64 rotation, and on average at least
        as close to it as the torch ops (which round each product: the fused kernel may not)."""
        x = x.double()
        rot = torch.cat((-x[..., dim // 2:], x[..., : dim // 2]), -1)
        exact, scale = x * cos + rot * sin, (x * cos).abs() + (rot * sin).abs()
        err = (out.double() - exact).abs()
        assert (err <= 2 * ulp(dtype) * scale + 1e-7).all(), (err / scale).max()
        assert err.mean() <= 1.01 * (torch_ops.double() - exact).abs().mean()

    assert_rotation(q, q_ref, qr.view(B, heads, dim))
    for a, b in ((ours.k, ref.k), (ours.v, ref.v)):
        assert torch.equal(a.isnan(), b.isnan())  # the same positions written, nothing else
    assert torch.equal(ours.v.nan_to_num(), ref.v.nan_to_num())  # v is copied
    assert_rotation(ours.k[1, slots, :, positions], ref.k[1, slots, :, positions], kr.view(B, kv_heads, dim))

    again = KVCache(2, S, kv_heads, T, dim, dtype, "cuda")  # launched programmatically (sm_90+): the same writes
    again.k.fill_(float("nan"))
    again.v.fill_(float("nan"))
    q2 = rope_and_cache(qkv, positions, slots, rope.cos, rope.sin, again.k[1], again.v[1], heads, kv_heads, dim,
                        programmatic=True)
    assert torch.equal(q2, q)
    for a, b in ((again.k, ours.k), (again.v, ours.v)):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_model_decode_fused_equals_torch_ops(dtype):
    """A whole model: a packed prefill of two prompts, then decode steps, through the fused
    kernels give the logits of the torch ops (``RuntimeOptions.fused_ops`` off) within
    rounding (both fed the same tokens: the fused run's greedy ones, so that a near-tie
    cannot send the two runs apart)."""
    from conftest import random_llama

    model = random_llama(dtype, "cuda", 64)
    prompt = torch.randint(0, 512, (2, 9), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    logits, fed = {}, [prompt[:, -1:]]
    for fused in (True, False):
        bind_kernels(model, replace(RuntimeOptions(), fused_ops=fused))
        assert model.options.fused_ops == fused
        cache = KVCache(model.cfg.num_layers, 3, model.cfg.num_kv_heads, 64, model.cfg.head_dim, dtype, "cuda")
        slots = torch.tensor([2, 0], device="cuda")
        P = prompt.shape[1]
        steps = [model(prompt.view(1, -1), Prefill.pack([P, P], slots.tolist(), "cuda"), cache, last_only=True)]
        for t in range(4):
            pos = torch.full((2, 1), P + t, device="cuda")
            steps.append(model(fed[t], Decode.at(pos, slots), cache, last_only=True))
            if fused:
                fed.append(steps[-1].argmax(-1, keepdim=True))
        logits[fused] = torch.stack(steps)
    scale = logits[False].abs().max().item()
    assert (logits[True] - logits[False]).abs().max().item() <= 0.02 * scale


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_packed_prefill_and_next_step_match_an_fp32_cpu_model(dtype):
    """Prompts of 5, 1, 12 and 40 tokens prefilled in one packed forward (M = 58: the mixed
    GEMM, where each alone would take the GEMV) and a decode step after them give, per
    prompt, the logits of the same quantized model in fp32 on the CPU running that prompt
    alone; no worse than prefilling each prompt alone on the GPU."""
    from conftest import random_llama

    model = random_llama(dtype, "cuda", 64)
    cpu = random_llama(torch.float32, "cpu", 64)
    cfg, g = model.cfg, torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=g) for n in (5, 1, 12, 40)]
    nxt = torch.randint(0, 512, (len(prompts), 1), generator=g)
    slots = [3, 0, 2, 1]

    def run(groups):  # prefill the prompts in these packed groups, then one decode step for all
        cache = KVCache(cfg.num_layers, 5, cfg.num_kv_heads, 64, cfg.head_dim, dtype, "cuda")
        first = {}
        for group in groups:
            ids = torch.cat([prompts[i] for i in group])[None].cuda()
            out = model(ids, Prefill.pack([len(prompts[i]) for i in group], [slots[i] for i in group], "cuda"),
                        cache, last_only=True)
            first.update(zip(group, out))
        pos = torch.tensor([[len(p)] for p in prompts], device="cuda")
        step = model(nxt.cuda(), Decode.at(pos, torch.tensor(slots, device="cuda")), cache, last_only=True)
        return torch.stack([first[i] for i in range(len(prompts))]).cpu(), step.cpu()

    packed, alone = run([[0, 1, 2, 3]]), run([[0], [1], [2], [3]])
    refs = [cpu(torch.cat([p, nxt[i]])[None])[0] for i, p in enumerate(prompts)]
    ref_first, ref_step = torch.stack([r[-2] for r in refs]), torch.stack([r[-1] for r in refs])
    scale = ref_first.abs().max().item()
    for ours, ref in zip(packed, (ref_first, ref_step)):
        assert (ours - ref).abs().max().item() <= 0.03 * scale
    for ours, theirs, ref in zip(packed, alone, (ref_first, ref_step)):
        assert (ours - ref).abs().mean() <= 1.5 * (theirs - ref).abs().mean() + 1e-3 * scale


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunked_prefill_matches_an_fp32_cpu_model(dtype):
    """A 40-token prompt prefilled in two chunks (16 tokens, then 24 from position 16 packed
    with a whole 7-token prompt: the second chunk attends to the first one's cached keys,
    causally aligned to its end) gives the last-token logits of an fp32 CPU model."""
    from conftest import random_llama

    model = random_llama(dtype, "cuda", 64)
    cpu = random_llama(torch.float32, "cpu", 64)
    cfg, g = model.cfg, torch.Generator().manual_seed(7)
    prompt, other = torch.randint(0, 512, (40,), generator=g), torch.randint(0, 512, (7,), generator=g)
    cache = KVCache(cfg.num_layers, 2, cfg.num_kv_heads, 64, cfg.head_dim, dtype, "cuda")
    model(prompt[None, :16].cuda(), Prefill.pack([16], [1], "cuda"), cache, last_only=True)
    ours = model(torch.cat([prompt[16:], other])[None].cuda(), Prefill.pack([24, 7], [1, 0], "cuda", [16, 0]),
                 cache, last_only=True).cpu()
    ref = torch.stack([cpu(prompt[None])[0, -1], cpu(other[None])[0, -1]])
    assert (ours - ref).abs().max().item() <= 0.03 * ref.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("vocab", [100, 2048, 49152, 50257, 128256])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_argmax_rows_is_torch_argmax_ties_and_nan_included(dtype, vocab, rows):
    """The split greedy argmax (kernels/argmax.py) picks what torch.argmax picks on the CPU:
    the first index of each row's maximum, with the maximum planted twice in some rows
    (in one chunk, in two chunks, at the row's two ends) and a NaN in one row (NaN is
    the largest, as in torch)."""
    from woq.kernels.argmax import argmax_rows

    g = torch.Generator().manual_seed(vocab + rows)
    x = torch.randn(rows, vocab, generator=g).to(dtype)
    top = x.float().max() + 1
    pairs = [(5, 9), (3, vocab - 7), (0, vocab - 1)]
    for r, (i, j) in zip(range(rows), pairs):
        x[r, i] = x[r, j] = top
    if rows > 1:
        x[-1, vocab // 2] = float("nan")
    want = x.argmax(-1)  # (CPU torch: the reference)
    y = x.cuda()
    got = argmax_rows(y)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(got, y.argmax(-1))  # torch's CUDA argmax agrees too
