"""The GPU decode loop: CUDA-graph replays against eager steps, the KV pool's size and
block accounting over many requests (skipped without a GPU; the decode-attention kernels'
own tests are in test_gpu_fused.py)."""
import random
import threading

import pytest
import torch

from woq.engine.engine import Engine
from woq.engine.sampling import SamplingParams
from woq.models.batches import Prefill
from woq.models.loader import load_model
from woq.models.quant_config import QuantConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def smollm2_gpu(smollm2_dir):
    return load_model(str(smollm2_dir), QuantConfig("int4"), dtype=torch.float16, device="cuda", max_seq_len=512,
                      progress=False)


def _chat(tok, text):
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_packed_graphs_give_the_eager_packed_forward(smollm2_gpu):
    """A packed forward replayed through the graph of its padded token count -- whole
    prompts, and a mixed step: decode tokens after cached prompts beside a new prompt and a
    prompt's next chunk -- gives the eager forward's last-token logits (same argmax) and
    the same k and v in each row."""
    from woq.engine.cuda_graphs import PackedGraphs
    from woq.models.kv_cache import KVCache

    model, cfg = smollm2_gpu.model, smollm2_gpu.model.cfg
    caches = [KVCache(cfg.num_layers, 5, cfg.num_kv_heads, 512, cfg.head_dim, model.dtype, "cuda") for _ in range(2)]
    graphs = PackedGraphs(model, caches[0], 512, max_chunks=4, scratch_slot=4)
    graphs.capture()
    assert graphs.buckets == [16, 32, 64, 128, 192, 256, 320, 384, 448, 512]
    g = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()

    # (lens, rows, first positions): each row's positions before its chunk are written by an earlier case
    cases = [([7, 100, 1], [0, 1, 2], [0, 0, 0]), ([300], [3], [0]),
             ([1, 1, 40, 1], [0, 1, 2, 3], [7, 100, 1, 300]),  # a mixed step
             ([1, 1, 170], [0, 1, 2], [8, 101, 41]), ([512], [0], [0]),
             ([5], [3], [300])]  # (fewer chunks than an earlier replay, in a smaller graph)
    for lens, rows, starts in cases:
        tokens = ids(sum(lens))
        ours = graphs.run(tokens, lens, rows, starts).clone()
        # (the eager forward with the graphs' attention: the chunk kernel for every chunk)
        eager = model(torch.tensor([tokens], device="cuda"), Prefill.pack(lens, rows, "cuda", starts, dense_from=1 << 30),
                      caches[1], last_only=True)
        assert (ours.argmax(-1) == eager.argmax(-1)).all(), lens
        assert (ours - eager).abs().max() < 2e-2 * eager.abs().max(), lens
        for row, n in {r: p + n for r, p, n in zip(rows, starts, lens)}.items():
            for i, kv in enumerate(("k", "v")):  # (each layer's positions [0, n) of the row, through its table)
                a, b = (torch.stack([c.read(layer, row, n)[i] for layer in range(cfg.num_layers)]) for c in caches)
                assert (a.float() - b.float()).abs().max() <= 2e-2 * b.float().abs().max(), (lens, row, kv)
    assert graphs.replays == len(cases)
    with pytest.raises(ValueError, match="up to 512 tokens"):
        graphs.run(list(range(513)), [513], [0], [0])
    with pytest.raises(ValueError, match="in 4 chunks"):
        graphs.run(list(range(5)), [1] * 5, [0, 1, 2, 3, 0], [0] * 5)


def test_engine_packed_graphs(smollm2_gpu):
    """The engine prefills prompts through the packed graphs -- several arrivals in one
    replay, and a prompt that arrives while others decode in the same replay as their
    decode tokens -- and each first token is the eager prefill's."""
    from woq.models.kv_cache import KVCache

    lm = smollm2_gpu
    prompts = [_chat(lm.tokenizer, f"Name a colour that starts with the letter {c}.") for c in "BGRY"]
    cache = KVCache(lm.model.cfg.num_layers, 1, lm.model.cfg.num_kv_heads, 512, lm.model.cfg.head_dim,
                    lm.model.dtype, "cuda")
    eager_first = [lm.model(torch.tensor([p], device="cuda"), Prefill.pack([len(p)], [0], "cuda"), cache,
                            last_only=True).argmax(-1).item() for p in prompts]
    # (no prefix caching: the prompts share the chat template's opening, and a newcomer would
    # wait an iteration for the block another is prefilling; here all three go in one replay)
    # (the token budget alone, as in every comparison of engines here: paced, a prompt's chunks
    # would follow each engine's measured step times)
    eng = Engine(lm.model, lm.tokenizer, set(), max_num_seqs=4, max_seq_len=512, prefix_caching=False,
                 mixed_step_ratio=0)
    out = [[] for _ in prompts]
    done = threading.Semaphore(0)
    for i, p in enumerate(prompts[:3]):  # three queued before the engine starts: one iteration's arrivals
        eng.submit(p, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True),
                   lambda ev, i=i: (out[i].extend(ev.token_ids), ev.finish_reason and done.release()))
    eng.start()
    try:
        while len(out[0]) < 2:  # (decoding)
            threading.Event().wait(0.01)
        first = eng.generate(prompts[3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)).token_ids
        for _ in range(3):
            assert done.acquire(timeout=60)
        assert eng.packed_graphs.replays == 2
    finally:
        eng.shutdown()
    assert [o[0] for o in out[:3]] + [first[0]] == eager_first


def _first_difference(a: list[int], b: list[int], la: list, lb: list, margin: float) -> int | None:
    """Where greedy streams ``a`` and ``b`` (with their ``TokenLogprob`` entries ``la``, ``lb``)
    first differ, checked to be a near-tie: each run ranks the other's token within
    ``margin`` nats of its own. None where they agree throughout."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            ta, tb = dict(la[i].top), dict(lb[i].top)
            assert y in ta and x in tb, (i, x, y, la[i], lb[i])
            assert ta[x] - ta[y] < margin and tb[y] - tb[x] < margin, (i, x, y, la[i], lb[i])
            return i
    return None


@pytest.mark.slow
def test_graph_replays_give_the_eager_tokens_with_requests_joining_and_leaving(smollm2_gpu):
    """Greedy decoding through graph replays against the eager engine, with requests
    joining the batch as others end: the same tokens, but where the two runs meet a
    near-tie. A graph replays the step of its padded batch size, and a linear layer's
    kernel and its sum order are chosen by M, so the two runs' logits differ by rounding;
    at a tie within that rounding their greedy picks may differ, and the streams after it
    then follow different contexts. (SmolLM2 int4, "the number 6", 20th token: the two
    best candidates 0.022 nats apart in an fp32 CPU run, 1.4 fp16 ulps of a ~15 logit.)
    So each stream is compared up to its first difference, which must be such a tie (each
    run ranks the other's pick second, within 0.1 nats of its own), and at most two of the
    eleven streams may have one."""
    lm = smollm2_gpu
    prompts = [_chat(lm.tokenizer, f"Tell me something about the number {i}.") for i in range(11)]
    lengths = [5, 40, 17, 60, 3, 33, 48, 9, 25, 52, 14]  # sequences leave at different steps

    def run(graphs: bool):
        # Everything is queued before the engine starts, so both engines see the same
        # schedule: 8 prompts prefilled together, then newcomers prefilled and joining the
        # running batch as sequences finish (prefill rounding depends on which prompts are
        # packed together; the comparison is about graph replays vs eager decode steps).
        # (packed forwards eager in both: a graph's chunk kernel attends to long prompts that
        # the eager forward gives SDPA, whose rounding differs; test_engine_packed_graphs covers it)
        eng = Engine(lm.model, lm.tokenizer, set(), max_num_seqs=8, max_seq_len=512, cuda_graphs=graphs,
                     prefill_graphs=False, mixed_step_ratio=0)
        out, tops = [[] for _ in prompts], [[] for _ in prompts]
        done = threading.Semaphore(0)

        def sink_for(i):
            def sink(ev):
                out[i].extend(ev.token_ids)
                tops[i].extend(ev.logprobs or [])
                if ev.finish_reason:
                    done.release()
            return sink

        for i, p in enumerate(prompts):
            eng.submit(p, SamplingParams(max_tokens=lengths[i], temperature=0, ignore_eos=True, logprobs=2),
                       sink_for(i))
        eng.start()
        for _ in prompts:
            assert done.acquire(timeout=120)
        steps = eng.steps
        eng.shutdown()
        return out, tops, steps

    graph_tokens, graph_tops, steps = run(True)
    eager_tokens, eager_tops, _ = run(False)
    assert steps > 0
    assert [len(t) for t in graph_tokens] == [len(t) for t in eager_tokens] == lengths
    assert all(len(t) == len(lp) for t, lp in zip(graph_tokens + eager_tokens, graph_tops + eager_tops))
    ties = [_first_difference(a, b, la, lb, margin=0.1)
            for a, b, la, lb in zip(graph_tokens, eager_tokens, graph_tops, eager_tops)]
    assert sum(t is not None for t in ties) <= 2, ties


@pytest.mark.slow
def test_look_ahead_steps_give_the_tokens_of_steps_read_one_by_one(smollm2_gpu):
    """The graph engine queues each decode step before reading the previous one's ids
    (look-ahead); sequences that end by an end-of-sequence id (not known in advance) make
    it drop the step queued behind. Against the eager engine, which reads every step
    before the next: the same ids and finish reasons, greedy and seeded sampling (some of it
    with min-p) mixed, with sequences joining as others end."""
    lm = smollm2_gpu
    stop_id = lm.tokenizer.convert_tokens_to_ids(".")  # ends most answers mid-stream
    prompts = [_chat(lm.tokenizer, f"Describe the number {i} in two sentences.") for i in range(10)]

    def run(graphs: bool):
        from conftest import run_to_end

        eng = Engine(lm.model, lm.tokenizer, {stop_id}, max_num_seqs=4, max_seq_len=512, cuda_graphs=graphs,
                     mixed_step_ratio=0)
        requests = [(p, SamplingParams(max_tokens=48, temperature=0 if i % 2 else 0.8, top_p=0.9, seed=i,
                                       min_p=0.1 if i % 4 == 2 else 0.0))
                    for i, p in enumerate(prompts)]
        return run_to_end(eng, requests, timeout=120), eng

    graph_out, graph_eng = run(True)
    eager_out, eager_eng = run(False)
    assert graph_out == eager_out
    assert sum(o[-1] == "stop" for o in eager_out) >= 3  # ended by the id, not by length
    assert graph_eng.look_ahead_steps > 0 and graph_eng.look_ahead_dropped > 0
    assert eager_eng.look_ahead_steps == 0


def test_queued_mixed_steps_under_graphs_give_the_tokens_of_steps_read_one_by_one():
    """tests/test_mixed_overlap.py's check through the packed graphs (a random-weight
    Llama, token ids only): each mixed step is queued behind the one being read, fed its
    decode ids on the device and its inputs from pinned memory; the same ids and finish
    reasons as the same graphs read step by step, the row of a sequence that stopped
    dropped, no block left held; and the eager engine's (no graphs, nothing queued ahead)."""
    from conftest import random_llama
    from test_mixed_overlap import check_overlap, run_requests

    model = random_llama(torch.float16, "cuda", 256)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist() for n in (34, 20, 29, 21, 26)]
    requests, got = check_overlap(model, None, prompts)
    eager, eng = run_requests(model, None, None, requests, cuda_graphs=False)
    assert eng.packed_graphs is None and eng.mixed_steps_queued == 0 and eager == got


def test_a_prompt_arriving_beside_graph_decode_steps_is_queued_behind_one():
    """tests/test_mixed_overlap.py's arrival through the graphs (a random-weight Llama, token
    ids only): two sequences decode by graph replays with look-ahead, a prompt of three
    chunks arrives, and its first chunk goes in a packed step queued behind the decode step
    being read, fed that step's ids on the device; the decode step after its last chunk is
    queued behind that mixed step, and a second prompt, arriving at the first's first
    token, goes behind it; later, sequences ending by length leave a look-ahead for the
    rest of the batch. The same ids as the same graphs read step by step, and as the eager
    engine."""
    from conftest import random_llama
    from test_mixed_overlap import run_requests

    model = random_llama(torch.float16, "cuda", 256)
    g = torch.Generator().manual_seed(1)
    prompt = lambda n: torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    early = [(prompt(9), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)),
             (prompt(12), SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True))]
    late = [(0, 6, prompt(41), SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)),
            (2, 1, prompt(23), SamplingParams(max_tokens=10, temperature=0.7, seed=5, ignore_eos=True))]
    got, queued = run_requests(model, None, True, early, arrivals=late, mixed_step_ratio=0)
    want, serial = run_requests(model, None, False, early, arrivals=late, mixed_step_ratio=0)
    eager, eng = run_requests(model, None, None, early, arrivals=late, mixed_step_ratio=0, cuda_graphs=False)
    assert got == want == eager and [len(o) - 1 for o in got] == [30, 24, 14, 10]
    assert queued.mixed_behind_decode > 0 and serial.mixed_behind_decode == 0
    assert queued.decode_behind_mixed > 0 and serial.decode_behind_mixed == 0
    assert queued.look_ahead_partial > 0 and eng.look_ahead_steps == 0


class _Tally:
    """A kernel observer: calls by (path, layer kind, bits, M bucket), the timed ones, and
    the timed decode steps."""

    def __init__(self):
        from collections import Counter

        self.calls, self.timed, self.steps = Counter(), [], []

    @staticmethod
    def key(call):
        from woq.kernels.observe import m_bucket

        return call.path, call.layer, call.bits, m_bucket(call.m)

    def count(self, call, calls):
        self.calls[self.key(call)] += calls

    def time(self, call, seconds):
        self.timed.append((call, seconds))

    def record_step(self, batch, seconds, weight_bytes):
        self.steps.append((batch, seconds, weight_bytes))


@pytest.mark.parametrize("persistent", [False, True], ids=["kernel-per-op", "persistent-step"])
def test_graph_replays_count_every_call_as_eager_steps_do(persistent):
    """Under CUDA graphs each replay adds the calls its graph recorded at capture, so the
    kernel metrics count what an eager engine counts for the same requests (prefill graphs
    off on both: a graph prefill pads its prompt); one replay in ``sample_every`` runs the
    graph's timed twin, which times one call of each kind (a GEMV or mixed GEMM by its
    blocks' stamps, others by event nodes) and (decode) the whole step."""
    from dataclasses import replace

    from conftest import random_llama
    from woq.kernels import plans
    from woq.kernels.device import sm_major
    from woq.kernels.observe import KernelTiming
    from woq.kernels.options import DecodeStepOptions

    if persistent and sm_major(torch.device("cuda")) != 9:
        pytest.skip("the persistent step needs an sm_90 GPU")
    model = random_llama(torch.float16, "cuda", 256)
    model.options = replace(model.options, decode_step=DecodeStepOptions(enabled=persistent))

    def run(graphs: bool, prompts: list[list[int]], max_tokens: int) -> _Tally:
        tally = _Tally()
        timing = KernelTiming(tally, sample_every=4)
        model.observe_kernels(timing)  # (before the engine: its graphs record their calls as they are captured)
        eng = Engine(model, None, set(), max_num_seqs=4, max_seq_len=256, cuda_graphs=graphs, prefill_graphs=False,
                     mixed_step_ratio=0)
        done = threading.Semaphore(0)
        for p in prompts:
            eng.submit(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       lambda ev: ev.finish_reason and done.release())
        eng.start()
        for _ in prompts:
            assert done.acquire(timeout=60)
        eng.shutdown()
        torch.cuda.synchronize()
        timing.drain(wait=True)
        timing.flush()
        model.observe_kernels(None)
        return tally

    for batch in (1, 2, 4):
        prompts = [list(range(1 + i, 20 + i)) for i in range(batch)]
        graph, eager = run(True, prompts, 17), run(False, prompts, 17)
        assert graph.calls == eager.calls, batch
        decode_path = plans.DECODE_STEP if persistent and batch == 1 else plans.GEMV
        assert graph.calls[(decode_path, "qkv", 4, str(batch) if batch <= 2 else f"<={batch}")] == \
            16 * model.cfg.num_layers  # (16 decode steps: the first token comes from the prefill)
        timed = [(c, s) for c, s in graph.timed if c.path == decode_path]
        assert timed and all(s is not None and 0 < s < 0.1 for _, s in timed)
        assert 2 <= len(graph.steps) <= 6  # (16 replays, one in 4 timed: its twin's whole step too)
        assert all(b == batch and 0 < s < 0.1 and w > 0 for b, s, w in graph.steps)


def test_a_timed_twin_stamps_its_mixed_gemm_calls():
    """A graph whose layers run the mixed GEMM (a 40-token packed forward): its timed twin
    times each kind's GEMM by block stamps, not event nodes, the third layer's between
    uncounted calls of the second and the first layer's (their weight bytes added to the
    twin's), reports every kind with a latency within its replay's wall time, and computes
    the graph's bits."""
    from conftest import random_llama
    from woq.engine.cuda_graphs import capture_graphs
    from woq.kernels import plans
    from woq.kernels.observe import KernelTiming
    from woq.kernels.options import RuntimeOptions
    from woq.models.batches import Prefill
    from woq.models.kv_cache import KVCache

    # (untuned: the GEMV up to its 16 rows, the mixed GEMM to 128, whatever these small shapes measure)
    model = random_llama(torch.float16, "cuda", 256, options=RuntimeOptions(tune=False, shipped_tables=False))
    cfg = model.cfg
    cache = KVCache(cfg.num_layers, 2, cfg.num_kv_heads, 256, cfg.head_dim, model.dtype, model.device)
    ids = torch.randint(0, cfg.vocab_size, (1, 40), device="cuda")
    batch = Prefill.pack([40], [0], model.device, [0], dense_from=1 << 30)  # (the chunk kernel, as packed graphs)
    tally = _Tally()
    timing = KernelTiming(tally, sample_every=1)
    model.observe_kernels(timing)
    try:
        graph = capture_graphs(lambda n: model(ids, batch, cache, last_only=True), [40], timing)[40]
        twin = graph.twin_calls
        stamped = {c.layer for c in twin.blocks.calls}
        assert stamped == {"qkv", "o", "gate_up", "down"} and all(c.path == plans.MIXED_GEMM
                                                                 for c in twin.blocks.calls)
        assert not [c for c, _, _ in twin.events if c.path == plans.MIXED_GEMM]  # (no event node around a GEMM)
        reported = set(twin.blocks.calls)
        assert len(twin.blocks.calls) == 3 * len(reported) == 12  # (the three layers' calls of each kind)
        assert twin.counts == graph.calls.counts  # (the partners' calls are not counted)
        assert twin.partner_bytes == 2 * sum(c.weight_bytes() for c in reported)
        assert twin.weight_bytes() == graph.calls.weight_bytes() + twin.partner_bytes
        graph.graph.replay()
        fast = graph.out.clone()
        graph.twin.replay()
        assert torch.equal(graph.twin_out, fast)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()  # (sample_every 1: the twin)
        end.record()
        torch.cuda.synchronize()
        timing.drain(wait=True)
    finally:
        model.observe_kernels(None)
    gemm = {c.layer: s for c, s in tally.timed if c.path == plans.MIXED_GEMM}
    assert set(gemm) == {"qkv", "o", "gate_up", "down"}
    assert all(0 < s <= start.elapsed_time(end) / 1e3 for s in gemm.values())


@pytest.mark.slow
def test_no_kv_block_leak_after_1000_requests(smollm2_gpu):
    lm = smollm2_gpu
    eng = Engine(lm.model, lm.tokenizer, {lm.tokenizer.eos_token_id}, max_num_seqs=16, max_queue=1024,
                 max_seq_len=512).start()
    rng = random.Random(0)
    done = threading.Semaphore(0)
    results = []

    def sink_for(i):
        def sink(ev):
            if ev.finish_reason:
                results.append(ev.finish_reason)
                done.release()
        return sink

    prompt = _chat(lm.tokenizer, "Count to three.")
    for i in range(1000):
        params = SamplingParams(max_tokens=rng.randint(1, 6), temperature=rng.choice([0, 0.8]), seed=i)
        eng.submit(prompt, params, sink_for(i))
        if i % 97 == 0:  # and some cancelled mid-way
            eng.cancel(f"req-{i}")
    for _ in range(1000):
        assert done.acquire(timeout=120)
    eng.shutdown()
    assert len(results) == 1000 and set(results) <= {"stop", "length", "abort"}
    assert sorted(eng.kv.free_rows) == list(range(16)) and eng.kv_blocks_used == 0
    assert not eng.running and not eng.waiting
    eng.kv.pool.check()


def test_gpu_memory_fraction_sizes_the_kv_pool_and_preempts_when_it_is_full():
    """The KV pool follows the memory budget: 40 more blocks' worth of memory gives 40 more
    blocks; a pool of 3 sequences' worth still serves 6 long requests at once (preempting,
    every one completing); a budget with no room fails with a clear error."""
    from conftest import random_llama
    from woq.engine.engine import kv_blocks_for_budget

    model = random_llama(torch.float16, "cuda", 8192, hidden_size=1024, intermediate_size=2048, num_hidden_layers=16,
                         num_attention_heads=8, num_key_value_heads=8)
    per_block = 2 * 16 * 8 * 128 * 2 * 16  # K and V, layers, kv heads, head dim, fp16, positions
    free, total = torch.cuda.mem_get_info()
    in_use = total - free - torch.cuda.memory_reserved() + torch.cuda.memory_allocated()
    base = (in_use + (1 << 30)) / total  # what is in use + 1 GiB of room (prefill peak, slack)
    n0, summary = kv_blocks_for_budget(model, base, 16, 1024)
    n40, _ = kv_blocks_for_budget(model, base + 40 * per_block / total, 16, 1024)
    assert n40 - n0 == 40, summary
    fraction = base + (3 * 1024 // 16 - n0 + 0.5) * per_block / total  # 3 sequences of 1,024 positions
    eng = Engine(model, None, set(), max_num_seqs=8, max_seq_len=1024, max_prefill_tokens=1024,
                 gpu_memory_fraction=fraction).start()
    try:
        assert eng.kv_blocks_total == 3 * 1024 // 16
        outs = [None] * 6

        def one(i):
            outs[i] = eng.generate([1, 2, 3 + i] * 100, SamplingParams(max_tokens=600, ignore_eos=True))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [o.completion_tokens for o in outs] == [600] * 6 and eng.preemptions > 0
        assert eng.kv_blocks_used == 0
    finally:
        eng.shutdown()
    with pytest.raises(ValueError, match="does not fit"):
        Engine(model, None, set(), max_num_seqs=16, max_seq_len=8192, gpu_memory_fraction=in_use / total)


def test_sampling_features_under_graphs_and_look_ahead(smollm2_gpu):
    """Penalties, logit bias and log-probabilities through CUDA-graph replays and look-ahead
    steps equal a reference loop of whole-sequence forwards on the same GPU model
    (processors in fp64, ``test_logits``); n choices equal lone requests seeded seed + i;
    a JSON-schema grammar's output parses."""
    import json

    from test_logits import _reference_decode

    from woq.engine.grammar import json_schema_grammar

    lm = smollm2_gpu
    tok = lm.tokenizer
    eng = Engine(lm.model, tok, {tok.eos_token_id}, max_num_seqs=4, max_seq_len=512).start()
    try:
        prompt = tok("The cat sat on the mat. The cat sat on the mat. The cat")["input_ids"]
        p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=1.3,
                           frequency_penalty=0.4, presence_penalty=0.2, logit_bias=((tok.encode(" sat")[0], -3.0),),
                           logprobs=3)
        ahead = eng.look_ahead_steps
        got = eng.generate(prompt, p)
        assert eng.look_ahead_steps > ahead  # (the penalties were counted through look-ahead steps)
        want, want_lp = _reference_decode(lm.model, prompt, p, {tok.eos_token_id}, 24)
        agree = next((i for i, (a, b) in enumerate(zip(got.token_ids, want)) if a != b), len(want))
        assert agree >= 16, (got.token_ids, want)  # (fp16: a near-tie may flip a late token)
        assert all(abs(lp.logprob - w) < 3e-2 for lp, w in zip(got.logprobs[:agree], want_lp))

        sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True, frequency_penalty=0.5)
        done = threading.Semaphore(0)
        out = [[] for _ in range(3)]

        def sink_for(i):
            def sink(ev):
                out[i].extend(ev.token_ids)
                if ev.finish_reason:
                    done.release()
            return sink

        eng.submit(prompt, sampled, sink_for(0), choices=[sink_for(1), sink_for(2)])
        for _ in range(3):
            assert done.acquire(timeout=60)
        for i in range(3):
            from dataclasses import replace
            assert out[i] == eng.generate(prompt, replace(sampled, seed=5 + i)).token_ids, i

        schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                                   "age": {"type": "integer", "minimum": 0, "maximum": 150}},
                  "required": ["name", "age"], "additionalProperties": False}
        ids = tok.apply_chat_template([{"role": "user", "content": "A person as JSON."}], add_generation_prompt=True,
                                      tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        res = eng.generate(ids, SamplingParams(max_tokens=80, temperature=0, grammar=json_schema_grammar(schema)))
        assert res.finish_reason == "stop", res.text  # (the grammar ended it)
        value = json.loads(res.text)
        assert set(value) == {"name", "age"} and 0 <= value["age"] <= 150
    finally:
        eng.shutdown()
