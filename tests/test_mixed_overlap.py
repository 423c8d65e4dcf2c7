"""A mixed step queued behind the one whose tokens the host is reading (``Engine._queue_mixed``)
gives the tokens of steps read one by one."""
from __future__ import annotations

from conftest import run_to_end
from woq.engine.engine import Engine
from woq.engine.sampling import SamplingParams


def run_requests(model, tokenizer, overlap: bool, requests: list[tuple[list[int], SamplingParams]],
                 budget: int = 16, **engine_args) -> tuple[list[list], Engine]:
    """Every request queued before the engine starts (both engines see the same arrivals);
    each request's ids, then its finish reason."""
    eos = {tokenizer.eos_token_id} if tokenizer is not None else set()
    eng = Engine(model, tokenizer, eos, max_num_seqs=8, max_seq_len=256, max_prefill_tokens=budget,
                 prefix_caching=False, overlap_mixed_steps=overlap, **engine_args)
    return run_to_end(eng, requests), eng


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


def test_queued_mixed_steps_give_the_tokens_of_steps_read_one_by_one(smollm2_int4):
    """Prompts of 20-50 tokens go in chunks of a 16-token budget beside the streams already
    decoding, so mixed steps follow each other and each is queued behind the last. Against
    the same engine reading each step before planning the next: the same ids and finish
    reasons, with sequences ending by length (known ahead), by a stop id (known only once
    read: the queued step's row for it is dropped) and seeded sampling beside greedy."""
    tok = smollm2_int4.tokenizer
    texts = ["Count from one to ten in French, then in Spanish, then in German, separated by commas.",
             "Write a list of fruits:", "Name three rivers in Europe and say where each one flows into the sea.",
             "What is the capital of Italy?", "List some tools a carpenter uses every day in the workshop."]
    prompts = [tok(f"{t} Answer briefly, in plain words, and do not repeat the question.")["input_ids"]
               for t in texts]
    check_overlap(smollm2_int4.model, tok, prompts)
