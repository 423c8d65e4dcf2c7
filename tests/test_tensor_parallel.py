"""Tensor parallelism on the CPU: a tiny int4 Llama split over 2 and 4 processes (gloo)
picks the whole model's next tokens, with logits within fp32 rounding of its own (the
all-reduce sums the row-parallel partial products in another order)."""
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from woq.models.batches import Decode, Prefill
from woq.models.builder import QuantConfig, build_model
from woq.models.kv_cache import KVCache
from woq.models.sharding import TensorParallel

from conftest import tiny_hf_checkpoint

PROMPT = [5, 17, 301, 44, 9, 120, 77]
FED = [3, 250, 66, 410, 8, 199, 31, 500, 12, 77, 140]  # decode inputs (varied contexts, unlike a greedy loop's)


def _build(ckpt, tp):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    state = load_file(str(ckpt / "model.safetensors"))
    return build_model(AutoConfig.from_pretrained(ckpt), state, QuantConfig("int4", 32), torch.float32, "cpu", 64,
                       progress=False, tp=tp)


@torch.inference_mode()
def _next_tokens(model) -> tuple[list[int], torch.Tensor]:
    """Prefill the prompt, then decode ``FED`` through the KV cache: (the argmax after each
    step, each step's logits)."""
    cfg = model.cfg
    cache = KVCache(cfg.num_layers, 1, cfg.num_kv_heads, 64, cfg.head_dim, torch.float32, "cpu")
    logits = [model(torch.tensor([PROMPT]), Prefill.pack([len(PROMPT)], [0], "cpu"), cache, last_only=True)[0]]
    for t, token in enumerate(FED):
        pos = torch.tensor([[len(PROMPT) + t]])
        logits.append(model(torch.tensor([[token]]), Decode.at(pos, torch.tensor([0])), cache, last_only=True)[0])
    logits = torch.stack(logits)
    return logits.argmax(-1).tolist(), logits


def _rank(rank, size, ckpt, rendezvous, out):
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=size)
    try:
        model = _build(ckpt, TensorParallel(rank, size))
        result = _next_tokens(model)
        torch.save(result, out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("size", [2, 4])
def test_tensor_parallel_ranks_pick_the_whole_models_tokens(tmp_path, size):
    # 4 heads, 2 KV heads (replicated at 4 ranks); o and down split into whole groups of 32 at 4
    ckpt = tiny_hf_checkpoint(tmp_path, hidden_size=128, intermediate_size=128)
    want_tokens, want_logits = _next_tokens(_build(ckpt, None))
    mp.spawn(_rank, args=(size, ckpt, tmp_path / "rendezvous", tmp_path), nprocs=size, join=True)
    for rank in range(size):
        tokens, logits = torch.load(tmp_path / f"rank{rank}.pt")
        assert tokens == want_tokens, rank
        assert torch.allclose(logits, want_logits, atol=1e-4, rtol=1e-4), (logits - want_logits).abs().max()
    assert (want_logits.diff(dim=0).abs().amax(-1) > 100 * 1e-4).all()  # (every step's logits move: a real check)
