"""Continuous batching, stop strings and the dispatch record, on the real SmolLM2 (int4 g128);
a request's choices cancelled together, on a tiny random model."""
import threading

import pytest
import torch

from conftest import random_llama
from woq.engine.detokenizer import TextStream
from woq.engine.engine import Engine, QueueFullError, RequestTooLongError
from woq.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "What is 2+2?", "Name three colors.",
    "Who wrote Hamlet?", "Explain gravity in one sentence.", "List two fruits.", "What is water made of?",
    "Say hello in Spanish.", "What day comes after Monday?", "How many legs does a spider have?",
    "What color is the sky?", "Translate 'cat' to French.", "What is the largest planet?",
    "Give me a synonym for happy.", "What is the boiling point of water?",
]


def _chat(tok, text):
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def engine(smollm2_int4):
    lm = smollm2_int4
    eng = Engine(lm.model, lm.tokenizer, {lm.tokenizer.eos_token_id}, max_num_seqs=16, max_queue=64,
                 max_seq_len=512).start()
    yield eng
    eng.shutdown()


def test_16_concurrent_greedy_requests_equal_each_alone(engine, smollm2_int4):
    tok = smollm2_int4.tokenizer
    prompts = [_chat(tok, p) for p in PROMPTS]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = [engine.generate(p, params).token_ids for p in prompts]
    together: list = [None] * len(prompts)
    steps_seen = []
    engine.observer = type("Obs", (), {
        "on_step": lambda self, b, p: steps_seen.append(b), "on_first_token": lambda self, s: None,
        "on_iteration": lambda self, kind, s: None,
        "on_token_latency": lambda self, s: None, "on_finish": lambda self, *a: None})()
    barrier = threading.Barrier(len(prompts))

    def run(i):
        barrier.wait()
        together[i] = engine.generate(prompts[i], params).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    engine.observer = None
    assert together == alone
    assert max(steps_seen) >= 8, "requests should have decoded together in one batch"


def test_sampled_request_is_reproducible_in_any_batch(engine, smollm2_int4):
    tok = smollm2_int4.tokenizer
    p = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    first = engine.generate(_chat(tok, PROMPTS[1]), p).token_ids
    results = []
    threads = [threading.Thread(target=lambda: results.append(engine.generate(_chat(tok, PROMPTS[1]), p).token_ids))]
    threads += [threading.Thread(target=engine.generate, args=(_chat(tok, q), SamplingParams(max_tokens=20, seed=i)))
                for i, q in enumerate(PROMPTS[2:6])]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert results == [first]


def test_stop_strings_and_finish_reasons(engine, smollm2_int4):
    tok = smollm2_int4.tokenizer
    prompt = _chat(tok, PROMPTS[0])
    full = engine.generate(prompt, SamplingParams(max_tokens=40, temperature=0))
    assert "Paris" in full.text and full.finish_reason == "stop"  # EOS
    cut = engine.generate(prompt, SamplingParams(max_tokens=40, temperature=0, stop=("Paris",)))
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index("Paris")]
    kept = engine.generate(prompt, SamplingParams(max_tokens=40, temperature=0, stop=("Paris",),
                                                  include_stop_str=True))
    assert kept.finish_reason == "stop" and kept.text == cut.text + "Paris"
    short = engine.generate(prompt, SamplingParams(max_tokens=3, temperature=0))
    assert short.finish_reason == "length" and short.completion_tokens == 3


def test_a_cancel_ends_the_choices_still_running_after_the_first_ended():
    """A request's cancel (its client gone) ends its choices still running after its first
    choice has ended, within the steps in flight, rather than leaving them to run on for
    nobody. The model samples at temperature 1 with 1 token in 16 an end of sequence, so
    that choices end at different steps; seeds are tried until three requests have had
    their first choice end while another still ran."""
    model = random_llama(torch.float32, "cpu", 512)
    eng = Engine(model, None, set(range(0, 512, 16)), max_num_seqs=4, max_queue=4, max_seq_len=512).start()
    slack = 3  # tokens: the step handed out late, the one running, the next
    cases = 0
    try:
        for seed in range(200):
            tokens, ended, first, done = [0, 0, 0], {}, threading.Event(), threading.Event()

            def sink(i):
                def on(ev):
                    tokens[i] += len(ev.token_ids)
                    if ev.finish_reason:
                        ended[i] = ev
                        if i == 0:
                            first.set()
                        if len(ended) == 3:
                            done.set()
                return on

            rid = eng.submit([1, 2, 3], SamplingParams(max_tokens=400, temperature=1.0, seed=seed), sink(0),
                             choices=[sink(1), sink(2)])
            assert first.wait(60)
            running = {i: tokens[i] for i in (1, 2) if i not in ended}
            eng.cancel(rid)
            assert done.wait(60)
            if not running or ended[0].finish_reason != "stop":
                continue
            cases += 1
            for i, before in running.items():
                assert ended[i].completion_tokens <= before + slack, (seed, i, before, ended[i])
            if cases == 3:
                break
        assert cases == 3
        assert not eng.running and not eng.waiting and not eng.by_id
    finally:
        eng.shutdown()


def test_admission_limits(smollm2_int4):
    """A burst that arrives before the engine admits anything gets the free slots and the
    queue; one request more is refused."""
    lm = smollm2_int4
    eng = Engine(lm.model, lm.tokenizer, set(), max_num_seqs=3, max_queue=2, max_seq_len=64)
    sink = lambda ev: None  # noqa: E731  (engine not started: requests stay waiting)
    with pytest.raises(RequestTooLongError):
        eng.submit(list(range(60)), SamplingParams(max_tokens=10), sink)
    for _ in range(3 + 2):
        eng.submit([1, 2, 3], SamplingParams(max_tokens=4), sink)
    with pytest.raises(QueueFullError):
        eng.submit([1, 2, 3], SamplingParams(max_tokens=4), sink)


def test_dispatch_records_path_layer_and_m(smollm2_int4):
    lm = smollm2_int4
    calls, counted = [], []

    class Recorder:
        def count(self, call, n):
            counted.extend([call] * n)

        def time(self, call, seconds):
            calls.append((call, seconds))

    from woq.kernels.observe import KernelTiming

    lm.model.observe_kernels(KernelTiming(Recorder(), sample_every=1))
    try:
        import torch
        lm.model(torch.tensor([[1, 2, 3, 4, 5]]))
    finally:
        lm.model.observe_kernels(None)
    kinds = {c.layer for c, _ in calls}
    assert kinds == {"qkv", "o", "gate_up", "down", "lm_head"}
    quantized = [c for c, _ in calls if c.layer != "lm_head"]
    assert len(quantized) == 4 * lm.model.cfg.num_layers
    assert all(c.path == "cpu_reference" and c.bits == 4 and c.m == 5 for c in quantized)
    assert all(c.path == "dense" and c.bits == 16 for c, _ in calls if c.layer == "lm_head")
    assert all(s is not None and s > 0 for _, s in calls)
    assert counted == [c for c, _ in calls]  # (every call timed, each counted once)


class _WordTokenizer:
    """Decodes ids to fixed strings, to drive the stream byte-exactly."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids)


def test_text_stream_holds_back_partial_stop_strings():
    tok = _WordTokenizer(["Hello", " wor", "ld", " EN", "D", " more", "\ufffd"])
    s = TextStream(tok, stop=(" END",))
    assert s.add(0) == "Hello"
    assert s.add(1) == " wor"
    assert s.add(2) == "ld"
    assert s.add(3) == ""  # " EN" could begin " END": held back
    assert s.add(4) == "" and s.stopped  # " END" completes the stop string: dropped
    assert s.finish() == "" and s.text == "Hello world"
    s = TextStream(tok, stop=(" END",))
    s.add(0), s.add(3)
    assert s.add(5) == " EN more"  # not a stop string after all: released
    s = TextStream(tok)
    assert s.add(6) == ""  # an incomplete UTF-8 character is never emitted mid-stream
    # keep_stop: the stop string found ends the text (held back until complete, then released)
    s = TextStream(tok, stop=(" END",), keep_stop=True)
    assert [s.add(i) for i in (0, 1, 2, 3, 4)] == ["Hello", " wor", "ld", "", " END"]
    assert s.stopped and s.finish() == "" and s.text == "Hello world END"
    # of two found beginning at one place in one token, the longer
    s = TextStream(tok, stop=(" w", " wor"), keep_stop=True)
    assert s.add(0) == "Hello" and s.add(1) == " wor" and s.stopped and s.text == "Hello wor"


def test_text_stream_and_token_bytes_on_split_characters(smollm2_dir):
    """Byte-level BPE splits an emoji over several tokens: the stream emits the character once
    it is whole; a stream ending inside it releases the tokenizer's own decode (U+FFFD), so the
    text always equals ``decode`` of every token; each token's bytes join into UTF-8."""
    from transformers import AutoTokenizer

    from woq.engine.detokenizer import token_bytes

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    text = "Hi 👋 né, 日本語 ok"
    ids = tok.encode(text)
    assert b"".join(token_bytes(tok, i) for i in ids) == text.encode()
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # (the case under test occurs)
    for cut in range(1, len(ids) + 1):
        s = TextStream(tok)
        released = "".join(s.add(i) for i in ids[:cut])
        assert "\ufffd" not in released and text.startswith(released)
        assert released + s.finish() == tok.decode(ids[:cut])
