"""The persistent batch-1 decode step (``kernels/decode_step.py``, ``csrc/decode_step.cuh``):
every decoder layer in one kernel gives the logits and the KV cache of the kernel-per-op
step, and is as close as that step to the same quantized model run in fp32 on the CPU
(skipped without an sm_90 GPU). Decode steps run through the engine's step runner
(``engine/decode.py``), which takes the persistent step where the model's options ask.
The KV cache is paged (``models/kv_cache.py``): a sequence's positions are read through
its block-table row, so the cache's contents are compared row by row (``row_kv``)."""
from dataclasses import replace

import pytest
import torch
from conftest import random_llama

from woq.engine.decode import DecodeRunner
from woq.kernels.options import DecodeStepOptions
from woq.models.batches import Decode, Prefill
from woq.models.builder import bind_kernels
from woq.models.kv_cache import KVCache

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs an sm_90 GPU")]

# conftest's small model: hidden 256 (K of 4 segments: one partial chunk), inter 640 (10
# segments, 5 groups), fewer units than SMs in every stage. Llama-3-8B's layer shapes: full
# chunks, 7 chunks a down unit, more units than SMs, 8 KV heads of 4 query heads.
SMALL = {}
LLAMA3_8B_LAYERS = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                        num_hidden_layers=2)
MAX_LEN = 256


def with_step(model, persistent: bool, **step):
    """``model`` bound with the persistent decode step on (``step``: its other
    ``DecodeStepOptions``) or off (a kernel per op)."""
    options = replace(model.options, decode_step=DecodeStepOptions(enabled=persistent, **step))
    return bind_kernels(model, options)


def row_kv(cache: KVCache, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ``row``'s cached k and v, each ``[layers, kv_heads, positions, head_dim]``: its
    blocks, gathered through the block table in position order."""
    blocks = cache.block_table[row].long()

    def gather(pool: torch.Tensor) -> torch.Tensor:  # [layers, blocks, kv_heads, block_size, head_dim]
        g = pool[:, blocks]
        return g.permute(0, 2, 1, 3, 4).reshape(g.shape[0], g.shape[2], -1, g.shape[4])

    return gather(cache.k), gather(cache.v)


def decode(model, cache, prompt, fed) -> torch.Tensor:
    """Logits of the prompt's prefill (into row 1) and of one decode step per token of ``fed``,
    each through the engine's step runner; the persistent step ran iff the model's options
    ask for it (``with_step``)."""
    P, dev = prompt.shape[1], prompt.device
    slots = torch.tensor([1], device=dev)
    runner = DecodeRunner(model, cache)
    out = [model(prompt, Prefill.pack([P], [1], dev), cache, last_only=True)[0]]
    for t, token in enumerate(fed):
        pos = torch.full((1, 1), P + t, device=dev)
        out.append(runner(token.view(1, 1), Decode.at(pos, slots))[0])
    assert (runner.persistent is not None) == bool(model.options.decode_step.enabled), "the step the options ask for"
    return torch.stack(out).float()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("symmetric", [False, True], ids=["zeros", "sym"])
@pytest.mark.parametrize("shape,prompt_len", [(SMALL, 9), (SMALL, 130), (LLAMA3_8B_LAYERS, 70)],
                         ids=["small-1share", "small-merged-shares", "llama3-8b-layers"])
def test_persistent_step_matches_the_kernel_per_op_step(dtype, symmetric, shape, prompt_len):
    if shape and (dtype == torch.bfloat16 or symmetric):
        pytest.skip("the large shapes once: fp16 with zero points")
    model = random_llama(dtype, "cuda", MAX_LEN, "int4", symmetric=symmetric, **shape)
    cfg = model.cfg
    new_cache = lambda: KVCache(cfg.num_layers, 2, cfg.num_kv_heads, MAX_LEN, cfg.head_dim, dtype, "cuda")  # noqa: E731
    assert model.persistent_step(new_cache()) is not None, "the model qualifies for the persistent step"
    g = torch.Generator(device="cuda").manual_seed(3)
    prompt = torch.randint(0, cfg.vocab_size, (1, prompt_len), device="cuda", generator=g)
    fed = torch.randint(0, cfg.vocab_size, (5,), device="cuda", generator=g)
    runs = {}
    for persistent in (False, True):
        cache = new_cache()
        cache.k.normal_(generator=g)  # (poison: row 1 past the live tokens is never read, row 0 never written)
        cache.v.normal_(generator=g)
        k0, v0 = row_kv(cache, 0)
        runs[persistent] = decode(with_step(model, persistent), cache, prompt, fed), row_kv(cache, 1)
        k0_after, v0_after = row_kv(cache, 0)
        assert torch.equal(k0_after, k0) and torch.equal(v0_after, v0), "another row was written"
    (per_op, c_op), (ours, c_ours) = runs[False], runs[True]
    scale = per_op.abs().max().item()
    assert torch.isfinite(ours).all()
    # (bf16: an activation one ulp apart -- the two steps sum in other orders -- moves the
    # logits by a few bf16 ulps)
    assert (ours - per_op).abs().max().item() <= (0.02 if dtype == torch.float16 else 0.04) * scale
    live = prompt_len + len(fed)
    for a, b in zip(c_ours, c_op):  # the decoded tokens' k and v
        a, b = a[:, :, prompt_len:live].float(), b[:, :, prompt_len:live].float()
        assert (a - b).abs().max().item() <= 0.02 * b.abs().max().item()

    # Against the same quantized model in fp32 on the CPU, the whole sequence in one forward:
    # the persistent step's decode logits no further from it than the kernel-per-op step's.
    cpu = random_llama(torch.float32, "cpu", MAX_LEN, "int4", symmetric=symmetric, **shape)
    ref = cpu(torch.cat([prompt[0], fed]).cpu()[None])[0, prompt_len - 1:]
    err_ours = (ours[1:].cpu() - ref[1:]).abs().mean().item()
    err_op = (per_op[1:].cpu() - ref[1:]).abs().mean().item()
    assert err_ours <= 1.5 * err_op + 1e-3 * scale, f"{err_ours:.3e} vs {err_op:.3e}"


def test_persistent_step_replays_in_a_cuda_graph():
    """Captured once and replayed at three positions, the step gives the eager step's logits
    bit for bit (the counters are re-armed by every launch): 64, 65 and 66 live tokens, one
    attention share a KV head, then two, merged."""
    model = random_llama(torch.float16, "cuda", MAX_LEN, "int4")
    cfg = model.cfg
    caches = [KVCache(cfg.num_layers, 2, cfg.num_kv_heads, MAX_LEN, cfg.head_dim, torch.float16, "cuda")
              for _ in range(2)]
    g = torch.Generator(device="cuda").manual_seed(4)
    P = 63
    prompt = torch.randint(0, cfg.vocab_size, (1, P), device="cuda", generator=g)
    fed = torch.randint(0, cfg.vocab_size, (3,), device="cuda", generator=g)
    eager = decode(with_step(model, True), caches[0], prompt, fed)[1:]

    cache = caches[1]
    model(prompt, Prefill.pack([P], [1], "cuda"), cache, last_only=True)
    token = fed[:1].view(1, 1).clone()
    pos = torch.full((1, 1), P, device="cuda")
    batch = Decode.at(pos, torch.tensor([1], device="cuda"))  # (static: the graph reads them)
    runner = DecodeRunner(model, cache)
    runner(token, batch)  # (eager first: builds the step; rewritten by the replays)
    assert runner.persistent is not None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = runner(token, batch)
    replayed = []
    for t in range(3):
        token.fill_(int(fed[t]))
        pos.fill_(P + t)
        batch.lengths.copy_(pos[:, 0] + 1)
        graph.replay()
        replayed.append(logits[0].float().clone())
    assert torch.equal(torch.stack(replayed), eager)


@pytest.mark.parametrize("shape", [SMALL, LLAMA3_8B_LAYERS], ids=["small", "llama3-8b-layers"])
def test_cache_hints_and_ring_depth_change_no_result(shape):
    """The L2 hints (DecodeStepOptions.cache_hints: the weight stream evict_first, small data
    and the next layer's cached rows prefetched) and a shallower ring (ring_slots) move only
    bytes: the logits and the cached k and v are bit-equal to the step's without either."""
    model = random_llama(torch.float16, "cuda", MAX_LEN, "int4", **shape)
    cfg = model.cfg
    g = torch.Generator(device="cuda").manual_seed(5)
    prompt = torch.randint(0, cfg.vocab_size, (1, 100), device="cuda", generator=g)
    fed = torch.randint(0, cfg.vocab_size, (3,), device="cuda", generator=g)
    runs = []
    for hints, slots in ((0, 0), (3, 0), (3, 2), (1, 3), (2, 0)):
        cache = KVCache(cfg.num_layers, 2, cfg.num_kv_heads, MAX_LEN, cfg.head_dim, torch.float16, "cuda")
        with_step(model, True, cache_hints=hints, ring_slots=slots)
        step = model.persistent_step(cache)
        assert (step.cache_hints, step.ring_slots) == (hints, slots)  # (the options reach the step)
        logits = decode(model, cache, prompt, fed)
        runs.append((logits, *row_kv(cache, 1)))
    for logits, k, v in runs[1:]:
        assert torch.equal(logits, runs[0][0]) and torch.equal(k, runs[0][1]) and torch.equal(v, runs[0][2])


@pytest.mark.parametrize("prompt_len,block_size", [(37, 16), (200, 16), (200, 128)],
                         ids=["37-one-share", "200-merged-shares", "200-shares-within-blocks"])
def test_persistent_step_reads_the_cache_through_the_block_table(prompt_len, block_size):
    """With the row's blocks a random permutation of the pool (neither in position order
    nor adjacent), the step gives the logits and the cached k and v of the identity-like
    table bit for bit: only the addresses change. A length past a block boundary (37, 200
    + fed: the last block partly live, tiles of 64 rows spanning several blocks of 16), and
    blocks of 128 that hold several attention shares, each starting mid-block (the roles'
    tiles and the next layer's prefetch, cache_hints on by default, take rows at an offset
    into a block)."""
    model = with_step(random_llama(torch.float16, "cuda", MAX_LEN, "int4"), True)
    cfg = model.cfg
    g = torch.Generator(device="cuda").manual_seed(8)
    prompt = torch.randint(0, cfg.vocab_size, (1, prompt_len), device="cuda", generator=g)
    fed = torch.randint(0, cfg.vocab_size, (5,), device="cuda", generator=g)
    runs = []
    for shuffled in (False, True):
        cache = KVCache(cfg.num_layers, 2, cfg.num_kv_heads, MAX_LEN, cfg.head_dim, torch.float16, "cuda",
                        block_size=block_size)
        table = cache.block_table
        assert cache.k.shape[3] == block_size and table.shape[1] * block_size >= MAX_LEN
        if shuffled:  # every block but the scratch block 0, dealt to the rows in a random order
            blocks = cache.k.shape[1]
            assert blocks - 1 >= table.numel()
            perm = torch.randperm(blocks - 1, generator=torch.Generator().manual_seed(9))[:table.numel()] + 1
            table.copy_(perm.view_as(table).to(table))
            if torch.equal(table[1], table[1].sort().values):  # (the row's blocks out of position order)
                table[1] = table[1].flip(0)
        logits = decode(model, cache, prompt, fed)
        live = prompt_len + len(fed)
        k, v = row_kv(cache, 1)
        runs.append((logits, k[:, :, :live].clone(), v[:, :, :live].clone()))
    (logits, k, v), (logits_s, k_s, v_s) = runs
    assert torch.isfinite(logits).all()
    assert torch.equal(logits_s, logits), "logits through a shuffled block table"
    assert torch.equal(k_s, k) and torch.equal(v_s, v), "the row's cached k and v through a shuffled block table"


def small_model_run(seed: int, prompt_len: int, fed_len: int):
    """conftest's small fp16 int4 model (the persistent step on), an empty cache, a random
    prompt and tokens to feed."""
    model = with_step(random_llama(torch.float16, "cuda", MAX_LEN, "int4"), True)
    cfg = model.cfg
    cache = KVCache(cfg.num_layers, 2, cfg.num_kv_heads, MAX_LEN, cfg.head_dim, torch.float16, "cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (1, prompt_len), device="cuda", generator=g)
    fed = torch.randint(0, cfg.vocab_size, (fed_len,), device="cuda", generator=g)
    return model, cache, prompt, fed


def test_the_kernel_metrics_see_the_steps_stages():
    """With the kernel metrics' observer installed, a persistent decode step counts its
    layers' stages as calls of path ``decode_step`` (qkv, attention, o, gate_up, down, one of
    each per layer, M = 1, the linears' shapes), and a timed step reports each stage's
    latency from the kernel's %globaltimer stamps: positive, and summing to at most the
    step's wall time. The layers' linears are not called one by one (the prefill's are)."""
    import time

    from woq.kernels import plans
    from woq.kernels.observe import KernelTiming, StageStamps

    class Calls:  # a KernelObserver
        def __init__(self):
            self.seen, self.counted = [], []  # timed calls, counted calls

        def count(self, call, calls):
            self.counted.append((call, calls))

        def time(self, call, seconds):
            self.seen.append((call, seconds))

    prompt_len = 9
    model, cache, prompt, fed = small_model_run(seed=6, prompt_len=prompt_len, fed_len=2)
    cfg, layer = model.cfg, model.layers[0]
    calls = Calls()
    timing = KernelTiming(calls)  # (every call timed: every step stamped)
    model.observe_kernels(timing)
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        decode(model, cache, prompt, fed)  # a prefill, then two decode steps
        timing.drain(wait=True)
        wall = time.perf_counter() - t0
    finally:
        model.observe_kernels(None)
    shapes = {m.layer_kind: (m.out_features, m.in_features)
              for m in (layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down)}
    shapes["attention"] = (0, 0)
    counted = [(c.layer, c.m, (c.n, c.k), n) for c, n in calls.counted if c.path == plans.DECODE_STEP]
    assert counted == [(kind, 1, shapes[kind], cfg.num_layers) for kind in StageStamps.STAGES] * 2
    stages = [(c, s) for c, s in calls.seen if c.path == plans.DECODE_STEP]
    assert [c.layer for c, _ in stages] == list(StageStamps.STAGES) * cfg.num_layers * 2
    assert all(s is not None and s >= 0 for _, s in stages) and sum(s for _, s in stages) < wall
    assert sum(s > 0 for _, s in stages) >= len(stages) // 2  # (a stamp's resolution is ~32 ns: most stages > 0)
    decoder_kinds = ("qkv", "o", "gate_up", "down")
    assert {c.layer for c, _ in calls.counted if c.m == prompt_len} >= set(decoder_kinds)  # (the prefill observed)
    assert not [c for c, _ in calls.counted if c.m == 1 and c.layer in decoder_kinds and c.path != plans.DECODE_STEP]


# -- across tensor-parallel ranks -----------------------------------------------------------
# A model whose shards the step takes at 2 and 4 ranks: o's and down's inputs split into
# whole 128-column groups (head_dim 128, 4 or 2 query heads of 8 a rank; 2048 intermediate
# rows), one or two KV heads a rank, vocab-parallel embedding and LM head.
TP_SHAPE = dict(hidden_size=1024, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=4,
                num_hidden_layers=3)


def _tp_rank(rank: int, size: int, port: int, ckpt: str, out: str) -> None:
    import os
    from pathlib import Path

    import torch.distributed as dist
    from transformers import AutoConfig

    from woq.kernels import build
    from woq.kernels.options import RuntimeOptions
    from woq.kernels.peer_all_reduce import PeerAllReduce
    from woq.models.builder import build_model
    from woq.models.loader import read_safetensors
    from woq.models.quant_config import QuantConfig
    from woq.models.sharding import TensorParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=size, device_id=dev)
    try:
        control = dist.new_group(backend="gloo")
        peer = PeerAllReduce.open(rank, size, dev, build.load(RuntimeOptions()), control)
        assert peer is not None, "the GPUs reach each other's memory"
        model = build_model(AutoConfig.from_pretrained(ckpt), read_safetensors(Path(ckpt)), QuantConfig("int4", 128),
                            torch.float16, dev, MAX_LEN, progress=False, tp=TensorParallel(rank, size, peer=peer))
        cfg = model.cfg
        g = torch.Generator().manual_seed(11)
        P = 70
        prompt = torch.randint(0, cfg.vocab_size, (1, P), generator=g).to(dev)
        fed = torch.randint(0, cfg.vocab_size, (5,), generator=g).to(dev)
        new_cache = lambda: KVCache(cfg.num_layers, 2, cfg.num_kv_heads, MAX_LEN, cfg.head_dim,  # noqa: E731
                                    torch.float16, dev)
        results = {p: decode(with_step(model, p), new_cache(), prompt, fed).cpu() for p in (False, True)}
        # The engine's decode graphs (their warm-up builds the step, the ranks agreeing),
        # replayed at the fed tokens' positions: the eager steps' logits (the area's epoch
        # and counters are device state).
        from woq.engine.cuda_graphs import DecodeGraphs

        cache = new_cache()
        model(prompt, Prefill.pack([P], [1], dev), cache, last_only=True)
        graphs = DecodeGraphs(DecodeRunner(model, cache), 1, scratch_slot=0)
        graphs.capture()
        results["built"] = graphs.runner.persistent is not None
        slot = torch.tensor([1], device=dev)
        results["graph"] = torch.stack([graphs.run(fed[t].view(1, 1), torch.full((1, 1), P + t, device=dev), slot)[0]
                                        .float().cpu() for t in range(len(fed))])
        torch.save(results, f"{out}/rank{rank}.pt")
        del graphs  # (before the process group goes: destroying it under live graphs that captured NCCL hangs)
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_persistent_step_across_ranks_matches_the_kernel_per_op_step(tmp_path):
    """At 2 and (where there are) 4 ranks, one GPU each: every rank builds the step (they
    agree), and its logits -- o's and down's partial sums meeting in the ranks' step areas --
    are within the single-GPU test's bound of the kernel-per-op step's (row-parallel partial
    sums all-reduced through the peer buffers), the same on every rank bit for bit, and a
    CUDA graph of it replays the eager steps' logits bit for bit."""
    import socket

    import torch.multiprocessing as mp
    from conftest import tiny_hf_checkpoint

    ckpt = tiny_hf_checkpoint(tmp_path, **TP_SHAPE)
    for size in [2] + ([4] if torch.cuda.device_count() >= 4 else []):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = tmp_path / f"tp{size}"
        out.mkdir()
        mp.spawn(_tp_rank, args=(size, port, str(ckpt), str(out)), nprocs=size, join=True)
        runs = [torch.load(out / f"rank{r}.pt") for r in range(size)]
        per_op, ours = runs[0][False], runs[0][True]
        assert all(r["built"] for r in runs), f"TP {size}: the step was built on every rank"
        assert torch.isfinite(ours).all()
        scale = per_op.abs().max().item()
        assert (ours - per_op).abs().max().item() <= 0.02 * scale, f"TP {size}"
        for r in runs[1:]:
            assert torch.equal(r[True], ours), f"TP {size}: every rank's logits"
        assert torch.equal(runs[0]["graph"], ours[1:]), f"TP {size}: graph replays"
