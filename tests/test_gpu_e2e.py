"""SmolLM2 through the CUDA kernels against the reference path on the same GPU (issue 3's
end-to-end check): same greedy tokens for 32 steps, perplexity within 0.1 %."""
import os
from pathlib import Path

import pytest
import torch

from woq.engine.engine import Engine
from woq.engine.sampling import SamplingParams
from woq.models import dispatch
from woq.models.builder import QuantConfig
from woq.models.evaluate import DEFAULT_TEXT, perplexity
from woq.models.loader import load_model
from woq.models.quant_linear import WeightOnlyLinear

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain gravity in one sentence."]


def _greedy(lm, prompts, steps=32):
    tok = lm.tokenizer
    eng = Engine(lm.model, tok, set(), max_batch_size=4, max_seq_len=256).start()
    try:
        out = []
        for p in prompts:
            ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            out.append(eng.generate(ids, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)).token_ids)
        return out
    finally:
        eng.shutdown()


class _Paths:
    def __init__(self):
        self.seen = set()

    def record(self, call, seconds):
        self.seen.add((call.path, call.m > 16))


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_kernels_match_the_reference_path(smollm2_dir, quant):
    fast = load_model(str(smollm2_dir), QuantConfig(quant), dtype=torch.float16, device="cuda", max_seq_len=1024,
                      progress=False)
    ref = load_model(str(smollm2_dir), QuantConfig(quant), dtype=torch.float16, device="cuda", max_seq_len=1024,
                     progress=False)
    layers = [m for m in ref.model.modules() if isinstance(m, WeightOnlyLinear)]
    assert layers and all(m.has_gpu_kernels() for m in layers)
    for m in layers:  # the reference: dequantized fp16 weight + cuBLAS, via the torch ops
        m.gpu = None
    paths = _Paths()
    dispatch.set_observer(paths)
    try:
        fast_tokens = _greedy(fast, PROMPTS)
    finally:
        dispatch.set_observer(None)
    assert (dispatch.GEMV, False) in paths.seen  # decode steps went through the GEMV
    assert {p for p, big in paths.seen if big} <= {dispatch.MIXED_GEMM, dispatch.DEQUANT_CUBLAS, dispatch.DENSE}
    assert fast_tokens == _greedy(ref, PROMPTS)

    text_path = Path(os.environ.get("WOQ_EVAL_TEXT", DEFAULT_TEXT))
    if not text_path.exists():
        pytest.skip(f"no evaluation text at {text_path}")
    text = text_path.read_text()
    p_fast = perplexity(fast.model, fast.tokenizer, text, progress=False).perplexity
    p_ref = perplexity(ref.model, ref.tokenizer, text, progress=False).perplexity
    print(f"SmolLM2 {quant} wikitext-2 (40x512): kernels {p_fast:.4f}, reference {p_ref:.4f}")
    assert abs(p_fast / p_ref - 1) < 1e-3
