"""Logit processors and log-probabilities (engine/logits.py): each against a plain fp64
reference written here, then through the engine on the real SmolLM2 against a reference
decode loop of whole-sequence forwards."""
import math
import random

import pytest
import torch

from woq.engine.logits import BatchSampling, Logprobs, TokenHistory
from woq.engine.sampling import SamplingParams

V = 64


def _reference_process(logits: list[float], p: SamplingParams, prompt: list[int], generated: list[int],
                       eos: set[int]) -> list[float]:
    """vLLM's order in plain Python floats: bias, min_tokens bans, repetition, frequency and
    presence penalties."""
    out = [float(x) for x in logits]
    for tok, b in p.logit_bias:
        out[tok] += b
    if len(generated) < p.min_tokens:
        for tok in set(p.stop_token_ids) | (set() if p.ignore_eos else eos):
            out[tok] = -math.inf
    for tok in range(len(out)):
        n = generated.count(tok)
        if (n or tok in prompt) and p.repetition_penalty != 1.0:
            out[tok] = out[tok] / p.repetition_penalty if out[tok] > 0 else out[tok] * p.repetition_penalty
        out[tok] -= p.frequency_penalty * n + p.presence_penalty * (n > 0)
    return out


def test_processors_match_the_reference_row_by_row():
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    eos = {3, 7}
    params, prompts, generated = [], [], []
    for i in range(12):
        params.append(SamplingParams(
            max_tokens=40, temperature=0 if i % 3 == 0 else 0.8, seed=i,
            presence_penalty=rng.choice([0.0, 0.5, -1.0]), frequency_penalty=rng.choice([0.0, 0.3, 1.5]),
            repetition_penalty=rng.choice([1.0, 1.3, 0.7]),
            logit_bias=tuple((rng.randrange(V), rng.uniform(-5, 5)) for _ in range(rng.randrange(3))),
            min_tokens=rng.choice([0, 2, 6]), stop_token_ids=tuple(rng.sample(range(V), rng.randrange(2)))))
        prompts.append([rng.randrange(V) for _ in range(rng.randrange(1, 9))])
        generated.append([rng.randrange(V) for _ in range(rng.randrange(0, 9))])
    slots = list(range(len(params)))[::-1]  # (rows and slots differ)
    history = TokenHistory(len(params), 16, V, torch.device("cpu"))
    for s, pr, gen in zip(slots, prompts, generated):
        history.start(s, pr)
        history.ids[s, : len(gen)] = torch.tensor(gen, dtype=torch.long)
        history.ids[s, len(gen):] = 5  # (past a row's step: never counted)
    logits = torch.randn(len(params), V, generator=g) * 3
    bs = BatchSampling.of(params, [p.seed for p in params], [len(x) for x in generated], slots, eos,
                          torch.device("cpu"))
    got = bs.process(logits, history)
    for i, p in enumerate(params):
        want = torch.tensor(_reference_process(logits[i].tolist(), p, prompts[i], generated[i], eos),
                            dtype=torch.float64)
        finite = torch.isfinite(want)
        assert torch.equal(torch.isfinite(got[i]), finite), i
        assert torch.allclose(got[i].double()[finite], want[finite], atol=1e-5, rtol=1e-6), i


def test_draw_writes_the_history_and_bans_lift_at_min_tokens():
    eos = {0}
    p = SamplingParams(max_tokens=8, temperature=0, min_tokens=2, frequency_penalty=0.1)
    history = TokenHistory(2, 8, V, torch.device("cpu"))
    history.start(1, [4])
    logits = torch.zeros(1, V)
    logits[0, 0] = 10.0  # EOS is the argmax
    bs = BatchSampling.of([p], [1], [0], [1], eos, torch.device("cpu"))
    first, _ = bs.draw(logits, history)
    second, _ = bs.next().draw(logits, history)
    third, _ = bs.next().next().draw(logits, history)
    assert first.item() != 0 and second.item() != 0 and third.item() == 0  # EOS allowed from index 2
    assert history.ids[1, :3].tolist() == [first.item(), second.item(), 0]


def test_logprobs_are_the_model_distribution():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 500, generator=g) * 4
    tokens = torch.tensor([5, 17, 499])
    lp = Logprobs.of(logits, tokens, 20).to_host()
    for i in range(3):
        row = [float(x) for x in logits[i].double()]
        m = max(row)
        lse = m + math.log(sum(math.exp(x - m) for x in row))
        want = sorted(((x - lse, t) for t, x in enumerate(row)), reverse=True)[:20]
        assert abs(lp.chosen[i].item() - (row[tokens[i]] - lse)) < 1e-4
        got = lp.row(i, 20, int(tokens[i]))
        assert got.token == int(tokens[i])
        assert [t for t, _ in got.top] == [t for _, t in want]
        assert all(abs(v - w) < 1e-4 for (_, v), (w, _) in zip(got.top, want))
        assert got.top[:3] == lp.row(i, 3, 0).top


def test_params_reject_out_of_range():
    for bad in (dict(logprobs=21), dict(logprobs=-1), dict(repetition_penalty=0.0), dict(min_tokens=-1),
                dict(max_tokens=4, min_tokens=5)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# -- through the engine, on the real model ---------------------------------------------------

@pytest.fixture(scope="module")
def engine(smollm2_int4):
    from woq.engine.engine import Engine

    lm = smollm2_int4
    eng = Engine(lm.model, lm.tokenizer, {lm.tokenizer.eos_token_id}, max_num_seqs=4, max_queue=16,
                 max_seq_len=256).start()
    yield eng
    eng.shutdown()


def _reference_decode(model, prompt: list[int], p: SamplingParams, eos: set[int], n: int):
    """Greedy tokens and the model's log-probabilities, one whole-sequence forward per token
    (no KV cache, no batching), processors from ``_reference_process``."""
    ids, lps = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids], device=model.device), last_only=True)[0].double()
        gen = ids[len(prompt):]
        processed = _reference_process(logits.tolist(), p, prompt, gen, eos)
        tok = max(range(len(processed)), key=processed.__getitem__)
        lps.append(torch.log_softmax(logits, -1)[tok].item())
        ids.append(tok)
    return ids[len(prompt):], lps


def test_engine_penalties_bias_and_logprobs_equal_a_reference_loop(engine, smollm2_int4):
    lm = smollm2_int4
    tok = lm.tokenizer
    prompt = tok("The cat sat on the mat. The cat sat on the mat. The cat")["input_ids"]
    eos = {tok.eos_token_id}
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.3,
                       frequency_penalty=0.4, presence_penalty=0.2, logit_bias=((tok.encode(" sat")[0], -3.0),),
                       logprobs=3)
    want, want_lp = _reference_decode(lm.model, prompt, p, eos, 12)
    plain = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    got = engine.generate(prompt, p)
    assert got.token_ids == want
    assert got.token_ids != plain.token_ids  # (the processors changed the text)
    assert len(got.logprobs) == 12
    for lp, w, t in zip(got.logprobs, want_lp, got.token_ids):
        assert abs(lp.logprob - w) < 2e-3
        assert len(lp.top) == 3 and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
        assert lp.logprob <= lp.top[0][1] + 1e-6
    assert plain.logprobs is None


def test_penalized_sampled_request_is_the_same_in_any_batch(engine, smollm2_int4):
    import threading

    tok = smollm2_int4.tokenizer
    prompt = tok("Once upon a time")["input_ids"]
    p = SamplingParams(max_tokens=16, temperature=0.9, seed=1234, ignore_eos=True, frequency_penalty=0.8,
                       repetition_penalty=1.2, logit_bias=((tok.encode(" the")[0], 2.0),))
    alone = engine.generate(prompt, p).token_ids
    others = [tok(t)["input_ids"] for t in ("Hello there", "A list of fruits:", "def f(x):")]
    out = [None] * 4
    barrier = threading.Barrier(4)

    def run(i):
        barrier.wait()
        if i == 0:
            out[0] = engine.generate(prompt, p).token_ids
        else:  # neighbours with other processors (and none), so the batch mixes them
            q = SamplingParams(max_tokens=20, temperature=0.7, seed=i, presence_penalty=1.0 * (i % 2), ignore_eos=True)
            out[i] = engine.generate(others[i - 1], q).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert out[0] == alone


def test_stop_token_ids_end_the_request_and_min_tokens_holds_them_off(engine, smollm2_int4):
    tok = smollm2_int4.tokenizer
    prompt = tok("1, 2, 3, 4, 5,")["input_ids"]
    free = engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    stop = free.token_ids[2]
    got = engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=(stop,)))
    first = free.token_ids.index(stop)
    assert got.finish_reason == "stop" and got.token_ids == free.token_ids[: first + 1]
    assert got.text == tok.decode(free.token_ids[:first])  # (the stop token is not part of the text)
    held = engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                  stop_token_ids=(stop,), min_tokens=first + 2))
    assert stop not in held.token_ids[: first + 2]
