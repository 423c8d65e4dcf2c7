"""The paged KV cache on CPU, on the real SmolLM2: attention through shuffled block tables,
preemption with recompute, prefix caching."""
import random
import threading

import pytest
import torch

from woq.engine.engine import Engine
from woq.engine.sampling import SamplingParams
from woq.models.attention import end_aligned_causal
from woq.models.batches import Decode, Prefill
from woq.models.kv_cache import KVCache

from conftest import PrefillCounter


def _shuffled_cache(cfg, rows: int, max_len: int, seed: int) -> KVCache:
    """A pool with more blocks than the rows need, each row given random ones."""
    cache = KVCache(cfg.num_layers, rows, cfg.num_kv_heads, max_len, cfg.head_dim, torch.float32, "cpu",
                    block_size=16, num_blocks=1 + 3 * rows * (max_len // 16))
    blocks = list(range(1, cache.num_blocks))
    random.Random(seed).shuffle(blocks)
    for r in range(rows):
        cache.assign(r, 0, blocks[r * cache.blocks_per_row:(r + 1) * cache.blocks_per_row])
    return cache


@pytest.mark.parametrize("n, total", [(1, 1), (1, 9), (5, 5), (3, 17), (16, 40)])
def test_a_chunks_cpu_mask_is_what_sdpa_makes_of_torchs_lower_right_causal_bias(n, total):
    """A chunk after cached positions: on the CPU the prefill builds its own boolean mask
    (sparing the import of ``torch.nn.attention.bias``); it must be the mask SDPA
    materializes from torch's lower-right causal bias."""
    from torch.nn.attention.bias import causal_lower_right

    expected = causal_lower_right(n, total)._materialize(torch.device("cpu"))
    assert torch.equal(end_aligned_causal(n, total, torch.device("cpu")), expected)


def test_paged_attention_through_shuffled_tables_equals_contiguous_blocks_and_a_cacheless_forward(smollm2_int4):
    """Two prompts prefilled in chunks and decoded 6 steps: shuffled block tables give the
    logits of a table of consecutive blocks bit for bit (only addresses differ), and both
    match a forward of the whole sequence without a cache (causal attention, fp32)."""
    model = smollm2_int4.model
    cfg = model.cfg
    torch.manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,)).tolist() for n in (37, 21)]
    fed = [torch.randint(0, cfg.vocab_size, (6,)).tolist() for _ in prompts]
    runs = []
    for cache in (KVCache(cfg.num_layers, 2, cfg.num_kv_heads, 96, cfg.head_dim, torch.float32, "cpu"),
                  _shuffled_cache(cfg, 2, 96, seed=1), _shuffled_cache(cfg, 2, 96, seed=2)):
        with torch.inference_mode():
            # the first prompt in two chunks (positions 0-19, then 20-36 beside the second prompt)
            model(torch.tensor([prompts[0][:20]]), Prefill.pack([20], [0], "cpu"), cache, last_only=True)
            ids = torch.tensor([prompts[0][20:] + prompts[1]])
            out = [model(ids, Prefill.pack([17, 21], [0, 1], "cpu", [20, 0]), cache, last_only=True)]
            for t in range(6):
                pos = torch.tensor([[len(p) + t] for p in prompts])
                out.append(model(torch.tensor([[f[t]] for f in fed]), Decode.at(pos, torch.tensor([0, 1])), cache,
                                 last_only=True))
        runs.append(torch.stack(out))
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    with torch.inference_mode():
        for i, (p, f) in enumerate(zip(prompts, fed)):
            full = model(torch.tensor([p + f]))[0]  # [T, V]: every position's logits
            want = full[len(p) - 1:len(p) + 6]
            assert torch.allclose(runs[0][:, i], want, atol=2e-3, rtol=1e-3), (runs[0][:, i] - want).abs().max()


def _run_all(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    done = threading.Semaphore(0)
    out = [[] for _ in prompts]

    def sink_for(i):
        def sink(ev):
            out[i].extend(ev.token_ids)
            if ev.finish_reason:
                assert ev.finish_reason == "length", ev
                done.release()
        return sink

    for i, p in enumerate(prompts):
        engine.submit(p, params, sink_for(i))
    for _ in prompts:
        assert done.acquire(timeout=120)
    return out


def _engine(lm, **kw) -> Engine:
    return Engine(lm.model, lm.tokenizer, {lm.tokenizer.eos_token_id}, max_seq_len=256, **kw).start()


@pytest.fixture(scope="module")
def roomy(smollm2_int4):
    eng = _engine(smollm2_int4, max_num_seqs=8, prefix_caching=False)
    yield eng
    eng.shutdown()


def test_preempted_sequences_give_the_greedy_tokens_of_an_unpreempted_run(smollm2_int4, roomy):
    """Six requests of 40 tokens in a pool of 12 blocks (each needs 4): sequences are
    preempted and recomputed, every request still gets the tokens it gets alone in a
    roomy engine, and no block is left held."""
    lm = smollm2_int4
    tok = lm.tokenizer
    prompts = [tok(f"Write a list of {w}:")["input_ids"] for w in ("fruits", "rivers", "stars", "tools", "kings",
                                                                      "birds")]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = [_run_all(roomy, [p], params)[0] for p in prompts]
    per_block = KVCache.bytes_per_token(lm.model.cfg.num_layers, lm.model.cfg.num_kv_heads, lm.model.cfg.head_dim,
                                        lm.model.dtype) * 16
    tight = _engine(lm, max_num_seqs=6, kv_cache_gib=12 * per_block / (1 << 30))
    try:
        assert tight.kv_blocks_total == 12
        got = _run_all(tight, prompts, params)
        assert tight.preemptions > 0
        assert got == want
        assert tight.kv_blocks_used == 0 and sorted(tight.kv.free_rows) == list(range(6))
        tight.kv.pool.check()
    finally:
        tight.shutdown()


def test_a_cached_prefix_is_not_prefilled_again_and_changes_no_token(smollm2_int4, roomy):
    """A second request sharing a 70-token prefix with a finished one prefills only what
    follows the cached blocks (64 tokens found: 4 full blocks), and decodes the tokens a
    cache-less engine gives; a third, sharing nothing, finds nothing."""
    lm = smollm2_int4
    tok = lm.tokenizer
    shared = tok("You are a careful assistant. Answer in one short sentence, and never use the letter z. " * 4)[
        "input_ids"][:70]
    assert len(shared) == 70
    first = shared + tok(" What is the capital of France?")["input_ids"]
    second = shared + tok(" Name a large river in Africa.")["input_ids"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    seen = PrefillCounter()
    eng = _engine(lm, max_num_seqs=4, observer=seen)
    try:
        _run_all(eng, [first], params)
        before, hits = seen.prefill_tokens, eng.kv.pool.hit_tokens
        got = _run_all(eng, [second], params)[0]
        assert eng.kv.pool.hit_tokens - hits == 64
        assert seen.prefill_tokens - before == len(second) - 64
        assert got == _run_all(roomy, [second], params)[0]
        hits = eng.kv.pool.hit_tokens
        _run_all(eng, [tok("Tell me a story about a cat.")["input_ids"]], params)
        assert eng.kv.pool.hit_tokens == hits
        eng.kv.pool.check()
    finally:
        eng.shutdown()


def test_requests_arriving_together_prefill_their_shared_prefix_once(smollm2_int4, roomy):
    """Three requests with one 70-token opening, queued before the engine starts: the first
    prefills it, the others wait for its blocks to be cached (one iteration) and prefill
    only what follows the 64 cached tokens; their tokens are a cache-less engine's."""
    lm = smollm2_int4
    tok = lm.tokenizer
    shared = tok("Follow the house style: short answers, plain words, no lists, and a friendly tone. " * 4)[
        "input_ids"][:70]
    assert len(shared) == 70
    prompts = [shared + tok(q)["input_ids"] for q in (" Why is the sky blue?", " What is rain?", " Where is Peru?")]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    seen = PrefillCounter()
    eng = Engine(lm.model, lm.tokenizer, {lm.tokenizer.eos_token_id}, max_seq_len=256, max_num_seqs=4, observer=seen)
    try:
        done = threading.Semaphore(0)
        out = [[] for _ in prompts]
        for i, p in enumerate(prompts):
            eng.submit(p, params, lambda ev, i=i: (out[i].extend(ev.token_ids), ev.finish_reason and done.release()))
        eng.start()
        for _ in prompts:
            assert done.acquire(timeout=120)
        assert seen.prefill_tokens == sum(len(p) for p in prompts) - 2 * 64
        assert out == [_run_all(roomy, [p], params)[0] for p in prompts]
    finally:
        eng.shutdown()
