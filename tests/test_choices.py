"""Several choices of one prompt (OpenAI's ``n``) share one prefill, on the real SmolLM2."""
import threading
import time

import pytest

from woq.engine.engine import Engine
from woq.engine.sampling import SamplingParams

from conftest import PrefillCounter


@pytest.fixture(scope="module")
def engine(smollm2_int4):
    lm = smollm2_int4
    eng = Engine(lm.model, lm.tokenizer, {lm.tokenizer.eos_token_id}, max_num_seqs=6, max_queue=16,
                 max_seq_len=256).start()
    yield eng
    eng.shutdown()


def _choices(engine, prompt, params, n):
    """Submit one request of ``n`` choices; each choice's (token ids, finish reason)."""
    done = threading.Semaphore(0)
    out = [([], None) for _ in range(n)]

    def sink_for(i):
        def sink(ev):
            out[i][0].extend(ev.token_ids)
            if ev.finish_reason:
                out[i] = (out[i][0], ev.finish_reason)
                done.release()
        return sink

    rid = engine.submit(prompt, params, sink_for(0), choices=[sink_for(i) for i in range(1, n)])
    return rid, done, out


def test_choices_share_one_prefill_and_each_equals_its_own_request(engine, smollm2_int4):
    tok = smollm2_int4.tokenizer
    prompt = tok("Here is a short story about a robot:")["input_ids"]
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=77, ignore_eos=True)
    steps = PrefillCounter()
    engine.observer = steps
    _, done, out = _choices(engine, prompt, params, 4)
    for _ in range(4):
        assert done.acquire(timeout=60)
    engine.observer = None
    assert steps.prefill_tokens == len(prompt)  # one prefill for the four choices
    for i, (ids, reason) in enumerate(out):  # choice i draws as a lone request seeded seed + i
        alone = engine.generate(prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=77 + i, ignore_eos=True))
        assert ids == alone.token_ids and reason == "length", i
    assert len({tuple(ids) for ids, _ in out}) > 1  # (different seeds, different draws)


def test_cancelling_a_request_ends_every_choice_and_frees_every_block(engine, smollm2_int4):
    tok = smollm2_int4.tokenizer
    prompt = tok("Count to one hundred:")["input_ids"]
    rid, done, out = _choices(engine, prompt, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True), 3)
    deadline = time.monotonic() + 30
    while not all(ids for ids, _ in out) and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.cancel(rid)
    for _ in range(3):
        assert done.acquire(timeout=30)
    assert [reason for _, reason in out] == ["abort"] * 3
    deadline = time.monotonic() + 10
    while len(engine.kv.free_rows) < engine.max_num_seqs and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(engine.kv.free_rows) == list(range(engine.max_num_seqs)) and engine.kv_blocks_used == 0
    engine.kv.pool.check()


def test_choices_beyond_the_free_rows_wait_then_run(engine, smollm2_int4):
    """Behind a running request that holds 4 of the 6 rows, a 3-choice request's choices
    that find no row wait (to start from its cached prompt), then run in full."""
    tok = smollm2_int4.tokenizer
    _, first_done, first = _choices(engine, tok("Tell me about the sea.")["input_ids"],
                                    SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), 4)
    _, second_done, second = _choices(engine, tok("Name some birds.")["input_ids"],
                                      SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), 3)
    for _ in range(4):
        assert first_done.acquire(timeout=60)
    for _ in range(3):
        assert second_done.acquire(timeout=60)
    assert all(len(ids) == 30 for ids, _ in first) and all(len(ids) == 5 for ids, _ in second)


def test_more_choices_than_the_batch_is_refused(engine):
    with pytest.raises(ValueError, match="n = 7"):
        engine.submit([1, 2, 3], SamplingParams(max_tokens=2), lambda ev: None, choices=[lambda ev: None] * 6)
