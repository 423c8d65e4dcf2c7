"""The persistent batch-1 decode step (``kernels/decode_step.py``, ``csrc/decode_step.cuh``):
every decoder layer in one kernel gives the logits and the KV cache of the kernel-per-op
step, and is as close as that step to the same quantized model run in fp32 on the CPU
(skipped without an sm_90 GPU)."""
import pytest
import torch
from conftest import random_llama

from woq.models.kv_cache import KVCache
from woq.models.llama import Batch, CausalLM

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs an sm_90 GPU")]

# conftest's small model: hidden 256 (K of 4 segments: one partial chunk), inter 640 (10
# segments, 5 groups), fewer units than SMs in every stage. Llama-3-8B's layer shapes: full
# chunks, 7 chunks a down unit, more units than SMs, 8 KV heads of 4 query heads.
SMALL = {}
LLAMA3_8B_LAYERS = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                        num_hidden_layers=2)
MAX_LEN = 256


def decode(model, cache, prompt, fed, persistent: bool) -> torch.Tensor:
    """Logits of the prompt's prefill (into slot 1) and of one decode step per token of ``fed``."""
    P, dev = prompt.shape[1], prompt.device
    slots = torch.tensor([1], device=dev)
    saved, CausalLM.persistent_decode = CausalLM.persistent_decode, persistent
    try:
        out = [model(prompt, Batch.prefill([P], [1], dev), cache, last_only=True)[0]]
        for t, token in enumerate(fed):
            pos = torch.full((1, 1), P + t, device=dev)
            out.append(model(token.view(1, 1), Batch(pos, slots, lengths=pos[:, 0] + 1), cache, last_only=True)[0])
    finally:
        CausalLM.persistent_decode = saved
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
    assert model._persistent_step(new_cache()) is not None, "the model qualifies for the persistent step"
    g = torch.Generator(device="cuda").manual_seed(3)
    prompt = torch.randint(0, cfg.vocab_size, (1, prompt_len), device="cuda", generator=g)
    fed = torch.randint(0, cfg.vocab_size, (5,), device="cuda", generator=g)
    runs = {}
    for persistent in (False, True):
        cache = new_cache()
        cache.k.normal_(generator=g)  # (poison: slot 1 past the live tokens is never read, slot 0 never written)
        cache.v.normal_(generator=g)
        k0, v0 = cache.k[:, 0].clone(), cache.v[:, 0].clone()
        runs[persistent] = decode(model, cache, prompt, fed, persistent), cache
        assert torch.equal(cache.k[:, 0], k0) and torch.equal(cache.v[:, 0], v0), "another slot was written"
    (per_op, c_op), (ours, c_ours) = runs[False], runs[True]
    scale = per_op.abs().max().item()
    assert torch.isfinite(ours).all()
    # (bf16: an activation one ulp apart -- the two steps sum in other orders -- moves the
    # logits by a few bf16 ulps)
    assert (ours - per_op).abs().max().item() <= (0.02 if dtype == torch.float16 else 0.04) * scale
    live = prompt_len + len(fed)
    for a, b in ((c_ours.k, c_op.k), (c_ours.v, c_op.v)):  # the decoded tokens' k and v
        a, b = a[:, 1, :, prompt_len:live].float(), b[:, 1, :, prompt_len:live].float()
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
    eager = decode(model, caches[0], prompt, fed, persistent=True)[1:]

    cache = caches[1]
    model(prompt, Batch.prefill([P], [1], "cuda"), cache, last_only=True)
    token = fed[:1].view(1, 1).clone()
    pos = torch.full((1, 1), P, device="cuda")
    batch = Batch(pos, torch.tensor([1], device="cuda"), lengths=pos[:, 0] + 1)  # (static: the graph reads them)
    saved, CausalLM.persistent_decode = CausalLM.persistent_decode, True
    try:
        model(token, batch, cache, last_only=True)  # (eager first: builds the step; rewritten by the replays)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = model(token, batch, cache, last_only=True)
        replayed = []
        for t in range(3):
            token.fill_(int(fed[t]))
            pos.fill_(P + t)
            batch.lengths.copy_(pos[:, 0] + 1)
            graph.replay()
            replayed.append(logits[0].float().clone())
    finally:
        CausalLM.persistent_decode = saved
    assert torch.equal(torch.stack(replayed), eager)


@pytest.mark.parametrize("shape", [SMALL, LLAMA3_8B_LAYERS], ids=["small", "llama3-8b-layers"])
def test_cache_hints_and_ring_depth_change_no_result(shape):
    """The L2 hints (DecodeStep.cache_hints: the weight stream evict_first, small data and
    the next layer's cached rows prefetched) and a shallower ring (ring_slots) move only
    bytes: the logits and the cached k and v are bit-equal to the step's without either."""
    from woq.kernels.decode_step import DecodeStep

    model = random_llama(torch.float16, "cuda", MAX_LEN, "int4", **shape)
    cfg = model.cfg
    g = torch.Generator(device="cuda").manual_seed(5)
    prompt = torch.randint(0, cfg.vocab_size, (1, 100), device="cuda", generator=g)
    fed = torch.randint(0, cfg.vocab_size, (3,), device="cuda", generator=g)
    runs = []
    saved = DecodeStep.cache_hints, DecodeStep.ring_slots
    for hints, slots in ((0, 0), (3, 0), (3, 2), (1, 3), (2, 0)):
        cache = KVCache(cfg.num_layers, 2, cfg.num_kv_heads, MAX_LEN, cfg.head_dim, torch.float16, "cuda")
        DecodeStep.cache_hints, DecodeStep.ring_slots = hints, slots
        try:
            runs.append((decode(model, cache, prompt, fed, persistent=True), cache.k[:, 1].clone(), cache.v[:, 1].clone()))
        finally:
            DecodeStep.cache_hints, DecodeStep.ring_slots = saved
    for logits, k, v in runs[1:]:
        assert torch.equal(logits, runs[0][0]) and torch.equal(k, runs[0][1]) and torch.equal(v, runs[0][2])


def small_model_run(seed: int, prompt_len: int, fed_len: int):
    """conftest's small fp16 int4 model, an empty cache, a random prompt and tokens to feed."""
    model = random_llama(torch.float16, "cuda", MAX_LEN, "int4")
    cfg = model.cfg
    cache = KVCache(cfg.num_layers, 2, cfg.num_kv_heads, MAX_LEN, cfg.head_dim, torch.float16, "cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (1, prompt_len), device="cuda", generator=g)
    fed = torch.randint(0, cfg.vocab_size, (fed_len,), device="cuda", generator=g)
    return model, cache, prompt, fed


def test_the_kernel_metrics_see_the_step_as_one_decode_step_call():
    """With the kernel metrics' observer installed, a persistent decode step is one timed call
    of path ``decode_step`` (layer kind ``decoder``, M = 1, N = K = hidden): its layers'
    linears are not dispatched one by one."""
    from woq.models import dispatch

    class Calls:  # a KernelObserver
        def __init__(self):
            self.seen = []

        def record(self, call, seconds):
            self.seen.append((call, seconds))

    model, cache, prompt, fed = small_model_run(seed=6, prompt_len=9, fed_len=2)
    cfg = model.cfg
    calls = Calls()
    dispatch.set_observer(calls)
    try:
        decode(model, cache, prompt, fed, persistent=True)  # a prefill, then two decode steps
        dispatch.flush_observer()
    finally:
        dispatch.set_observer(None)
    steps = [(c, s) for c, s in calls.seen if c.path == "decode_step"]
    assert [(c.layer, c.m, c.n, c.k) for c, _ in steps] == [("decoder", 1, cfg.hidden_size, cfg.hidden_size)] * 2
    assert all(s is not None and s > 0 for _, s in steps)
    assert not [c for c, _ in calls.seen if c.m == 1 and c.layer in ("qkv", "o", "gate_up", "down")]


def test_the_step_timeline_is_ordered_and_changes_no_result():
    """With a trace buffer (DecodeStep.trace, benchmarks/step_timeline.py) every block
    stamps its stages of every layer in the order they run, a layer's input after every
    block's previous stage, each role's attention parts in order after every block's qkv;
    and the logits are bit-equal to the untraced step's."""
    from woq.kernels.decode_step import DecodeStep

    model, cache, prompt, fed = small_model_run(seed=7, prompt_len=70, fed_len=2)
    cfg = model.cfg
    untraced = decode(model, cache, prompt, fed, persistent=True)  # (builds the step for this cache)
    step = model._persistent_step(cache)
    step.trace = torch.zeros(DecodeStep.trace_words(cfg.num_layers, cache.k.device), dtype=torch.int64, device="cuda")
    try:  # (the same cache: the same positions written again)
        traced = decode(model, cache, prompt, fed, persistent=True)
    finally:
        model._decode_steps.clear()
    assert torch.equal(traced, untraced)

    # the last step's stamps [blocks, layers, events] (csrc/decode_step.cuh's TraceEvent).
    # A release's own stamp follows it, so a reader is compared with the stamp before it.
    names = ("qkv_ready", "qkv_done", "qkv_released", "attention_seen", "attention_loaded", "attention_landed",
             "attention_tiles", "attention_written", "attention_released", "attention_end", "o_ready", "o_done",
             "gate_up_ready", "gate_up_done", "down_ready", "down_done", "down_released")
    assert torch.ops.woq.decode_step_trace_events() == len(names)
    E = {name: i for i, name in enumerate(names)}
    t = step.trace.view(-1, cfg.num_layers, len(names)).cpu()
    stages = [E[n] for n in ("qkv_ready", "qkv_done", "qkv_released", "o_ready", "o_done", "gate_up_ready",
                             "gate_up_done", "down_ready", "down_done", "down_released")]
    assert (t[:, :, stages] > 0).all() and (t[:, :, stages].diff(dim=2) >= 0).all()
    last = lambda event: t[:, :, E[event]].max(dim=0).values  # noqa: E731  (per layer, over blocks)
    assert (t[:, 1:, E["qkv_ready"]] >= last("down_done")[:-1]).all(), "a layer's qkv waits for every block's down"
    assert (t[:, :, E["gate_up_ready"]] >= last("o_done")).all(), "gate/up waits for every block's o"
    assert (t[:, :, E["down_ready"]] >= last("gate_up_done")).all(), "down waits for every block's gate/up"
    roles = t[:, :, E["attention_seen"]] > 0  # (blocks holding tokens)
    assert roles.any(dim=0).all()
    attention = t[:, :, E["attention_seen"]:E["attention_written"] + 1][roles]  # seen .. written, in order
    assert (attention > 0).all() and (attention.diff(dim=1) >= 0).all()
    assert (t[:, :, E["attention_seen"]] >= last("qkv_done"))[roles].all(), "a role sees qkv after every block's"
    assert (t[:, :, E["o_ready"]] >= last("attention_written")).all(), "o waits for every role's output"
