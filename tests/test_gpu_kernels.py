"""CUDA kernels against an fp64 reference (skipped without a GPU; run by benchmarks/gpu_check.sh)."""
import itertools
import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from gpu_poison import poison_next_alloc
from woq.kernels import build, ops, plans, reference
from woq.kernels.format import QuantSpec, quantize
from woq.kernels.layout import pack_for_gpu
from woq.kernels.options import RuntimeOptions

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# N not a multiple of 64 (nor 16 for one), K of several groups (and a partial last g128 group)
SHAPES = [(1000, 576), (4104, 1536), (200, 4096), (24, 128)]
FORMATS = list(itertools.product([4, 8], [None, 64, 128], [True, False]))


@pytest.fixture(scope="module", autouse=True)
def kernels_built():
    assert build.load(RuntimeOptions()), "the CUDA kernels failed to build"


def _forced_plan(gw, bias, path: str) -> plans.KernelPlan:
    """A plan of ``gw`` whose thresholds send every M down ``path`` (mixed_gemm or
    dequant_cublas), with the kernels' own launches (no measured grids or tiles)."""
    max_kernel_m = {plans.MIXED_GEMM: 1 << 20, plans.DEQUANT_CUBLAS: 0}[path]
    entry = {"grids": {}, "gemm": {}, "gemv_max_m": 0, "max_kernel_m": max_kernel_m}
    return plans.KernelPlan(gw, bias, entry, RuntimeOptions())


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


def _case(N, K, bits, group, sym, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(N, K, device="cuda", generator=g) * 0.05
    qw = quantize(w, QuantSpec(bits, group, sym))
    w64 = reference.dequantize(qw, torch.float64)
    return qw, w64, g


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits,group,sym", FORMATS)
@pytest.mark.parametrize("N,K", SHAPES)
def test_gemv_matches_fp64_for_every_m(N, K, bits, group, sym, dtype):
    qw, w64, g = _case(N, K, bits, group, sym, dtype, seed=N + K + bits)
    gw = ops.prepare(pack_for_gpu(qw, dtype))
    w_lowp = w64.to(dtype)  # what dequant + cuBLAS would multiply
    assert ops.gemv_rows_limit(gw) == 32  # (these formats: per-channel, g64, g128)
    for M in range(1, 33):  # 1 to 4 row blocks, every tail
        x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
        bias = torch.randn(N, device="cuda", generator=g).to(dtype) if M % 2 else None
        ref = x.double() @ w64.T + (bias.double() if bias is not None else 0)
        cublas = F.linear(x, w_lowp, bias)
        err_cublas = _rel(cublas, ref)
        for k_warps in (0, *ops.limits().gemv_k_warps(M)):  # the kernel's own choice, then each split of K
            poison_next_alloc(M * N, dtype)
            y = ops.gemv(x, gw, bias, k_warps=k_warps)
            assert y.shape == (M, N) and torch.isfinite(y).all(), f"M={M} k_warps={k_warps}: unwritten output"
            err = _rel(y, ref)
            assert err <= 2 * err_cublas + 1e-6, f"M={M} k_warps={k_warps}: rel err {err:.2e} vs cuBLAS {err_cublas:.2e}"


STREAM_FORMATS = list(itertools.product([4, 8], [None, 32, 64, 128, 256], [True, False]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits,group,sym", STREAM_FORMATS)
@pytest.mark.parametrize("N,K", SHAPES)
def test_register_stream_gemv_matches_fp64_for_every_grid(N, K, bits, group, sym, dtype):
    """The register-stream pipeline (M <= 8): every k-warp count, K whole per block or cut
    into runs (partials added by each column's last block), every group size; repeated
    calls give the same bits (counters re-armed, partials added in split order)."""
    qw, w64, g = _case(N, K, bits, group, sym, dtype, seed=N + K + bits + 1)
    gw = ops.prepare(pack_for_gpu(qw, dtype))
    w_lowp = w64.to(dtype)
    for M in range(1, ops.limits().stream_max_m + 1):
        x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
        bias = torch.randn(N, device="cuda", generator=g).to(dtype) if M % 2 else None
        ref = x.double() @ w64.T + (bias.double() if bias is not None else 0)
        err_cublas = _rel(F.linear(x, w_lowp, bias), ref)
        for k_warps in (0, *ops.limits().stream_k_warps):
            columns = ops.gemv_stream_columns(N, max(k_warps, 1))
            for blocks in (0, columns, 3 * columns, 1000 * columns):  # (the launcher cuts to whole chunks)
                poison_next_alloc(M * N, dtype)
                y = ops.gemv(x, gw, bias, max_blocks=blocks, k_warps=k_warps, pipeline=ops.GEMV_STREAM)
                case = f"M={M} k_warps={k_warps} blocks={blocks}"
                assert y.shape == (M, N) and torch.isfinite(y).all(), f"{case}: unwritten output"
                err = _rel(y, ref)
                assert err <= 2 * err_cublas + 1e-6, f"{case}: rel err {err:.2e} vs cuBLAS {err_cublas:.2e}"
                poison_next_alloc(M * N, dtype)
                again = ops.gemv(x, gw, bias, max_blocks=blocks, k_warps=k_warps, pipeline=ops.GEMV_STREAM)
                assert torch.equal(again, y), f"{case}: not deterministic"


@pytest.mark.parametrize("bits,group,sym", [(4, 128, False), (4, None, True), (8, None, True), (8, 64, False)])
def test_register_stream_gemv_keeps_bf16_range(bits, group, sym):
    """bf16's range, which fp16 lacks, through every stream launch: rows far outside fp16's
    range (1e6, 1e-9), a row of spikes 3e4x its other elements, and a row of zeros must come
    out as bf16 cuBLAS on the dequantized weight does, row by row (a kernel that computed in
    fp16 -- as a trial of running bf16 through the fp16 converter did, with x rescaled --
    must keep this; docs/bench/gemv_bf16_gap.md)."""
    N, K, dtype = 1000, 4096, torch.bfloat16
    qw, w64, g = _case(N, K, bits, group, sym, dtype, seed=bits + (group or 0))
    gw = ops.prepare(pack_for_gpu(qw, dtype))
    x = torch.randn(5, K, device="cuda", generator=g)
    x[0] *= 1e6  # fp16 overflows at 65504
    x[1] *= 1e-9  # fp16's smallest subnormal is 6e-8
    x[2, ::97] *= 3e4
    x[3] = 0
    x = x.to(dtype)
    ref = x.double() @ w64.T
    cublas = F.linear(x, w64.to(dtype))
    for k_warps in (0, *ops.limits().stream_k_warps):
        columns = ops.gemv_stream_columns(N, max(k_warps, 1))
        for blocks in (0, 3 * columns):
            poison_next_alloc(5 * N, dtype)
            y = ops.gemv(x, gw, max_blocks=blocks, k_warps=k_warps, pipeline=ops.GEMV_STREAM)
            case = f"k_warps={k_warps} blocks={blocks}"
            assert torch.isfinite(y).all(), f"{case}: non-finite output"
            assert torch.equal(y[3], torch.zeros_like(y[3])), f"{case}: a zero row gave non-zeros"
            for m in (0, 1, 2, 4):
                err, err_cublas = _rel(y[m], ref[m]), _rel(cublas[m], ref[m])
                assert err <= 2 * err_cublas + 1e-6, f"{case} row {m}: rel err {err:.2e} vs cuBLAS {err_cublas:.2e}"


def test_register_stream_gemv_refuses_what_it_does_not_take():
    dtype = torch.float16
    qw, _, _ = _case(256, 512, 4, 128, False, dtype, seed=5)
    gw = ops.prepare(pack_for_gpu(qw, dtype))
    with pytest.raises(ValueError, match="1 to 8 rows"):
        ops.gemv(torch.randn(9, 512, device="cuda", dtype=dtype), gw, pipeline=ops.GEMV_STREAM)
    with pytest.raises(ValueError, match="k_warps 0 \\(by shape\\), 1, 2, 4 or 8"):
        ops.gemv(torch.randn(2, 512, device="cuda", dtype=dtype), gw, k_warps=3, pipeline=ops.GEMV_STREAM)
    with pytest.raises(ValueError, match="k_warps must be 0 \\(by shape\\), 1, 2 or 4"):
        ops.gemv(torch.randn(2, 512, device="cuda", dtype=dtype), gw, k_warps=8, pipeline=ops.GEMV_RING)


@pytest.mark.parametrize("bits,group", [(4, 256), (8, 256), (8, None)])
@pytest.mark.parametrize("K", [8, 120, 264])
def test_gemv_stages_past_k_read_no_stale_shared_memory(K, bits, group):
    """K shorter than a pipeline stage, or a group padding K past a whole stage: the zero
    weights past K must meet zeros (the copies zero-fill x there), not what an earlier
    launch left in shared memory (here: NaNs, from a call on NaN activations)."""
    dtype = torch.float16
    qw, w64, g = _case(200, K, bits, group, False, dtype, seed=K + bits)
    gw = ops.prepare(pack_for_gpu(qw, dtype))
    big = ops.prepare(pack_for_gpu(quantize(torch.randn(4096, 4096, device="cuda"), QuantSpec(bits, group, False)), dtype))
    lim = ops.limits()
    launches = [(ops.GEMV_RING, kw) for kw in lim.ring_k_warps] + [(ops.GEMV_STREAM, kw) for kw in lim.stream_k_warps]
    for M in (1, 5, 16):
        x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
        ref = x.double() @ w64.T
        for pipeline, k_warps in launches:
            if pipeline == ops.GEMV_STREAM and M > lim.stream_max_m:
                continue
            nan_x = torch.full((M, 4096), float("nan"), device="cuda", dtype=dtype)
            ops.gemv(nan_x, big, k_warps=k_warps, pipeline=pipeline)
            y = ops.gemv(x, gw, k_warps=k_warps, pipeline=pipeline)
            case = f"M={M} k_warps={k_warps} pipeline={pipeline}"
            assert torch.isfinite(y).all(), f"{case}: stale shared memory reached the output"
            assert _rel(y, ref) < 2e-3, case


@pytest.mark.parametrize("pipeline,m", [(ops.GEMV_RING, 1), (ops.GEMV_RING, 16), (ops.GEMV_STREAM, 4)])
def test_gemv_block_stamps_change_no_bits_and_lie_within_the_call(pipeline, m):
    """A GEMV launched with block stamps (a timed twin's GEMV, kernels/observe.py) computes the
    same bits; each block stamps a start no later than its end, blocks past the buffer write
    nothing, and the stamped span lies within the call's event-timed span."""
    qw, _, g = _case(4104, 4096, 4, 128, False, torch.float16, seed=7)
    gw = ops.prepare(pack_for_gpu(qw, torch.float16))
    x = torch.randn(m, 4096, device="cuda", generator=g).half()
    plain = ops.gemv(x, gw, pipeline=pipeline)
    stamps = torch.zeros(2 * 4096, dtype=torch.int64, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    y = ops.gemv(x, gw, pipeline=pipeline, stamps=stamps)
    end.record()
    torch.cuda.synchronize()
    assert torch.equal(y, plain)
    pairs = stamps.view(-1, 2)
    used = pairs[pairs[:, 0] > 0]
    assert len(used) > 0 and (used[:, 1] >= used[:, 0]).all() and (pairs[pairs[:, 0] == 0] == 0).all()
    assert (pairs[len(used):] == 0).all()  # (blocks stamp their own pair: the first len(used) of them)
    span_ms = (used[:, 1].max() - used[:, 0].min()).item() / 1e6
    assert 0 < span_ms <= start.elapsed_time(end) + 0.002  # (+2 us: the two clocks' resolutions)
    few = torch.zeros(4, dtype=torch.int64, device="cuda")  # room for two blocks only
    assert torch.equal(ops.gemv(x, gw, pipeline=pipeline, stamps=few), plain)
    torch.cuda.synchronize()
    assert (few.view(-1, 2)[:, 0] > 0).all()


@pytest.mark.parametrize("config,splits,m", [(9, 0, 16), (5, 0, 24), (8, 0, 200), (3, 0, 64), (4, 3, 40)])
def test_gemm_block_stamps_change_no_bits_and_lie_within_the_call(config, splits, m):
    """The mixed GEMM launched with block stamps (a timed twin's GEMM, kernels/observe.py)
    computes the same bits, stream-K or split-K, wgmma or mma; the blocks that ran stamp a
    start no later than their end, and the stamped span lies within the call's event-timed
    span."""
    if config not in ops.gemm_configs():
        pytest.skip(f"tile config {config} is not built for this GPU")
    qw, _, g = _case(4104, 4096, 4, 128, False, torch.float16, seed=11)
    gw = ops.prepare(pack_for_gpu(qw, torch.float16))
    x = torch.randn(m, 4096, device="cuda", generator=g).half()
    plain = ops.gemm(x, gw, config=config, splits=splits)
    stamps = torch.zeros(2 * 4096, dtype=torch.int64, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    y = ops.gemm(x, gw, config=config, splits=splits, stamps=stamps)
    end.record()
    torch.cuda.synchronize()
    assert torch.equal(y, plain)
    pairs = stamps.view(-1, 2)
    used = pairs[pairs[:, 0] > 0]
    assert len(used) > 0 and (used[:, 1] >= used[:, 0]).all() and (pairs[len(used):] == 0).all()
    span_ms = (used[:, 1].max() - used[:, 0].min()).item() / 1e6
    assert 0 < span_ms <= start.elapsed_time(end) + 0.002  # (+2 us: the two clocks' resolutions)
    few = torch.zeros(2, dtype=torch.int64, device="cuda")  # room for one block only
    assert torch.equal(ops.gemm(x, gw, config=config, splits=splits, stamps=few), plain)
    torch.cuda.synchronize()
    assert (few > 0).all()


def test_misaligned_activations_are_realigned_or_refused():
    """A view of x that does not start on a 16-byte boundary: the op wrappers (which every
    layer's plan calls) copy it; the raw op refuses it with a clear error (its copies move
    16-byte units)."""
    from woq.kernels.scratch import scratch

    dtype = torch.float16
    qw, w64, g = _case(256, 512, 4, 128, False, dtype, seed=3)
    gw = ops.prepare(pack_for_gpu(qw, dtype))
    x = torch.randn(3 * 512 + 4, device="cuda", generator=g).to(dtype)[4:].view(3, 512)  # 8 bytes off
    assert x.is_contiguous() and x.data_ptr() % 16
    ref = x.double() @ w64.T
    assert _rel(ops.gemv(x, gw), ref) < 2e-3
    if ops.supports_mixed_gemm(gw):
        assert _rel(ops.gemm(x, gw), ref) < 2e-3
    s = scratch(x.device)
    with pytest.raises(ValueError, match="16-byte boundary"):
        torch.ops.woq.gemv(x, gw.qweight, gw.scales, gw.zeros, None, gw.bits, gw.group_size, gw.N, gw.K, 0, 0,
                           ops.GEMV_RING, False, s.workspace, s.counters)


GEMM_MS = (1, 9, 16, 17, 31, 48, 64, 100, 128, 256, 1000, 4096)  # tails of every tile configuration


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits,group,sym", [f for f in FORMATS if f[1] in (None, 64, 128)])
@pytest.mark.parametrize("N,K", [(1000, 576), (4104, 1536)])
def test_mixed_gemm_matches_fp64_beyond_the_gemv(N, K, bits, group, sym, dtype):
    qw, w64, g = _case(N, K, bits, group, sym, dtype, seed=N + 3 * K + bits)
    gw = ops.prepare(pack_for_gpu(qw, dtype))
    w_lowp = w64.to(dtype)
    for M in GEMM_MS:
        x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
        bias = torch.randn(N, device="cuda", generator=g).to(dtype) if M % 2 else None
        ref = x.double() @ w64.T + (bias.double() if bias is not None else 0)
        err_cublas = _rel(F.linear(x, w_lowp, bias), ref)
        for config in (-1, *ops.gemm_configs()):  # the kernel's own choice by M, then each tile shape
            poison_next_alloc(M * N, dtype)
            y = ops.gemm(x, gw, bias, config=config)
            assert y.shape == (M, N) and torch.isfinite(y).all(), f"M={M} config={config}: unwritten output"
            err = _rel(y, ref)
            assert err <= 2 * err_cublas + 1e-6, f"M={M} config={config}: rel err {err:.2e} vs cuBLAS {err_cublas:.2e}"
        # a layer's plan sent down each path (no measured launches: the kernels' own)
        gemm_plan, dense_plan = (_forced_plan(gw, bias, p) for p in (plans.MIXED_GEMM, plans.DEQUANT_CUBLAS))
        assert gemm_plan.path(M) == plans.MIXED_GEMM and dense_plan.path(M) == plans.DEQUANT_CUBLAS
        assert torch.equal(gemm_plan(x), ops.gemm(x, gw, bias))
        dense = dense_plan(x)
        assert _rel(dense, ref) <= 2 * err_cublas + 1e-6


def test_hopper_builds_carry_the_wgmma_configurations():
    """On an H100/H200 the build targets sm_90a, so the GEMM tests above and below run the
    wgmma tiles instead of skipping them; elsewhere those tiles are refused, not run empty."""
    wgmma = ops.limits().wgmma_configs
    assert wgmma, "the library lists its wgmma tile configurations"
    if torch.cuda.get_device_capability() == (9, 0):
        assert ops.wgmma_configs_available() and wgmma <= set(ops.gemm_configs())
    else:
        assert not ops.wgmma_configs_available()
        x = torch.randn(64, 512, device="cuda", dtype=torch.float16)
        gw = ops.prepare(pack_for_gpu(quantize(torch.randn(256, 512, device="cuda"), QuantSpec(4, 128, False)),
                                      torch.float16))
        with pytest.raises(ValueError, match="wgmma"):
            ops.gemm(x, gw, config=min(wgmma))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("config", range(10))  # ops.limits().gemm_tiles (checked below)
@pytest.mark.parametrize("bits,group", [(4, 128), (8, None), (8, 64)])
def test_mixed_gemm_split_k_is_deterministic(bits, group, config, dtype):
    """Each split count is correct and repeats bit for bit (partials added in split order,
    counters re-armed by each tile's last block, also under graph-style back-to-back calls)."""
    assert sorted(ops.limits().gemm_tiles) == list(range(10)), "parametrize over every tile configuration"
    if config not in ops.gemm_configs():
        pytest.skip(f"config {config} needs wgmma (an sm_90a build on an H100/H200)")
    qw, w64, g = _case(700, 4096, bits, group, True, dtype, seed=11)
    gw = ops.prepare(pack_for_gpu(qw, dtype))
    x = torch.randn(70, 4096, device="cuda", generator=g).to(dtype)
    ref = x.double() @ w64.T
    err_cublas = _rel(F.linear(x, w64.to(dtype)), ref)
    for splits in (1, 2, 3, 5, 8, 0):
        first = ops.gemm(x, gw, config=config, splits=splits)
        assert _rel(first, ref) <= 2 * err_cublas + 1e-6, f"splits={splits}"
        for _ in range(3):
            poison_next_alloc(70 * 700, dtype)
            assert torch.equal(ops.gemm(x, gw, config=config, splits=splits), first), f"splits={splits}"


# Shared memory per block and per SM of smaller GPUs than the one testing (woq_kernels.h).
SMALLER_GPUS = {"T4": 64 << 10, "RTX30/40": 99 << 10, "A100": 163 << 10}


@pytest.mark.parametrize("gpu", list(SMALLER_GPUS))
@pytest.mark.parametrize("bits,group,sym", [(4, 128, False), (8, None, True)])
def test_smaller_gpus_get_shallower_rings_that_give_the_same_results(gpu, bits, group, sym):
    """With the shared memory of a T4, an RTX 30/40 or an A100, the launchers plan
    shallower rings (2 or 3 stages) or fewer k-warps: every launch that runs matches
    fp64, every one that cannot fit is refused with a clear error, and the kernels' own
    choices (k_warps, tile config left to them) always run. At T4 size, the int4 g128
    GEMV of 32 rows is refused at any k-warps (even two stages exceed 64 KB), which shows
    the limit reaches the planner; at A100 size every launch fits."""
    dtype = torch.float16
    qw, w64, g = _case(1000, 1536, bits, group, sym, dtype, seed=bits)
    gw = ops.prepare(pack_for_gpu(qw, dtype))
    refused = []
    with ops.shared_memory_limit(SMALLER_GPUS[gpu]):
        for M in (1, 8, 16, 17, 32):
            x = torch.randn(M, 1536, device="cuda", generator=g).to(dtype)
            ref = x.double() @ w64.T
            for k_warps in (0, *ops.limits().gemv_k_warps(M)):  # (0: the kernel's own choice)
                poison_next_alloc(M * 1000, dtype)
                try:
                    y = ops.gemv(x, gw, k_warps=k_warps)
                except ValueError as e:
                    assert "fits this GPU's shared memory" in str(e)
                    refused.append(("gemv", M, k_warps))
                    continue
                assert torch.isfinite(y).all() and _rel(y, ref) < 2e-3, f"gemv M={M} k_warps={k_warps}"
        for M in (48, 100, 128) if gpu != "T4" else ():  # (a T4 runs dequantize + cuBLAS there)
            x = torch.randn(M, 1536, device="cuda", generator=g).to(dtype)
            ref = x.double() @ w64.T
            # (the mma configurations: GPUs this small have no wgmma)
            for config in (-1, *(c for c in ops.gemm_configs() if c not in ops.limits().wgmma_configs)):
                poison_next_alloc(M * 1000, dtype)
                try:
                    y = ops.gemm(x, gw, config=config, splits=0)
                except ValueError as e:
                    assert "fits this GPU's shared memory" in str(e)
                    refused.append(("gemm", M, config))
                    continue
                assert torch.isfinite(y).all() and _rel(y, ref) < 2e-3, f"gemm M={M} config={config}"
    assert not [r for r in refused if r[2] in (0, -1) and r[1] <= 16 or r[0] == "gemm" and r[2] == -1]
    t4_int4_wide = [("gemv", 32, kw) for kw in (0, 1, 2)]
    if gpu == "T4" and bits == 4:
        assert set(t4_int4_wide) <= set(refused)
    if gpu == "A100":
        assert refused == []
    y = ops.gemv(torch.randn(32, 1536, device="cuda", generator=g).to(dtype), gw)  # the limit is lifted
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("gpu", ["T4", "RTX30/40"])
def test_tuner_on_smaller_gpus_chooses_only_launches_that_fit(gpu):
    """The tuner under a smaller GPU's shared memory: refused launches are never chosen, every
    chosen one runs and matches fp64, and where no GEMV launch of 32 rows fits (int4 g128
    on a T4: two stages exceed 64 KB) the GEMV's reach stops below 32 rows."""
    from woq.kernels import tuning

    dtype = torch.float16
    qw, w64, g = _case(1000, 1536, 4, 128, False, dtype, seed=21)
    gw = ops.prepare(pack_for_gpu(qw, dtype))
    with ops.shared_memory_limit(SMALLER_GPUS[gpu]):
        entry = tuning.measure(gw)
        if gpu == "T4":
            assert "32" not in entry["grids"] and entry["gemv_max_m"] < 32
        assert entry["grids"], "no GEMV launch chosen"
        for m, (k_warps, blocks, pipeline) in entry["grids"].items():
            x = torch.randn(int(m), 1536, device="cuda", generator=g).to(dtype)
            y = ops.gemv(x, gw, max_blocks=blocks, k_warps=k_warps, pipeline=pipeline)
            assert _rel(y, x.double() @ w64.T) < 2e-3, f"M={m}"
        for m, (config, splits) in entry["gemm"].items():
            x = torch.randn(int(m), 1536, device="cuda", generator=g).to(dtype)
            y = ops.gemm(x, gw, config=config, splits=splits)
            assert _rel(y, x.double() @ w64.T) < 2e-3, f"M={m}"


GRID_CASES = [(m, bits, group, kw) for m in (5, 27) for bits, group in [(4, 128), (4, 32), (8, 256), (8, None)]
              for kw in (1, 2, 4) if m <= 16 or (group in (None, 64, 128) and kw <= 2)]  # (27: 4 row blocks)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,bits,group,k_warps", GRID_CASES)
def test_any_grid_gives_the_same_bits(m, bits, group, k_warps, dtype):
    """Cutting columns between blocks (partials reduced in block order) gives exactly the
    one-block-per-column result, whatever the grid, call after call (counters re-armed)."""
    qw, w64, g = _case(3000, 4096, bits, group, False, dtype, seed=7)
    gw = ops.prepare(pack_for_gpu(qw, dtype))
    x = torch.randn(m, 4096, device="cuda", generator=g).to(dtype)
    ref = x.double() @ w64.T
    columns = ops.gemv_columns(3000, k_warps, m)
    whole = ops.gemv(x, gw, max_blocks=columns, k_warps=k_warps)  # one block per column: no partials
    assert _rel(whole, ref) < 2e-3
    for blocks in (1, 2, 7, 50, 200, 1000, 0):
        for _ in range(3):  # counters must be re-armed by each column's last contributor
            poison_next_alloc(m * 3000, dtype)
            y = ops.gemv(x, gw, max_blocks=blocks, k_warps=k_warps)
            assert torch.isfinite(y).all()
            assert _rel(y, ref) < 2e-3, f"max_blocks={blocks}"
            if blocks == 1:  # a single block sums in the same order as whole columns
                assert torch.equal(y, whole)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits,group,sym", FORMATS)
def test_dequantize_kernel_is_bit_exact(bits, group, sym, dtype):
    qw, w64, _ = _case(1000, 576, bits, group, sym, dtype, seed=3)
    gw = pack_for_gpu(qw, dtype)
    out = torch.full((1000 * 576,), float("nan"), dtype=dtype, device="cuda")
    dense = ops.dequantize(gw, out)
    assert torch.equal(dense, reference.dequantize(qw, torch.float32).to(dtype))


def test_gemv_under_cuda_graph_and_measured_dispatch(tmp_path):
    from woq.kernels import tuning
    from woq.models.quant_linear import WeightOnlyLinear

    options = RuntimeOptions(cache_dir=tmp_path, shipped_tables=False)  # measured anew (tune: on, the default)
    torch.manual_seed(0)
    layer = WeightOnlyLinear.from_float(torch.randn(4096, 4096, device="cuda") * 0.02, None,
                                        QuantSpec(4, 128, False), "down")
    layer.bind(torch.float16, options, gpu=True)  # measures grids and the crossover, saves them
    assert layer.gpu is not None and isinstance(layer.plan, plans.KernelPlan)
    saved = json.loads(next((tmp_path / "tuning").glob("*.json")).read_text())
    entry = saved[tuning.shape_key(layer.gpu)]
    assert set(entry["grids"]) == {str(m) for m in tuning.GEMV_TUNED_MS}
    assert 16 <= entry["max_kernel_m"] <= max(tuning.GEMM_MS)
    tiles = ops.limits().gemm_tiles
    assert entry["gemm"] and all(c in tiles and s >= 0 for c, s in entry["gemm"].values())  # (splits 0: stream-K)
    assert entry["gemv_max_m"] in (8, 16, 17, 24, 32) and layer.plan.gemv_max_m == entry["gemv_max_m"]
    assert layer.plan.max_kernel_m == entry["max_kernel_m"]
    x = torch.randn(4, 4096, device="cuda", dtype=torch.float16)
    assert layer.plan.path(x.shape[0]) == plans.GEMV
    for m in (8, 9, 16, 17, 24, 25, 32, 33, 64, 65, 300, 2000):
        path = layer.plan.path(m)
        expect = (plans.GEMV if m <= entry["gemv_max_m"] else
                  plans.MIXED_GEMM if m <= entry["max_kernel_m"] else plans.DEQUANT_CUBLAS)
        assert path == expect, (m, path)
    eager = layer(x)
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        layer(static_x)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        out = layer(static_x)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    ref = x.double() @ reference.dequantize(layer.qweight, torch.float64).T
    big = torch.randn(64, 4096, device="cuda", dtype=torch.float16)
    assert _rel(layer(big), big.double() @ reference.dequantize(layer.qweight, torch.float64).T) < 2e-3
    assert _rel(eager, ref) < 2e-3


def test_bad_arguments_raise_clear_errors():
    qw = quantize(torch.randn(64, 128, device="cuda"), QuantSpec(4, 64, False))
    gw = ops.prepare(pack_for_gpu(qw, torch.float16))
    with pytest.raises(ValueError, match="1 to 32 rows"):
        ops.gemv(torch.randn(33, 128, device="cuda", dtype=torch.float16), gw)
    g32 = ops.prepare(pack_for_gpu(quantize(torch.randn(64, 128, device="cuda"), QuantSpec(4, 32, False)),
                                   torch.float16))
    with pytest.raises(ValueError, match="1 to 16 rows"):  # (g32: the GEMV's 16 rows, no more)
        ops.gemv(torch.randn(17, 128, device="cuda", dtype=torch.float16), g32)
    with pytest.raises(ValueError, match="above 16 rows the GEMV takes k_warps"):
        ops.gemv(torch.randn(17, 128, device="cuda", dtype=torch.float16), gw, k_warps=4)
    with pytest.raises(ValueError, match="per-channel or g"):
        ops.gemm(torch.randn(32, 128, device="cuda", dtype=torch.float16),
                 ops.prepare(pack_for_gpu(quantize(torch.randn(64, 128, device="cuda"), QuantSpec(4, 32, False)),
                                          torch.float16)))
    with pytest.raises(ValueError, match="features"):
        ops.gemv(torch.randn(2, 64, device="cuda", dtype=torch.float16), gw)
    bf16 = torch.randn(2, 128, device="cuda", dtype=torch.bfloat16)
    for run in (lambda: ops.gemv(bf16, gw), lambda: ops.gemm(bf16, gw),
                lambda: _forced_plan(gw, None, plans.DEQUANT_CUBLAS)(bf16)):  # each path of a layer's plan
        with pytest.raises(TypeError, match="packed for"):
            run()


def test_custom_ops_work_under_torch_compile():
    qw = quantize(torch.randn(1000, 576, device="cuda") * 0.05, QuantSpec(4, 64, False))
    gw = ops.prepare(pack_for_gpu(qw, torch.float16))
    bias = torch.randn(1000, device="cuda", dtype=torch.float16)

    def layer(x):
        return torch.nn.functional.silu(ops.gemv(x, gw, bias)) * 2

    compiled = torch.compile(layer, fullgraph=True)
    for m in (1, 5, 16):
        x = torch.randn(m, 576, device="cuda", dtype=torch.float16)
        torch.testing.assert_close(compiled(x), layer(x), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("m", [1, 9, 20, 30, 40])  # GEMV with 1 to 4 row blocks, the mixed GEMM
def test_programmatic_launches_give_the_plain_launches_bits(m):
    """A dependent chain (GEMV/GEMM -> Triton RMSNorm -> GEMV/GEMM -> SiLU*up -> ...), each
    kernel reading the previous one's output and sharing the split-K scratch, replayed from
    a CUDA graph with new inputs: with programmatic launches (kernels/pdl.py, sm_90+: the
    library's launch attribute from ``RuntimeOptions.programmatic_launch``, the Triton
    kernels' ``programmatic`` argument) every replay equals the plain-launch result bit for
    bit. A kernel that touched x, its output or the workspace before `griddepcontrol.wait`
    would read the last replay's values."""
    from woq.kernels import fused

    dtype = torch.float16
    torch.manual_seed(5)
    layers = []
    for n, k in [(8192, 4096), (4096, 8192), (3000, 4096), (4096, 1504)]:  # the first is long: a wide race window
        qw = quantize(torch.randn(n, k, device="cuda") * 0.05, QuantSpec(4, 128, False))
        layers.append(ops.prepare(pack_for_gpu(qw, dtype)))
    norm_w = torch.rand(4096, device="cuda", dtype=dtype) + 0.5

    def linear(x, gw):
        return ops.gemv(x, gw) if m <= ops.limits().gemv_wide_max_m else ops.gemm(x, gw)

    def chain(x, programmatic: bool):
        h = linear(x, layers[0])  # [m, 8192]
        h = fused.silu_mul(h, programmatic=programmatic)  # [m, 4096]
        h, _ = fused.add_rms_norm(h, x, norm_w, 1e-5, programmatic=programmatic)
        h = linear(torch.cat([h, h], 1), layers[1])  # [m, 4096]
        h = linear(h, layers[2])  # [m, 3000], odd N
        return linear(h[:, :1504].contiguous(), layers[3])

    inputs = [torch.randn(m, 4096, device="cuda", dtype=dtype) for _ in range(4)]
    programmatic = RuntimeOptions()
    assert programmatic.programmatic_launch  # (the default)
    try:
        assert build.load(replace(programmatic, programmatic_launch=False))  # the library's launches plain
        plain = [chain(x, False) for x in inputs]
        assert all(torch.isfinite(y).all() for y in plain)
        assert build.load(programmatic)
        assert [torch.equal(chain(x, True), y) for x, y in zip(inputs, plain)] == [True] * 4  # eager
        static_x = inputs[0].clone()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            chain(static_x, True)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(static_x, True)
        for _ in range(3):
            for x, y in zip(inputs, plain):
                static_x.copy_(x)
                graph.replay()
                assert torch.equal(out, y)
    finally:
        build.load(RuntimeOptions())  # (the default launch attribute for the tests after)


def _layer_plan(layer, path: str):
    """``layer``'s plan with thresholds that send every M down ``path`` (its bias as the layer
    bound it: a gate_up layer's rows interleaved)."""
    if path == plans.CPU_REFERENCE:
        return layer._plan
    entry = {"grids": {}, "gemm": {}, "gemv_max_m": 1 << 20 if path == plans.GEMV else 0,
             "max_kernel_m": 0 if path == plans.DEQUANT_CUBLAS else 1 << 20}
    return plans.KernelPlan(layer._plan.gw, layer._plan.bias, entry, RuntimeOptions())


@pytest.mark.parametrize("seed", range(32))
def test_random_layers_on_every_path_match_fp64(seed):
    """Random quantized layers as a model builds them -- shapes odd and even (K not a multiple
    of 8 included: such a layer serves dequantize + cuBLAS in torch), int8/int4, per-channel
    and grouped, with and without zero points and bias, gate_up layers (interleaved rows)
    among them, fp16 and bf16 -- on every path the layer has, forced, at M from 1 to past the
    crossovers: within 2x the error of cuBLAS on the exactly dequantized weight (fp64 reference)."""
    import random

    from woq.kernels.format import GATE_UP_BLOCK
    from woq.models.quant_linear import WeightOnlyLinear

    rnd = random.Random(seed)
    dtype = rnd.choice([torch.float16, torch.bfloat16])
    bits, group, sym = rnd.choice([(8, None, True), (8, 128, False), (4, 128, False), (4, 64, True), (4, 32, False)])
    kind = rnd.choice(["qkv", "o", "gate_up", "down"])
    N = 2 * GATE_UP_BLOCK * rnd.randint(1, 300) if kind == "gate_up" else rnd.randint(1, 5000)
    K = rnd.choice([rnd.randint(2, 600), 8 * rnd.randint(1, 700)])
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(N, K, device="cuda", generator=g) * 0.05
    bias = (torch.randn(N, device="cuda", generator=g) * 0.1).to(dtype) if rnd.random() < 0.5 else None
    layer = WeightOnlyLinear.from_float(w, bias, QuantSpec(bits, group, sym), kind)
    layer.bind(dtype, RuntimeOptions(), gpu=True)
    w64 = reference.dequantize(layer.qweight, torch.float64)
    paths = [plans.CPU_REFERENCE] if layer.gpu is None else [plans.GEMV, plans.MIXED_GEMM, plans.DEQUANT_CUBLAS]
    assert (layer.gpu is None) == (K % 8 != 0), "the kernels take every K that is a multiple of 8"
    interleaved = layer.gpu is not None and layer._plan.swiglu_rows
    for M in sorted({1, 2, 7, 16, 17, 33, rnd.randint(34, 300), 600}):
        x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
        ref = x.double() @ w64.T + (bias.double() if bias is not None else 0)
        err_cublas = _rel(F.linear(x, w64.to(dtype), bias), ref)
        for path in paths:
            if path == plans.GEMV and M > ops.gemv_rows_limit(layer.gpu):
                continue
            if path == plans.MIXED_GEMM and not ops.supports_mixed_gemm(layer.gpu):
                continue
            plan = _layer_plan(layer, path)
            assert plan.path(M) == path
            poison_next_alloc(M * N, dtype)
            y = plan(x)
            if interleaved:  # (the kernels' gate_up rows come in blocks of eight: back to gate, up)
                y = torch.cat(reference.gate_and_up(y, interleaved=True), dim=-1)
            assert y.shape == (M, N) and torch.isfinite(y).all(), f"{path} M={M}: unwritten output"
            err = _rel(y, ref)
            case = f"{path} M={M} N={N} K={K} int{bits} g{group} sym={sym} {dtype} {kind} bias={bias is not None}"
            assert err <= 2 * err_cublas + 1e-6, f"{case}: rel err {err:.2e} vs cuBLAS {err_cublas:.2e}"
