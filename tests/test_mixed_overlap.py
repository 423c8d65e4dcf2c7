"""A mixed step queued behind the one whose tokens the host is reading (``Engine._queue_mixed``)
gives the tokens of steps read one by one."""
from __future__ import annotations

from conftest import run_to_end
from woq.engine.engine import Engine
from woq.engine.sampling import SamplingParams


def run_requests(model, tokenizer, overlap: bool | None, requests: list[tuple[list[int], SamplingParams]],
                 budget: int = 16, arrivals: tuple = (), **engine_args) -> tuple[list[list], Engine]:
    """Every request queued before the engine starts, and ``arrivals`` submitted from a
    request's sink (``run_to_end``): both engines see the same arrivals; each request's
    ids, then its finish reason."""
    eos = {tokenizer.eos_token_id} if tokenizer is not None else set()
    eng = Engine(model, tokenizer, eos, max_num_seqs=8, max_seq_len=256, max_prefill_tokens=budget,
                 prefix_caching=False, overlap_mixed_steps=overlap, **engine_args)
    return run_to_end(eng, requests, arrivals=arrivals), eng


def requests_of(model, tokenizer, prompts: list[list[int]],
                budget: int = 16) -> list[tuple[list[int], SamplingParams]]:
    """Five requests whose prompts take 2-3 chunks of ``budget`` tokens: the first ends by a
    stop id it meets as its fourth token or later, while the others are prefilled; the
    others by length, greedy and seeded sampling."""
    assert len(prompts) == 5 and all(budget < len(p) <= 3 * budget for p in prompts)
    alone, _ = run_requests(model, tokenizer, False,
                            [(prompts[0], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))], budget)
    stop_id = next(t for i, t in enumerate(alone[0]) if i >= 3 and t not in alone[0][:i])
    return [(prompts[0], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_id])),
            (prompts[1], SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)),
            (prompts[2], SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)),
            (prompts[3], SamplingParams(max_tokens=17, temperature=0, ignore_eos=True)),
            (prompts[4], SamplingParams(max_tokens=20, temperature=0.7, seed=5, ignore_eos=True))]


def check_overlap(model, tokenizer, prompts: list[list[int]],
                  budget: int = 16) -> tuple[list[tuple[list[int], SamplingParams]], list[list]]:
    """The requests of ``requests_of``, read step by step and with steps queued ahead;
    also returns them with what they gave."""
    requests = requests_of(model, tokenizer, prompts, budget)
    want, serial = run_requests(model, tokenizer, False, requests, budget)
    got, overlapped = run_requests(model, tokenizer, True, requests, budget)
    assert got == want
    assert want[0][-1] == "stop" and [o[-1] for o in want[1:]] == ["length"] * 4
    assert overlapped.mixed_steps_queued > 0 and serial.mixed_steps_queued == 0
    assert overlapped.mixed_rows_dropped > 0  # (the stopped request's row in the step queued behind its last)
    for eng in (serial, overlapped):
        assert eng.kv_blocks_used == 0 and sorted(eng.kv.free_rows) == list(range(8))
        eng.kv.pool.check()
    return requests, want


def _prompts(tok) -> list[list[int]]:
    """Five prompts of 20-34 SmolLM2 tokens: 2-3 chunks of a 16-token budget each."""
    texts = ["Count from one to ten in French, then in Spanish, then in German, separated by commas.",
             "Write a list of fruits:", "Name three rivers in Europe and say where each one flows into the sea.",
             "What is the capital of Italy?", "List some tools a carpenter uses every day in the workshop."]
    return [tok(f"{t} Answer briefly, in plain words, and do not repeat the question.")["input_ids"] for t in texts]


def test_queued_mixed_steps_give_the_tokens_of_steps_read_one_by_one(smollm2_int4):
    """Prompts of 20-50 tokens go in chunks of a 16-token budget beside the streams already
    decoding, so mixed steps follow each other and each is queued behind the last. Against
    the same engine reading each step before planning the next: the same ids and finish
    reasons, with sequences ending by length (known ahead), by a stop id (known only once
    read: the queued step's row for it is dropped) and seeded sampling beside greedy."""
    tok = smollm2_int4.tokenizer
    prompts = _prompts(tok)
    check_overlap(smollm2_int4.model, tok, prompts)


def _run_with_events(model, tokenizer, overlap: bool, requests, kv_blocks: int,
                     cancel_after: int) -> tuple[list, Engine]:
    """``requests``: (prompt, params, choices) queued before the engine starts, in a pool of
    ``kv_blocks`` blocks; request 1 is cancelled from its sink (on the engine thread, so at
    the same point of its stream in both engines) once it has ``cancel_after`` tokens.
    Per choice: its ids, its log-probabilities (rounded), then its finish reason."""
    import threading

    from woq.models.kv_cache import KVCache

    cfg = model.cfg
    per_block = KVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype) * 16
    eng = Engine(model, tokenizer, {tokenizer.eos_token_id}, max_num_seqs=8, max_seq_len=256, max_prefill_tokens=16,
                 kv_cache_gib=kv_blocks * per_block / (1 << 30), overlap_mixed_steps=overlap)
    assert eng.kv_blocks_total == kv_blocks
    out: dict[tuple[int, int], list] = {}
    done = threading.Semaphore(0)
    ids: dict[int, str] = {}

    def sink_for(r: int, c: int):
        out[r, c] = []

        def sink(ev):
            out[r, c].extend(ev.token_ids)
            out[r, c].extend(round(lp.logprob, 4) for lp in ev.logprobs or [])
            if r == 1 and c == 0 and len([t for t in out[r, c] if isinstance(t, int)]) >= cancel_after:
                eng.cancel(ids[1])
            if ev.finish_reason:
                out[r, c].append(ev.finish_reason)
                done.release()
        return sink

    for r, (prompt, params, n) in enumerate(requests):
        ids[r] = eng.submit(prompt, params, sink_for(r, 0), choices=[sink_for(r, c) for c in range(1, n)])
    eng.start()
    try:
        for _ in out:
            assert done.acquire(timeout=300)
    finally:
        eng.shutdown()
    return [out[k] for k in sorted(out)], eng


def test_queued_mixed_steps_beside_preemption_choices_logprobs_and_a_cancel(smollm2_int4):
    """Queued mixed steps where the pool is too small for every sequence (preemptions, and
    steps not queued for want of a free block), beside a request of two choices that share
    its prefill, a request asking for log-probabilities, and a request cancelled while
    others are prefilled (from its sink, which runs before the next step is queued: its row
    is left out of that step): the same ids, log-probabilities and finish reasons as steps
    read one by one, and no block or row left held."""
    tok = smollm2_int4.tokenizer
    prompts = _prompts(tok)
    requests = [(prompts[0], SamplingParams(max_tokens=28, temperature=0, ignore_eos=True, logprobs=2), 1),
                (prompts[1], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), 1),
                (prompts[2], SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True), 2),
                (prompts[3], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), 1),
                (prompts[4], SamplingParams(max_tokens=26, temperature=0, ignore_eos=True), 1)]
    want, serial = _run_with_events(smollm2_int4.model, tok, False, requests, kv_blocks=14, cancel_after=5)
    got, overlapped = _run_with_events(smollm2_int4.model, tok, True, requests, kv_blocks=14, cancel_after=5)
    assert got == want
    assert want[1][-1] == "abort" and all(o[-1] == "length" for i, o in enumerate(want) if i != 1)
    assert serial.preemptions > 0 and overlapped.preemptions > 0 and overlapped.mixed_steps_queued > 0
    for eng in (serial, overlapped):
        assert eng.kv_blocks_used == 0 and sorted(eng.kv.free_rows) == list(range(8))
        eng.kv.pool.check()


def _two_decoding(tok, greedy_tokens: int, sampled_tokens: int) -> list[tuple[list[int], SamplingParams]]:
    """Two short requests that decode alone once their prompts are in: one greedy, one
    seeded, of the given lengths."""
    return [(tok("Say hi.")["input_ids"], SamplingParams(max_tokens=greedy_tokens, temperature=0, ignore_eos=True)),
            (tok("Name a colour.")["input_ids"],
             SamplingParams(max_tokens=sampled_tokens, temperature=0.8, seed=11, ignore_eos=True))]


def test_a_prompt_arriving_beside_decode_steps_goes_in_a_mixed_step_queued_behind_one(smollm2_int4):
    """Two requests decode alone (their prompts went in first); a third, of 2-3 chunks, is
    submitted once the first has 6 tokens, so it arrives while decode steps run. With steps
    queued ahead its first chunk goes in a mixed step queued behind the decode step being
    read, not in one planned once that step's ids are read (with the GPU idle meanwhile).
    Against the engine reading each step before planning the next: the same ids and finish
    reasons, and no block or row left held."""
    tok = smollm2_int4.tokenizer
    prompts = _prompts(tok)
    early = _two_decoding(tok, 30, 26)
    late = [(0, 6, prompts[2], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))]
    want, serial = run_requests(smollm2_int4.model, tok, False, early, arrivals=late)
    got, overlapped = run_requests(smollm2_int4.model, tok, True, early, arrivals=late)
    assert got == want and [o[-1] for o in want] == ["length"] * 3
    assert [len(o) - 1 for o in want] == [30, 26, 12]
    assert overlapped.mixed_behind_decode > 0 and serial.mixed_behind_decode == 0
    for eng in (serial, overlapped):
        assert eng.kv_blocks_used == 0 and sorted(eng.kv.free_rows) == list(range(8))
        eng.kv.pool.check()


def test_a_prompt_arriving_as_mixed_steps_end_goes_behind_a_decode_step_queued_behind_them(smollm2_int4):
    """Two requests decode; a third arrives at the first's sixth token (in a mixed step
    queued behind a decode step, as above), and a fourth at the third's first token: the
    token of the mixed step that ends the third's prompt, with no prompt left to mix. With
    steps queued ahead, the decode step after that mixed step is queued behind it, fed on
    the device with its ids, before they are read (``_queue_decode_behind``); the fourth
    prompt, handed to the engine once that decode step is queued, goes in a mixed step
    queued behind it. (A sink runs on the engine thread, so here the fourth arrives after
    the decode step is queued either way; a client's request arriving while the host
    waits for the mixed step's ids is the case this serves, which a GPU shows.) Against
    the engine reading each step before planning the next: the same ids and finish
    reasons, and no block or row left held."""
    tok = smollm2_int4.tokenizer
    prompts = _prompts(tok)
    early = _two_decoding(tok, 34, 30)
    late = [(0, 6, prompts[2], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)),
            (2, 1, prompts[4], SamplingParams(max_tokens=10, temperature=0.7, seed=5, ignore_eos=True))]
    want, serial = run_requests(smollm2_int4.model, tok, False, early, arrivals=late)
    got, overlapped = run_requests(smollm2_int4.model, tok, True, early, arrivals=late)
    assert got == want and [o[-1] for o in want] == ["length"] * 4
    assert [len(o) - 1 for o in want] == [34, 30, 12, 10]
    # a decode step queued behind the last mixed step of the third prompt and of the fourth,
    # and a mixed step behind a decode step for each arrival
    assert overlapped.decode_behind_mixed == 2 and overlapped.mixed_behind_decode == 2
    assert overlapped.look_ahead_dropped == 0  # (each queued decode step was the one read next)
    assert serial.mixed_behind_decode == 0 and serial.decode_behind_mixed == 0
    for eng in (serial, overlapped):
        assert eng.kv_blocks_used == 0 and sorted(eng.kv.free_rows) == list(range(8))
        eng.kv.pool.check()
