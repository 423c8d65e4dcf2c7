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


def shuffle_blocks(cache: KVCache, seed: int) -> None:
    """Give ``cache``'s rows a random permutation of its blocks (block 0, the scratch
    block, to none), as an allocator leaves them after many requests: a row's positions
    then cross blocks scattered over the pool."""
    g = torch.Generator().manual_seed(seed)
    n = cache.block_table.numel()
    blocks = torch.randperm(cache.num_blocks - 1, generator=g)[:n] + 1
    cache.block_table.copy_(blocks.to(torch.int32).view_as(cache.block_table))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (32, 8, 128)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_rope_and_cache_writes_only_its_positions(dtype, heads, kv_heads, dim, block_size):
    from woq.kernels.fused import rope_and_cache

    g = torch.Generator(device="cuda").manual_seed(heads)
    S, T = 6, 300
    rope = Rotary(1.0 / (500000 ** (torch.arange(0, dim, 2).float() / dim)), 1.0, T).cuda()
    # a prefill's rows (a run of positions across block boundaries) and single tokens
    positions = torch.tensor([0, 15, 16, 17, 33, 17, 299, 128], device="cuda")
    slots = torch.tensor([4, 4, 4, 4, 4, 0, 2, 3], device="cuda")
    B = len(slots)
    qkv = torch.randn(B, (heads + 2 * kv_heads) * dim, device="cuda", generator=g).to(dtype)
    blocks = 1 + S * -(-T // block_size) + 9  # (9 blocks no row owns)
    ours, ref = (KVCache(2, S, kv_heads, T, dim, dtype, "cuda", block_size, blocks) for _ in range(2))
    for c in (ours, ref):  # poisoned: every position not written must stay NaN
        shuffle_blocks(c, heads + block_size)
        c.k.fill_(float("nan"))
        c.v.fill_(float("nan"))
    q = rope_and_cache(qkv, positions, slots, rope.cos, rope.sin, ours.k[1], ours.v[1], ours.block_table, heads,
                       kv_heads, dim)

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
    blk, off = ours.locate(slots, positions)  # (through the table, as the kernel wrote them)
    assert_rotation(ours.k[1][blk, :, off], ref.k[1][blk, :, off], kr.view(B, kv_heads, dim))

    # launched programmatically (sm_90+): the same writes
    again = KVCache(2, S, kv_heads, T, dim, dtype, "cuda", block_size, blocks)
    again.block_table.copy_(ours.block_table)
    again.k.fill_(float("nan"))
    again.v.fill_(float("nan"))
    q2 = rope_and_cache(qkv, positions, slots, rope.cos, rope.sin, again.k[1], again.v[1], again.block_table, heads,
                        kv_heads, dim, programmatic=True)
    assert torch.equal(q2, q)
    for a, b in ((again.k, ours.k), (again.v, ours.v)):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


# Decode attention over the paged cache: lengths that end inside a block, on its edges and
# across many blocks, in rows whose blocks are shuffled over the pool.
PAGED_LENGTHS = [1, 15, 16, 17, 300, 1000]
PAGED_ROWS = [5, 0, 3, 6, 2, 1]
# (splits, tile, stages): one share; the defaults (from the batch and the GPU); tiles of
# 16 in blocks of 64; 3 shares (rounded up to 4) of 128-token tiles; 16 shares of 64
LAUNCHES = [(1, None, None), (None, None, None), (None, 16, 3), (3, 128, 1), (16, 64, 1)]


def gather_fp64(pool: torch.Tensor, table: torch.Tensor, row: int, n: int) -> torch.Tensor:
    """Positions ``[0, n)`` of block-table row ``row`` from one layer's blocks ``[N, Hkv, BS,
    D]``, block by block: ``[Hkv, n, D]`` in fp64 (the reference's own gather, not the
    cache's)."""
    bs = pool.shape[2]
    blocks = table[row, :-(-n // bs)].long()
    return pool[blocks].double().transpose(0, 1).reshape(pool.shape[1], -1, pool.shape[3])[:, :n]


def attention_fp64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One token's attention in fp64: q ``[H, D]`` over k, v ``[Hkv, n, D]`` (GQA)."""
    group = q.shape[0] // k.shape[0]
    kk, vv = (t.double().repeat_interleave(group, 0) for t in (k, v))
    p = torch.softmax(q.double()[:, None] @ kk.transpose(1, 2) / q.shape[1] ** 0.5, -1)
    return (p @ vv)[:, 0]


def paged_case(kv_heads: int, dim: int, dtype, block_size: int, live: list[int], seed: int) -> KVCache:
    """A one-layer cache of 8 rows x 1024 positions with shuffled blocks, NaN everywhere but
    positions ``[0, live[i])`` of row ``PAGED_ROWS[i]`` (random): a read past a length, or
    through a wrong table entry, turns the result NaN."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    cache = KVCache(1, 8, kv_heads, 1024, dim, dtype, "cuda", block_size, 1 + 8 * 1024 // block_size + 7)
    shuffle_blocks(cache, seed)
    cache.k.fill_(float("nan"))
    cache.v.fill_(float("nan"))
    rows = torch.tensor([r for r, n in zip(PAGED_ROWS, live) for _ in range(n)], device="cuda")
    positions = torch.cat([torch.arange(n, device="cuda") for n in live])
    k, v = (torch.randn(len(rows), kv_heads, dim, device="cuda", generator=g).to(dtype) for _ in range(2))
    cache.write(0, rows, positions, k, v)
    return cache


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (32, 8, 128)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("splits,block,stages", LAUNCHES)
def test_decode_attention_paged_reads_live_tokens_exactly(heads, kv_heads, dim, dtype, block_size, splits, block,
                                                          stages):
    """``decode_attention`` over a shuffled block table attends to exactly each sequence's
    live positions (the fp64 reference over the same positions gathered block by block),
    for tiles that span several blocks (64, 128 tokens) or a part of one (16 tokens of a
    64-token block), shares that start inside a block, and programmatic launches."""
    from woq.kernels.decode_attention import decode_attention

    cache = paged_case(kv_heads, dim, dtype, block_size, PAGED_LENGTHS, heads + dim + block_size)
    g = torch.Generator(device="cuda").manual_seed(heads)
    q = torch.randn(len(PAGED_ROWS), heads, dim, device="cuda", dtype=dtype, generator=g)
    slots = torch.tensor(PAGED_ROWS, device="cuda")
    lengths = torch.tensor(PAGED_LENGTHS, device="cuda")
    k, v, table = cache.k[0], cache.v[0], cache.block_table
    out = decode_attention(q, k, v, table, slots, lengths, splits=splits, block=block, stages=stages)
    for b, (row, n) in enumerate(zip(PAGED_ROWS, PAGED_LENGTHS)):
        ref = attention_fp64(q[b], gather_fp64(k, table, row, n), gather_fp64(v, table, row, n))
        err = ((out[b].double() - ref).norm() / ref.norm()).item()
        assert err < (3e-3 if dtype == torch.float16 else 2e-2), (n, err)
    again = decode_attention(q, k, v, table, slots, lengths, splits=splits, block=block, stages=stages,
                             programmatic=True)
    assert torch.equal(again, out)  # (launched programmatically, sm_90+: the same sums in the same order)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (32, 8, 128)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("splits,block,stages", LAUNCHES)
def test_rope_cache_attention_paged_equals_rope_kernel_then_attention(heads, kv_heads, dim, dtype, block_size,
                                                                      splits, block, stages):
    """The one-kernel decode attention over a shuffled block table writes the new k and v
    where ``rope_and_cache`` writes them (the new position's block, through the table),
    touches nothing else, and attends like the fp64 reference over that cache -- launch
    after launch (its merge counters re-arm). One more row, released (its entries all 0):
    a graph's padding row, whose token goes to the scratch block."""
    from woq.kernels.decode_attention import rope_cache_attention
    from woq.kernels.fused import rope_and_cache

    rope = Rotary(1.0 / (500000 ** (torch.arange(0, dim, 2).float() / dim)), 1.0, 1024).cuda()
    slots = torch.tensor(PAGED_ROWS + [7], device="cuda")
    for step, live in enumerate((PAGED_LENGTHS, [2, 16, 17, 18, 301, 64])):
        cache = paged_case(kv_heads, dim, dtype, block_size, [n - 1 for n in live], heads + dim + step)
        cache.block_table[7] = 0
        lengths = torch.tensor(live + [1], device="cuda")
        positions = lengths - 1
        g = torch.Generator(device="cuda").manual_seed(step)
        qkv = torch.randn(len(slots), (heads + 2 * kv_heads) * dim, device="cuda", generator=g).to(dtype)
        k, v, table = cache.k[0], cache.v[0], cache.block_table
        ref_k, ref_v = k.clone(), v.clone()
        q = rope_and_cache(qkv, positions, slots, rope.cos, rope.sin, ref_k, ref_v, table, heads, kv_heads, dim)
        refs = [attention_fp64(q[b], gather_fp64(ref_k, table, r, n), gather_fp64(ref_v, table, r, n))
                for b, (r, n) in enumerate(zip(slots.tolist(), lengths.tolist()))]
        out = None
        for launch_next, programmatic in (("start", False), ("inputs", False), ("end", False), ("start", True)):
            got = rope_cache_attention(qkv, positions, slots, lengths, rope.cos, rope.sin, k, v, table, heads, dim,
                                       splits=splits, block=block, stages=stages, launch_next=launch_next,
                                       programmatic=programmatic)
            for ours, ref in ((k, ref_k), (v, ref_v)):  # (the same writes each launch)
                assert ((ours == ref) | (ours.isnan() & ref.isnan())).all(), (step, launch_next)
            if out is None:
                out = got
                for b, ref in enumerate(refs):
                    err = ((out[b].double() - ref).norm() / ref.norm()).item()
                    assert err < (3e-3 if dtype == torch.float16 else 2e-2), (step, lengths[b].item(), err)
            assert torch.equal(got, out), (step, launch_next, programmatic)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tile,stages", [(64, 3), (128, 2)])  # (not the default 32/3)
def test_decode_attention_wide_option_sets_the_launch(dtype, tile, stages):
    """``DecodeAttentionOptions`` sets the tiles of a launch over enough (sequence, KV head)
    pairs to be bound by bandwidth: the same sums as naming them in the launch, and the
    fp64 reference over each sequence's live positions."""
    from woq.kernels.decode_attention import decode_attention, tiles
    from woq.kernels.device import sm_count
    from woq.kernels.options import DecodeAttentionOptions

    heads, kv_heads, dim = 32, 8, 128
    if len(PAGED_ROWS) * kv_heads * 4 < sm_count(torch.device("cuda")):
        pytest.skip("this GPU's SMs take these 6 sequences as a small batch")
    wide = DecodeAttentionOptions(tile, stages)
    assert tiles(len(PAGED_ROWS), kv_heads, torch.device("cuda"), wide) == (tile, stages)
    cache = paged_case(kv_heads, dim, dtype, 16, PAGED_LENGTHS, tile + stages)
    g = torch.Generator(device="cuda").manual_seed(tile)
    q = torch.randn(len(PAGED_ROWS), heads, dim, device="cuda", dtype=dtype, generator=g)
    slots = torch.tensor(PAGED_ROWS, device="cuda")
    lengths = torch.tensor(PAGED_LENGTHS, device="cuda")
    k, v, table = cache.k[0], cache.v[0], cache.block_table
    out = decode_attention(q, k, v, table, slots, lengths, wide=wide)
    assert torch.equal(out, decode_attention(q, k, v, table, slots, lengths, block=tile, stages=stages))
    for b, (row, n) in enumerate(zip(PAGED_ROWS, PAGED_LENGTHS)):
        ref = attention_fp64(q[b], gather_fp64(k, table, row, n), gather_fp64(v, table, row, n))
        err = ((out[b].double() - ref).norm() / ref.norm()).item()
        assert err < (3e-3 if dtype == torch.float16 else 2e-2), (n, err)


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


@pytest.mark.parametrize("dense_from", [1 << 30, 16], ids=["chunk-kernel", "sdpa"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunked_prefill_matches_an_fp32_cpu_model(dtype, dense_from):
    """A 40-token prompt prefilled in two chunks (16 tokens, then 24 from position 16 packed
    with a whole 7-token prompt: the second chunk attends to the first one's cached keys,
    causally aligned to its end) gives the last-token logits of an fp32 CPU model; the
    second chunk through the chunk kernel, or through SDPA with torch's end-aligned causal
    bias (``dense_from`` 16: as chunks of 256 tokens and more are served)."""
    from conftest import random_llama

    model = random_llama(dtype, "cuda", 64)
    cpu = random_llama(torch.float32, "cpu", 64)
    cfg, g = model.cfg, torch.Generator().manual_seed(7)
    prompt, other = torch.randint(0, 512, (40,), generator=g), torch.randint(0, 512, (7,), generator=g)
    cache = KVCache(cfg.num_layers, 2, cfg.num_kv_heads, 64, cfg.head_dim, dtype, "cuda")
    model(prompt[None, :16].cuda(), Prefill.pack([16], [1], "cuda"), cache, last_only=True)
    batch = Prefill.pack([24, 7], [1, 0], "cuda", [16, 0], dense_from=dense_from)
    ours = model(torch.cat([prompt[16:], other])[None].cuda(), batch, cache, last_only=True).cpu()
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
