"""Constrained decoding (engine/grammar.py, llguidance): the bitmask against a bit-by-bit
reference, then through the engine on the real SmolLM2, outputs checked by Python's own
``json`` and ``re``."""
import json
import re
import threading

import pytest
import torch

from woq.engine.grammar import apply_masks, json_schema_grammar, lark_grammar, regex_grammar
from woq.engine.sampling import SamplingParams


def test_masks_disallow_exactly_the_cleared_bits():
    g = torch.Generator().manual_seed(0)
    words, V = 5, 150  # (V not a multiple of 32: the last word's high bits lie past the vocabulary)
    mask = torch.randint(-(1 << 31), (1 << 31) - 1, (3, words), generator=g, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(3, V, generator=g)
    out = apply_masks(logits, mask)
    for b in range(3):
        for t in range(V):
            allowed = (int(mask[b, t // 32]) >> (t % 32)) & 1
            assert (out[b, t].item() == logits[b, t].item()) if allowed else out[b, t].item() == float("-inf")


@pytest.fixture(scope="module")
def engine(smollm2_int4):
    from woq.engine.engine import Engine

    lm = smollm2_int4
    eng = Engine(lm.model, lm.tokenizer, {lm.tokenizer.eos_token_id}, max_num_seqs=4, max_queue=16,
                 max_seq_len=512).start()
    yield eng
    eng.shutdown()


def _chat(tok, text):
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}, "pets": {"type": "array",
                                                                                "items": {"type": "string"},
                                                                                "maxItems": 3}},
          "required": ["name", "age", "pets"], "additionalProperties": False}


def test_json_schema_output_parses_and_matches(engine, smollm2_int4):
    tok = smollm2_int4.tokenizer
    out = engine.generate(_chat(tok, "Describe a person as JSON."),
                          SamplingParams(max_tokens=120, temperature=0, grammar=json_schema_grammar(SCHEMA)))
    assert out.finish_reason == "stop", out.text
    value = json.loads(out.text)
    assert set(value) == {"name", "age", "pets"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 20 and isinstance(value["age"], int)
    assert isinstance(value["pets"], list) and len(value["pets"]) <= 3 and all(isinstance(p, str) for p in value["pets"])


def test_regex_and_lark_outputs_match(engine, smollm2_int4):
    tok = smollm2_int4.tokenizer
    prompt = _chat(tok, "Give me a phone number.")
    out = engine.generate(prompt, SamplingParams(max_tokens=20, temperature=0.8, seed=3,
                                                 grammar=regex_grammar(r"\(\d{3}\) \d{3}-\d{4}")))
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", out.text), out.text
    out = engine.generate(prompt, SamplingParams(max_tokens=20, temperature=0,
                                                 grammar=lark_grammar('start: "yes" | "no" | "maybe"')))
    assert out.text in ("yes", "no", "maybe") and out.finish_reason == "stop"


def test_constrained_rows_do_not_touch_their_neighbours(engine, smollm2_int4):
    tok = smollm2_int4.tokenizer
    free = [_chat(tok, t) for t in ("What is 2+2?", "Name a colour.", "Say hi.")]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    alone = [engine.generate(p, params).token_ids for p in free]
    together = [None] * 4
    barrier = threading.Barrier(4)

    def run(i):
        barrier.wait()
        if i == 3:
            together[3] = engine.generate(_chat(tok, "JSON please."),
                                          SamplingParams(max_tokens=40, temperature=0,
                                                         grammar=json_schema_grammar({"type": "object"})))
        else:
            together[i] = engine.generate(free[i], params).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert together[:3] == alone
    text = together[3].text
    assert text.startswith("{")
    if together[3].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_an_invalid_grammar_is_refused_at_submit(engine):
    with pytest.raises(ValueError, match="invalid grammar"):
        engine.submit([1, 2, 3], SamplingParams(max_tokens=4, grammar=lark_grammar("start: (")), lambda ev: None)


def test_several_constrained_rows_in_one_batch(engine, smollm2_int4):
    """Masks of several rows filled together (llguidance's thread pool), each its own grammar."""
    tok = smollm2_int4.tokenizer
    patterns = [r"[0-9]{4}", r"(red|green|blue)", r"[a-z]{2,6}@[a-z]{3}\.com"]
    out = [None] * 3
    barrier = threading.Barrier(3)

    def run(i):
        barrier.wait()
        out[i] = engine.generate(_chat(tok, "Answer briefly."),
                                 SamplingParams(max_tokens=20, temperature=0.7, seed=i,
                                                grammar=regex_grammar(patterns[i])))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for pattern, res in zip(patterns, out):
        assert re.fullmatch(pattern, res.text), (pattern, res.text)
