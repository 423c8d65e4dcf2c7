"""Prompt chunks paced by measured step times (``engine/step_pacing.py``): the choice
against a brute-force search, the requests' demand against its closed form, and an engine
on the real SmolLM2 whose mixed steps keep within the bound while its tokens stay those of
an unpaced engine."""
import math
import random
import threading

import pytest
import torch

from woq.engine.cuda_graphs import prefill_buckets
from woq.engine.engine import PACED_LEAST_TOKENS, Engine
from woq.engine.sampling import SamplingParams
from woq.engine.step_pacing import OUTPUT_WEIGHT, Pacing, StepTimes, timed_seconds
from woq.kernels.observe import KernelTiming

from conftest import PrefillCounter, random_llama


def _brute_force(times: StepTimes, decoding: int, ratio: float, least: int, batch: int) -> int:
    """Every prompt token count T from ``least`` up, priced as the padded step that holds
    ``decoding + T`` tokens: the largest within ``ratio`` decode steps of ``batch`` (or
    of ``decoding``, where more), else the cheapest one that fits (T = ``least``, rounded up
    to fill its padded step)."""
    sizes = sorted(times.packed)
    padded = lambda n: next((t for t in sizes if t >= n), None)  # noqa: E731
    batch = max(batch, decoding)
    decode = times.decode[next((b for b in sorted(times.decode) if b >= batch), max(times.decode))]
    fits = [T for T in range(least, sizes[-1] + 1) if padded(decoding + T) is not None]
    if not fits:
        return least
    within = [T for T in fits if times.packed[padded(decoding + T)] <= ratio * decode]
    if within:
        return max(within)
    return padded(decoding + least) - decoding


def test_paced_prompt_tokens_are_the_largest_padded_step_within_the_time():
    """On random monotone and non-monotone step-time curves over the engine's padded sizes
    (and on the measured H100 curve of docs/bench/step_budget.md), with the batch the queue
    will make and without, the chosen prompt tokens equal a brute-force search over every
    token count."""
    rng = random.Random(0)
    cases = []
    # H100, 8B int4 graph replays: decode steps by batch, packed steps of prompt tokens alone
    h100 = StepTimes({1: 2.44e-3, 16: 4.07e-3, 64: 6.95e-3, 128: 11.25e-3},
                     {16: 4.54e-3, 64: 5.41e-3, 128: 6.55e-3, 256: 10.28e-3, 384: 14.39e-3, 448: 16.58e-3,
                      512: 17.30e-3})
    cases += [(h100, d, r, b) for d in (1, 2, 16, 17, 64, 100, 128, 300, 500) for r in (1.0, 1.5, 2.0, 3.0, 10.0)
              for b in (0, 1, 16, 64, 128)]
    # a padded step of exactly the allowed time is within it
    cases += [(StepTimes({1: 1.0, 4: 1.25}, {16: 1.5, 32: 2.0, 64: 2.5}), d, 2.0, 0) for d in (1, 3, 4)]
    for _ in range(300):
        batches = sorted(rng.sample([1, 2, 4, 8, 16, 32, 64, 128, 256], rng.randint(1, 6)))
        tokens = prefill_buckets(rng.choice([16, 64, 100, 128, 300, 512]))
        base = rng.uniform(1e-3, 5e-3)
        monotone = rng.random() < 0.7
        decode = {b: base * (1 + 0.01 * b) * (1 if monotone else rng.uniform(0.5, 2)) for b in batches}
        packed = {t: base * (1 + 0.03 * t) * (1 if monotone else rng.uniform(0.5, 2)) for t in tokens}
        times = StepTimes(decode, packed)
        cases += [(times, rng.randint(1, 300), rng.uniform(0.5, 4.0), rng.choice([0, rng.randint(1, 300)]))]
    for times, decoding, ratio, batch in cases:
        got = times.prompt_tokens(decoding, ratio, PACED_LEAST_TOKENS, batch)
        assert got == _brute_force(times, decoding, ratio, PACED_LEAST_TOKENS, batch), (times, decoding, ratio, batch)
        assert got >= PACED_LEAST_TOKENS
    # one stream beside 15 queued prompts is paced at the 16 streams they will make
    assert h100.prompt_tokens(1, 2.0, PACED_LEAST_TOKENS, 16) == 128 - 1
    assert h100.prompt_tokens(1, 2.0, PACED_LEAST_TOKENS) == 64 - 1  # (no step within: the least, padded)


def test_the_bound_gives_way_to_the_prompt_tokens_the_requests_need_per_step():
    """The demand is each sequence's prompt tokens over its expected output: its
    ``max_tokens`` until a request has finished, then the smaller of that and the finished
    outputs' running mean (weight ``OUTPUT_WEIGHT``). A step takes the demand where the time
    bound lets in fewer, raised to fill the padded step that holds it (or as is, past the
    largest), and the bound's own where it lets in more."""
    sizes = [16, 32, 64, 128, 256]
    times = StepTimes({1: 1.0, 16: 2.0}, {16: 1.5, 32: 2.0, 64: 3.0, 128: 4.0, 256: 6.0})
    bound = times.prompt_tokens(16, 2.0, PACED_LEAST_TOKENS)
    assert bound == 128 - 16
    rng = random.Random(1)
    pacing = Pacing(times, 2.0, PACED_LEAST_TOKENS)
    seqs = [(rng.randint(0, 6000), rng.randint(1, 4000)) for _ in range(40)]
    assert pacing.demand(seqs) == pytest.approx(sum(p / m for p, m in seqs))
    outputs = [rng.randint(1, 300) for _ in range(25)]
    mean = float(outputs[0])
    for n in outputs[1:]:
        mean = mean + OUTPUT_WEIGHT * (n - mean)
    for n in outputs:
        pacing.finished(n)
    assert pacing.mean_output == pytest.approx(mean)
    assert pacing.demand(seqs) == pytest.approx(sum(p / min(m, mean) for p, m in seqs))
    assert pacing.demand([(500, 0)]) == 500  # (a step generates a token at least)
    chosen = {}
    for demand in (64, 145.2, 400):
        padded = next((t for t in sizes if t >= 16 + math.ceil(demand)), 16 + math.ceil(demand))
        chosen[demand] = pacing.prompt_tokens(16, 0, demand)
        assert chosen[demand] == max(bound, padded - 16)
    # (64 a step: within the bound; 145.2: 146, filled to the 256 step's 240; 400: past the
    # largest step, taken as is)
    assert chosen == {64: bound, 145.2: 256 - 16, 400: 400}


@pytest.mark.gpu
def test_a_gpu_step_is_timed_queued_behind_the_last():
    """On a GPU a measurement queues its calls back to back: a call whose host part takes
    longer than its device part costs the host part, not their sum (``timed_seconds``).
    The call here sleeps 20 ms on the host, then queues a 20 ms sleep on the device."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    import time
    dev = torch.device("cuda")
    cycles = 0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for n in (1 << 20, 1 << 22, 1 << 24):  # the clock's rate: cycles of a 20 ms device sleep
        start.record()
        torch.cuda._sleep(n)
        end.record()
        end.synchronize()
        cycles = int(n * 20.0 / start.elapsed_time(end))

    def step():
        time.sleep(0.02)
        torch.cuda._sleep(cycles)

    assert timed_seconds(step, dev) == pytest.approx(0.02 * (1 + 1 / 4), rel=0.2)  # (not 0.04)


def _complete(engine: Engine, prompt: list[int], params: SamplingParams, started: threading.Event | None = None):
    """Submit ``prompt``; a list that fills with its token ids, and the event of its end."""
    out, done = [], threading.Event()

    def sink(ev):
        out.extend(ev.token_ids)
        if started is not None:
            started.set()
        if ev.finish_reason:
            done.set()

    engine.submit(prompt, params, sink)
    return out, done


@pytest.mark.slow
def test_a_prompt_arriving_beside_a_stream_is_paced_and_the_tokens_do_not_change(smollm2_int4):
    """A 150-token prompt arrives while another request decodes, in an engine paced to one
    decode step (ratio 1) with a token budget of 128: every step that carries prompt tokens
    beside the stream takes no more than the measured curve allows, the prompt goes in
    several such steps, and both requests get the greedy tokens of an unpaced engine."""
    lm = smollm2_int4
    tok = lm.tokenizer
    short = tok("List the planets:")["input_ids"]
    long = (tok("Some background first. " * 40)["input_ids"])[:150]
    assert len(long) == 150
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    kw = dict(max_num_seqs=2, max_seq_len=256, max_prefill_tokens=128)

    plain = Engine(lm.model, tok, {tok.eos_token_id}, **kw).start()
    try:
        want = []
        for p in (short, long):
            out, done = _complete(plain, p, params)
            assert done.wait(120)
            want.append(out)
    finally:
        plain.shutdown()

    seen = PrefillCounter()
    paced = Engine(lm.model, tok, {tok.eos_token_id}, mixed_step_ratio=1.0, observer=seen, **kw)
    times = paced.pacing.times
    assert sorted(times.decode) == [1, 2] and sorted(times.packed) == prefill_buckets(128)
    # (physics, not the code: 64 prompt tokens take longer than one token's step on a CPU)
    assert times.packed[64] > times.decode_seconds(1)
    # (one stream decodes beside the prompt in progress: the batch of two they will make)
    limit = times.prompt_tokens(1, 1.0, PACED_LEAST_TOKENS, 2)
    assert limit < 64 - 1  # so the 128-token budget alone would take more
    # (the demand stays below it: the two prompts over their 24 tokens each)
    assert math.ceil((len(short) + len(long)) / params.max_tokens) < limit
    paced.start()
    try:
        started = threading.Event()
        first, first_done = _complete(paced, short, params, started)
        assert started.wait(120)
        second, second_done = _complete(paced, long, params)
        assert first_done.wait(120) and second_done.wait(120)
    finally:
        paced.shutdown()
    assert [first, second] == want
    assert seen.steps[0] == (1, len(short))  # (the first prompt's prefill, and its first decode step)
    beside = [p for b, p in seen.steps[1:] if b == 1 and p > 0]
    assert beside and all(p <= limit for p in beside), (limit, seen.steps)
    assert sum(beside) == len(long) and len(beside) >= -(-len(long) // limit)


def test_timing_the_steps_at_start_counts_no_kernel_call():
    """The engine's start-up step timings run the model's layers, but the kernel metrics
    (``KernelTiming``) count no call of them: they are not served work."""
    class Calls:
        def __init__(self):
            self.n = 0

        def count(self, call, n):
            self.n += n

        def time(self, call, seconds):
            pass

        def record_step(self, batch, seconds, weight_bytes):
            pass

    model = random_llama(torch.float32, "cpu", 128)
    calls = Calls()
    model.observe_kernels(KernelTiming(calls))
    engine = Engine(model, None, set(), max_num_seqs=2, max_seq_len=128, max_prefill_tokens=64, mixed_step_ratio=2.0)
    assert engine.pacing is not None and calls.n == 0
    # the same forward outside the engine's timing is counted (the observer sees the layers)
    engine._packed_forward([0] * 16, [16], [2], [0])
    assert calls.n > 0


def test_a_stream_beside_a_queue_is_paced_at_the_batch_the_queue_will_make():
    """One stream decodes while three 100-token prompts wait, in an engine of 4 sequences
    given a step-time curve (set here, so that the bound is exact) on which a step beside
    one stream may take no more than the fewest prompt tokens, and one beside four streams
    a whole 64-token step: the queued prompts go in at the four streams' bound."""
    model = random_llama(torch.float32, "cpu", 256)
    seen = PrefillCounter()
    engine = Engine(model, None, set(), max_num_seqs=4, max_seq_len=256, max_prefill_tokens=64,
                    mixed_step_ratio=2.0, observer=seen)
    buckets = sorted(engine.pacing.times.packed)
    times = StepTimes({1: 1.0, 2: 1.0, 4: 10.0}, {t: 3.0 for t in buckets})
    one, four = (times.prompt_tokens(1, 2.0, PACED_LEAST_TOKENS, b) for b in (1, 4))
    assert (one, four) == (32 - 1, 64 - 1)
    engine.pacing = Pacing(times, 2.0, PACED_LEAST_TOKENS)
    params = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)
    engine.start()
    try:
        started = threading.Event()
        _, first_done = _complete(engine, list(range(1, 9)), params, started)
        assert started.wait(60)
        queued = [_complete(engine, [(7 * i + j) % 500 + 1 for j in range(100)], params) for i in range(3)]
        assert first_done.wait(120) and all(done.wait(120) for _, done in queued)
    finally:
        engine.shutdown()
    beside_one = [p for b, p in seen.steps if b == 1 and p > 0]
    assert beside_one and max(beside_one) == four, seen.steps


@pytest.mark.parametrize("queued_max_tokens", [150, 8])
def test_prompts_that_bring_more_work_than_the_bound_lets_in_go_in_at_their_demand(queued_max_tokens):
    """One stream decodes while three 100-token prompts wait, on a step-time curve (set
    here) whose bound beside the one stream is the fewest prompt tokens, padded (31). Asking
    150 tokens each, the prompts need ~2 prompt tokens a step and go in at the bound;
    asking 8, they need 300 / 8 = 37.5 a step, and the steps beside the one stream take
    that, filled to the 64-token step (63): prefill keeps pace with what they generate.
    (They are submitted under the engine's lock, so that its steps see all three.)"""
    model = random_llama(torch.float32, "cpu", 256)
    seen = PrefillCounter()
    engine = Engine(model, None, set(), max_num_seqs=4, max_seq_len=256, max_prefill_tokens=128,
                    mixed_step_ratio=2.0, observer=seen)
    buckets = sorted(engine.pacing.times.packed)
    assert buckets == [16, 32, 64, 128]
    times = StepTimes({1: 1.0, 2: 1.0, 4: 1.0}, {t: 3.0 for t in buckets})
    assert times.prompt_tokens(1, 2.0, PACED_LEAST_TOKENS, 4) == 32 - 1
    engine.pacing = Pacing(times, 2.0, PACED_LEAST_TOKENS)
    engine.start()
    try:
        started = threading.Event()
        _, first_done = _complete(engine, list(range(1, 9)), SamplingParams(max_tokens=150, temperature=0,
                                                                            ignore_eos=True), started)
        assert started.wait(60)
        params = SamplingParams(max_tokens=queued_max_tokens, temperature=0, ignore_eos=True)
        with engine._cv:
            queued = [_complete(engine, [(7 * i + j) % 500 + 1 for j in range(100)], params) for i in range(3)]
        assert first_done.wait(120) and all(done.wait(120) for _, done in queued)
    finally:
        engine.shutdown()
    beside_one = [p for b, p in seen.steps if b == 1 and p > 0]
    assert beside_one and max(beside_one) == (32 - 1 if queued_max_tokens == 150 else 64 - 1), seen.steps
