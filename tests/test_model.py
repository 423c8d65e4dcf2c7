"""Our Llama-family forward against Hugging Face transformers' (the reference)."""
import shutil
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import tiny_hf_checkpoint
from woq.engine.engine import Engine
from woq.engine.sampling import SamplingParams
from woq.kernels import reference
from woq.models.loader import load_model
from woq.models.quant_config import QuantConfig
from woq.models.quant_linear import WeightOnlyLinear

VOCAB = 49152  # SmolLM2's tokenizer is copied into the tiny checkpoints

ARCHS = {
    "llama": dict(model_type="llama"),
    "llama-bias-tied": dict(model_type="llama", attention_bias=True, tie_word_embeddings=True),
    "llama3-rope": dict(model_type="llama", rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": dict(model_type="mistral", sliding_window=None),
    "qwen2": dict(model_type="qwen2"),  # q/k/v bias, o without
}


@pytest.fixture(scope="module", params=list(ARCHS))
def tiny(request, tmp_path_factory, smollm2_dir):
    path = tiny_hf_checkpoint(tmp_path_factory.mktemp(request.param), vocab_size=VOCAB, **ARCHS[request.param])
    for f in smollm2_dir.glob("tokenizer*"):
        shutil.copy(f, path)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, ref


def _ids(B, T, seed=0):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def _greedy_engine(lm, prompt, steps):
    eng = Engine(lm.model, lm.tokenizer, set(), max_num_seqs=2, max_seq_len=256).start()
    try:
        return eng.generate(prompt, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)).token_ids
    finally:
        eng.shutdown()


def test_tiny_logits_match_transformers(tiny):
    path, ref = tiny
    lm = load_model(str(path), QuantConfig("none"), device="cpu", max_seq_len=256, progress=False)
    ids = _ids(2, 50)
    ours, theirs = lm.model(ids), ref(ids).logits
    assert (ours - theirs).abs().max() < 1e-4 * theirs.abs().max()


def test_tiny_greedy_32_tokens_match_transformers(tiny):
    path, ref = tiny
    lm = load_model(str(path), QuantConfig("none"), device="cpu", max_seq_len=256, progress=False)
    prompt = _ids(1, 12, seed=1)
    theirs = ref.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, 12:].tolist()
    assert _greedy_engine(lm, prompt[0].tolist(), 32) == theirs


def test_packed_prefill_then_decode_match_transformers(tiny):
    """Prompts prefilled together (packed into one forward, each into its own cache slot)
    give each prompt's last-token logits, and a decode step after them gives the logits of
    the prompt + token, as HF computes each sequence alone."""
    from woq.models.batches import Decode, Prefill
    from woq.models.kv_cache import KVCache

    path, ref = tiny
    lm = load_model(str(path), QuantConfig("none"), device="cpu", max_seq_len=256, progress=False)
    model, cfg = lm.model, lm.model.cfg
    prompts = [_ids(1, n, seed=10 + n)[0] for n in (7, 1, 19)]
    slots = [2, 0, 1]
    cache = KVCache(cfg.num_layers, 3, cfg.num_kv_heads, 64, cfg.head_dim, torch.float32, "cpu")
    ours = model(torch.cat(prompts)[None], Prefill.pack([len(p) for p in prompts], slots, "cpu"), cache,
                 last_only=True)
    nxt = _ids(3, 1, seed=4)
    positions = torch.tensor([[len(p)] for p in prompts])
    step = model(nxt, Decode.at(positions, torch.tensor(slots)), cache, last_only=True)
    for i, p in enumerate(prompts):
        theirs = ref(torch.cat([p, nxt[i]])[None]).logits[0]
        scale = theirs.abs().max()
        assert (ours[i] - theirs[-2]).abs().max() < 1e-4 * scale
        assert (step[i] - theirs[-1]).abs().max() < 1e-4 * scale


def test_mixed_packed_forward_matches_transformers(tiny):
    """A packed forward that mixes two running sequences' next tokens (chunks of one, after
    their cached prompts) with a new prompt gives each chunk's last-token logits as HF
    computes each sequence alone: a mixed step of the engine."""
    from woq.models.batches import Prefill
    from woq.models.kv_cache import KVCache

    path, ref = tiny
    lm = load_model(str(path), QuantConfig("none"), device="cpu", max_seq_len=256, progress=False)
    model, cfg = lm.model, lm.model.cfg
    a, b, c = (_ids(1, n, seed=30 + n)[0] for n in (9, 17, 12))
    cache = KVCache(cfg.num_layers, 3, cfg.num_kv_heads, 64, cfg.head_dim, torch.float32, "cpu")
    model(torch.cat([a, b])[None], Prefill.pack([9, 17], [0, 1], "cpu"), cache, last_only=True)
    na, nb = _ids(1, 1, seed=7)[0], _ids(1, 1, seed=8)[0]
    ours = model(torch.cat([na, c, nb])[None], Prefill.pack([1, 12, 1], [0, 2, 1], "cpu", [9, 0, 17]), cache,
                 last_only=True)
    for i, seq in enumerate([torch.cat([a, na]), c, torch.cat([b, nb])]):
        theirs = ref(seq[None]).logits[0, -1]
        assert (ours[i] - theirs).abs().max() < 1e-4 * theirs.abs().max()


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_forward_equals_reference_on_dequantized_weights(tiny, quant):
    """The quantized model is exactly HF's forward with each linear weight replaced by its
    dequantization: checks fusing, quantize-on-load and the cpu_reference path together."""
    path, ref = tiny
    lm = load_model(str(path), QuantConfig(quant), device="cpu", max_seq_len=256, progress=False)
    sd = ref.state_dict()
    for i, layer in enumerate(lm.model.layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        pieces = {"qkv": [a + "q_proj", a + "k_proj", a + "v_proj"], "o": [a + "o_proj"],
                  "gate_up": [m + "gate_proj", m + "up_proj"], "down": [m + "down_proj"]}
        for kind, names in pieces.items():
            mod = getattr(layer.attn if kind in ("qkv", "o") else layer.mlp, kind)
            assert isinstance(mod, WeightOnlyLinear) and mod.bits == (8 if quant == "int8" else 4)
            w = reference.dequantize(mod.qweight)
            for name, part in zip(names, w.split([sd[n + ".weight"].shape[0] for n in names])):
                sd[name + ".weight"] = part
    deq_ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    deq_ref.load_state_dict(sd)
    ids = _ids(2, 40, seed=2)
    ours, theirs = lm.model(ids), deq_ref(ids).logits
    assert (ours - theirs).abs().max() < 1e-4 * theirs.abs().max()


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2_dir):
    lm = load_model(str(smollm2_dir), QuantConfig("none"), device="cpu", max_seq_len=512, progress=False)
    ref = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ids = _ids(2, 64, seed=3)
    ours, theirs = lm.model(ids), ref(ids).logits
    assert (ours - theirs).abs().max() < 1e-4 * theirs.abs().max()
    prompt = lm.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about the moon."}],
                                              add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    theirs = ref.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert _greedy_engine(lm, prompt, 32) == theirs[0, len(prompt):].tolist()


def test_chunked_prefill_engine_matches_transformers(tiny):
    """With a step budget of 5 tokens, a 23-token prompt is prefilled in chunks over several
    engine iterations (each chunk attending to the earlier chunks' cached keys), while a
    second request decodes in the same forwards (its token and a chunk of 4); both
    completions are HF's greedy tokens."""
    path, ref = tiny
    lm = load_model(str(path), QuantConfig("none"), device="cpu", max_seq_len=256, progress=False)
    long, short = _ids(1, 23, seed=5), _ids(1, 4, seed=6)
    theirs = [ref.generate(p, max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, p.shape[1]:].tolist()
              for p in (long, short)]
    steps = []
    eng = Engine(lm.model, lm.tokenizer, set(), max_num_seqs=2, max_seq_len=256, max_prefill_tokens=5)
    eng.observer = type("Obs", (), {
        "on_step": lambda self, b, p: steps.append((b, p)), "on_first_token": lambda self, s: None,
        "on_iteration": lambda self, kind, s: None,
        "on_token_latency": lambda self, s: None, "on_finish": lambda self, *a: None})()
    out = [[], []]
    done = threading.Semaphore(0)
    for i, p in enumerate((short, long)):
        def sink(ev, i=i):
            out[i].extend(ev.token_ids)
            if ev.finish_reason:
                done.release()
        eng.submit(p[0].tolist(), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), sink)
    eng.start()
    try:
        assert done.acquire(timeout=120) and done.acquire(timeout=120)
    finally:
        eng.shutdown()
    assert out == [theirs[1], theirs[0]]
    assert max(p for _, p in steps) <= 5 and sum(p for _, p in steps) == 23 + 4
    assert sum(1 for b, p in steps if p > 0 and b == 1) >= 4  # the short one decoded while the long one prefilled


def test_the_persistent_decode_step_is_asked_for_by_width_unless_set():
    """By default (``DecodeStepOptions.enabled`` None) a model asks for the persistent decode
    step when it is at least ``min_hidden`` wide -- the width it was measured faster at --
    and not when narrower; True or False in the options decide for it either way, except
    for a tensor-parallel shard without peer buffers. On the CPU the engine's step runner
    never builds it."""
    from dataclasses import replace

    from conftest import random_llama
    from woq.engine.decode import DecodeRunner
    from woq.kernels.options import DecodeStepOptions, RuntimeOptions
    from woq.models.builder import bind_kernels
    from woq.models.kv_cache import KVCache

    model = random_llama(torch.float32, "cpu", 64)  # hidden 256
    default = RuntimeOptions()
    assert default.decode_step.enabled is None and model.cfg.hidden_size < default.decode_step.min_hidden
    assert not model.wants_persistent_decode()
    wide = DecodeStepOptions(min_hidden=model.cfg.hidden_size)
    bind_kernels(model, replace(default, decode_step=wide))
    assert model.wants_persistent_decode()
    bind_kernels(model, replace(default, decode_step=replace(wide, enabled=False)))
    assert not model.wants_persistent_decode()
    bind_kernels(model, replace(default, decode_step=DecodeStepOptions(min_hidden=1 << 20, enabled=True)))
    assert model.wants_persistent_decode()
    from woq.models.sharding import TensorParallel

    model.tp = TensorParallel(0, 2)  # (a shard whose group has no peer buffers: its stages could not meet)
    assert not model.wants_persistent_decode()
    model.tp = None
    cfg = model.cfg
    cache = KVCache(cfg.num_layers, 1, cfg.num_kv_heads, 64, cfg.head_dim, torch.float32, "cpu")
    assert DecodeRunner(model, cache)._persistent_step() is None


@pytest.mark.parametrize("flag,enabled,asks", [("auto", None, False), ("on", True, True), ("off", False, False)])
def test_the_decode_step_flag_decides_for_the_model(flag, enabled, asks):
    """``woq serve --decode-step``, parsed as the command line is, gives the model options
    that decide for it: ``auto`` leaves it to the width (this model is narrower than 4096),
    ``on`` and ``off`` override it."""
    from pydantic_settings import CliApp

    from conftest import random_llama
    from woq.models.builder import bind_kernels
    from woq.service.config import ServeSettings

    settings = CliApp.run(ServeSettings, cli_args=["--decode-step", flag])
    assert settings.runtime_options().decode_step.enabled is enabled
    model = random_llama(torch.float32, "cpu", 64)
    bind_kernels(model, settings.runtime_options())
    assert model.wants_persistent_decode() is asks
