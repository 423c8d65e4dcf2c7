"""Tensor parallelism on the CPU: a tiny int4 Llama split over 2 and 4 processes (gloo),
its heads evenly or not (SmolLM2's 9 query and 3 KV heads), picks the whole model's next
tokens, with logits within fp32 rounding of its own (the all-reduce sums the row-parallel
partial products in another order), each rank holding its share of the vocabulary's
embedding and LM head rows (dense or int4), and picking greedy tokens from the ranks' best
(value, index) pairs without gathering the logits."""
import multiprocessing
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from woq.models.batches import Decode, Prefill
from woq.models.builder import build_model
from woq.models.kv_cache import KVCache
from woq.models.quant_config import QuantConfig
from woq.models.sharding import TensorParallel

from conftest import tiny_hf_checkpoint

# The ranks fork from a server process that has imported this module, transformers and the
# loaders once, where a spawned rank would import them all again (docs/design/ci.md has the
# times). Forking this process instead could hang a rank in the OpenMP pool that torch has
# started here.
multiprocessing.set_forkserver_preload([__name__, "transformers.models.llama", "woq.models.checkpoint",
                                        "woq.models.importers", "woq.models.loader", "safetensors.torch"])

PROMPT = [5, 17, 301, 44, 9, 120, 77]
FED = [3, 250, 66, 410, 8, 199, 31, 500, 12, 77, 140]  # decode inputs (varied contexts, unlike a greedy loop's)


def _build(ckpt, tp, quantize_lm_head=False, lazy=False):
    """The model (``tp``: a rank's shard) and the checkpoint bytes read to build it: from the
    file's tensors read up front, or (``lazy``) as the builder takes them, a rank reading
    only its share of each; a woq or GPTQ/AWQ checkpoint (already quantized) or a GGUF file
    always lazily."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from woq.kernels.options import default_cache_dir
    from woq.models.checkpoint import is_woq_checkpoint, read_checkpoint
    from woq.models.importers import import_quantized, quantization_config
    from woq.models.loader import read_checkpoint as read_source
    from woq.models.loader import read_safetensors

    if ckpt.suffix == ".gguf":  # (its config and tokenizer kept in the cache, as a server's are)
        config, _, state, quantized = read_source(ckpt.parent, ckpt.name, default_cache_dir())
    else:
        config, quantized = AutoConfig.from_pretrained(ckpt), {}
        if is_woq_checkpoint(ckpt):
            state, quantized, _ = read_checkpoint(ckpt)
        elif (qc := quantization_config(ckpt, config)) is not None:
            state = read_safetensors(ckpt)
            quantized = import_quantized(state, qc, config)
        else:
            state = read_safetensors(ckpt) if lazy else load_file(str(ckpt / "model.safetensors"))
    model = build_model(config, state,
                        QuantConfig("int4", 32, quantize_lm_head=quantize_lm_head), torch.float32, "cpu", 64,
                        progress=False, prequantized=quantized, tp=tp)
    return model, state.bytes_read if lazy else None


@torch.inference_mode()
def _next_tokens(model, greedy: bool = False) -> tuple[list[int], torch.Tensor | None]:
    """Prefill the prompt, then decode ``FED`` through the KV cache: (the argmax after each
    step, each step's logits); with ``greedy``, the model's own argmax (no logits)."""
    cfg = model.cfg
    cache = KVCache(cfg.num_layers, 1, cfg.num_kv_heads, 64, cfg.head_dim, torch.float32, "cpu")
    out = [model(torch.tensor([PROMPT]), Prefill.pack([len(PROMPT)], [0], "cpu"), cache, last_only=True,
                 greedy=greedy)[0]]
    for t, token in enumerate(FED):
        pos = torch.tensor([[len(PROMPT) + t]])
        out.append(model(torch.tensor([[token]]), Decode.at(pos, torch.tensor([0])), cache, last_only=True,
                         greedy=greedy)[0])
    if greedy:
        return [int(t) for t in out], None
    logits = torch.stack(out)
    return logits.argmax(-1).tolist(), logits


def _rank(rank, size, ckpt, rendezvous, out, quantize_lm_head, lazy):
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=size)
    try:
        model, read = _build(ckpt, TensorParallel(rank, size), quantize_lm_head, lazy)
        rows = (model.embed.weight.shape[0], model.lm_head.out_features)
        tokens, logits = _next_tokens(model)
        torch.save((tokens, logits, rows, read, _next_tokens(model, greedy=True)[0]), out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _check_ranks(tmp_path, ckpt, size, quantize_lm_head, lazy, read_share):
    """Spawn ``size`` gloo ranks of ``ckpt``: each picks the whole model's tokens (its own
    greedy ones too), with logits within fp32 rounding of its own, holding its share of the
    vocabulary; lazily, a rank reads less than ``read_share`` of the whole model's bytes."""
    whole, whole_read = _build(ckpt, None, quantize_lm_head, lazy=True)
    vocab = whole.cfg.vocab_size
    want_tokens, want_logits = _next_tokens(whole)
    mp.start_processes(_rank, args=(size, ckpt, tmp_path / "rendezvous", tmp_path, quantize_lm_head, lazy),
                       nprocs=size, join=True, start_method="forkserver")
    for rank in range(size):
        tokens, logits, rows, read, greedy = torch.load(tmp_path / f"rank{rank}.pt")
        assert rows == (vocab // size, vocab // size)
        assert greedy == want_tokens  # (each rank's best gathered, not the logits)
        if lazy:
            assert read < whole_read * read_share, (rank, read, whole_read)
        assert tokens == want_tokens, rank
        assert torch.allclose(logits, want_logits, atol=1e-4, rtol=1e-4), (logits - want_logits).abs().max()
    assert (want_logits.diff(dim=0).abs().amax(-1) > 100 * 1e-4).all()  # (every step's logits move: a real check)


@pytest.mark.parametrize("size,quantize_lm_head,lazy,tied",
                         [(2, False, False, False), (4, False, True, False), (2, True, True, False),
                          (2, False, True, True)])
def test_tensor_parallel_ranks_pick_the_whole_models_tokens(tmp_path, size, quantize_lm_head, lazy, tied):
    # 4 heads, 2 KV heads (replicated at 4 ranks); o and down split into whole groups of 32 at 4;
    # a tied LM head is made of the rank's embedding rows
    ckpt = tiny_hf_checkpoint(tmp_path, hidden_size=128, intermediate_size=128, tie_word_embeddings=tied)
    # (a rank reads its share: 1/size of the weights, but the norms and the replicated KV heads)
    _check_ranks(tmp_path, ckpt, size, quantize_lm_head, lazy, 1 / size + 0.1)


@pytest.mark.parametrize("size,lazy,read_share", [(2, True, 0.6), (4, True, 0.35), (4, False, None)])
def test_tensor_parallel_splits_uneven_heads(tmp_path, size, lazy, read_share):
    """SmolLM2's heads (9 query, 3 KV: head_dim 16 here) and tied embeddings. At 2 ranks,
    rank 0 computes KV heads 0-1 and query heads 0-5, rank 1 the rest; at 4, the ranks hold
    KV heads 0, 0, 1, 2 and query heads 0-1, 2, 3-5, 6-8, so that o's input columns (16 a
    head) cut groups of 32 (ranks 1 and 2), as down's do (48 of 192 rows a rank): those
    shards pad the cut groups. Lazily, a rank reads its rows and the groups its columns
    touch (rank 0 of 2 the most: 2 of 3 KV heads)."""
    ckpt = tiny_hf_checkpoint(tmp_path, hidden_size=144, num_attention_heads=9, num_key_value_heads=3,
                              intermediate_size=192, tie_word_embeddings=True)
    _check_ranks(tmp_path, ckpt, size, False, lazy, read_share)


def _complete_all(url: str, prompts: list[list[int]], lengths: list[int], pair: bool = True) -> list[str]:
    """Completions of ``prompts`` (token ids) sent at once, each ``lengths[i]`` tokens long:
    greedy, but with ``pair`` the first request's two seeded samples (``n`` = 2: the second
    choice starts from a copy of the prompt's last, partly filled block)."""
    import httpx
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> str:
        body = {"model": "tiny", "prompt": prompts[i], "max_tokens": lengths[i], "temperature": 0, "ignore_eos": True}
        if pair and i == 0:
            body |= {"n": 2, "temperature": 0.8, "seed": 7}
        r = httpx.post(url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == lengths[i] * len(r.json()["choices"])
        return " | ".join(c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"]))

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))


def _greedy_logprobs(url: str, prompts: list[list[int]], lengths: list[int]) -> list[dict]:
    """Greedy completions of ``prompts`` sent at once, each step's token, its log-probability
    and its margin over the runner-up (0 where the two decode to one string: the API keys
    its top log-probabilities by text)."""
    import httpx
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> dict:
        body = {"model": "tiny", "prompt": prompts[i], "max_tokens": lengths[i], "temperature": 0,
                "ignore_eos": True, "logprobs": 2}
        r = httpx.post(url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == lengths[i]
        margins = [chosen - max((v for t, v in top.items() if t != token), default=chosen)
                   for token, chosen, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])]
        return {"tokens": lp["tokens"], "logprobs": lp["token_logprobs"], "margins": margins}

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))


def _assert_same_greedy(ref: list[dict], got: list[dict], tol: float, what: str) -> None:
    """``got``'s greedy tokens are ``ref``'s, their log-probabilities within ``tol``, up to a
    step where ``ref``'s two best were within ``2 tol`` of each other: there another valid
    rounding may pick the other one, and the rest of that completion follows from it."""
    for i, (a, b) in enumerate(zip(ref, got)):
        for step, (ta, tb) in enumerate(zip(a["tokens"], b["tokens"])):
            if ta != tb:
                assert a["margins"][step] <= 2 * tol, f"{what}: prompt {i} step {step}: {tb!r} for {ta!r}, " \
                                                      f"whose margin was {a['margins'][step]:.4f}"
                break
            assert abs(a["logprobs"][step] - b["logprobs"][step]) <= tol, f"{what}: prompt {i} step {step}"


def _servable(tmp_path, smollm2_dir, **config):
    """A tiny random checkpoint of ``config`` with SmolLM2's tokenizer files, for ``woq serve``."""
    import shutil

    ckpt = tiny_hf_checkpoint(tmp_path, **config)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / f, ckpt / f)
    return ckpt


def test_serve_tensor_parallel_gives_the_single_process_completions(tmp_path, smollm2_dir):
    """``woq serve --tensor-parallel-size 2`` (rank 0 serving HTTP and starting rank 1, gloo)
    completes requests that join and leave the batch at different steps -- prefill mixed
    with decode, two choices of one prompt (a block copy), the ranks following every step
    -- with the completions of one process. Both servers pace prompt chunks
    (``--mixed-step-ratio``): rank 0 times its steps at start-up through calls that it
    announces and rank 1 follows."""
    from conftest import LiveServer

    ckpt = _servable(tmp_path, smollm2_dir, hidden_size=128, intermediate_size=128)
    prompts = [PROMPT, FED, PROMPT[::-1] + FED[:3]]
    lengths = [32, 9, 20]
    args = ["--model", str(ckpt), "--served-model-name", "tiny", "--quant", "int4", "--group-size", "32",
            "--max-seq-len", "64", "--dtype", "float32", "--cache", str(tmp_path / "cache"),
            "--mixed-step-ratio", "1"]
    texts = {}
    for size in (1, 2):
        server = LiveServer(*args, "--tensor-parallel-size", str(size))
        try:
            texts[size] = _complete_all(server.url, prompts, lengths)
            # (greedy only: the TP decode steps take each rank's best token, no logits gathered)
            texts[size] += _complete_all(server.url, prompts, lengths, pair=False)
            if size == 2:
                assert "rank 1 of 2 joined (gloo)" in server.output()
        finally:
            server.stop()
        if size == 2:
            assert server.proc.returncode == 0 or server.proc.returncode == -15  # (SIGTERM: drained, ranks stopped)
    assert texts[2] == texts[1] and all(texts[1])


def test_serve_ends_when_a_rank_dies(tmp_path, smollm2_dir):
    """A rank that dies while serving (killed here) ends rank 0 with one error line and a
    failure status, within seconds, rather than leaving it to wait for the rank in its next
    collective: a supervisor then restarts the server whole."""
    import os
    import signal
    from pathlib import Path

    from conftest import LiveServer

    def children(pid: int) -> list[int]:  # (the ranks rank 0 started: copies of its command)
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                if stat.read_text().rsplit(")", 1)[1].split()[1] == str(pid) and \
                        b"serve" in (stat.parent / "cmdline").read_bytes():
                    found.append(int(stat.parent.name))
            except OSError:
                pass
        return found

    ckpt = _servable(tmp_path, smollm2_dir, hidden_size=128, intermediate_size=128)
    server = LiveServer("--model", str(ckpt), "--served-model-name", "tiny", "--quant", "int4", "--group-size", "32",
                        "--max-seq-len", "64", "--dtype", "float32", "--cache", str(tmp_path / "cache"),
                        "--tensor-parallel-size", "2")
    try:
        assert _complete_all(server.url, [PROMPT], [4], pair=False)[0]
        (child,) = children(server.proc.pid)
        os.kill(child, signal.SIGKILL)
        status = server.proc.wait(30)
        assert status != 0
        assert "tensor-parallel rank 1 exited" in server.output()
    finally:
        server.stop()


def test_serve_refuses_a_split_the_model_cannot_take(tmp_path, smollm2_dir):
    """2 query heads, one a KV head, over 3 ranks (two of which would share a query head):
    one line naming the problem, exit status 2, refused before any rank joined a group
    (``models/sharding.check_split``), and no process of the command left."""
    import subprocess
    import sys

    from pathlib import Path

    # (the vocabulary, 512, and the intermediate rows, 96, are left whole or split evenly: only the heads fail)
    ckpt = _servable(tmp_path, smollm2_dir, hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
                     intermediate_size=96)
    out = subprocess.run([sys.executable, "-m", "woq", "serve", "--model", str(ckpt), "--quant", "int4", "--port", "0",
                          "--tensor-parallel-size", "3", "--cache", str(tmp_path / "cache")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("woq: error:")]
    assert errors and all("head" in line for line in errors), out.stderr
    assert "Traceback" not in out.stderr
    assert "tensor-parallel rank" not in out.stderr  # (the ranks' "joined" lines: none started)

    def ranks_left() -> list[str]:  # (any process still running this command, orphaned or not)
        found = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                if str(ckpt).encode() in cmdline.read_bytes():
                    found.append(cmdline.parent.name)
            except OSError:
                pass
        return found

    for _ in range(50):
        if not ranks_left():
            break
        time.sleep(0.1)
    assert not ranks_left()


@pytest.mark.parametrize("size,heads,kv_heads,read_share,biases", [(2, 4, 2, 0.6, True), (4, 9, 3, 0.35, False)])
def test_tensor_parallel_ranks_read_their_share_of_a_woq_checkpoint(tmp_path, smollm2_dir, size, heads, kv_heads,
                                                                     read_share, biases):
    """From a woq checkpoint (quantized before: ``woq quantize``, or the quantized-model
    cache) a rank reads only its share of each quantized layer -- its rows of qkv and
    gate/up, its columns of o and down (whole groups, cut where its heads cut one: 9 heads
    over 4 ranks) -- and the model's tokens are the whole model's; with biases, a rank
    keeps its rows' and rank 0 alone o's and down's (the all-reduce adds them once)."""
    from transformers import AutoConfig, AutoTokenizer

    from woq.models.checkpoint import save_checkpoint

    dense = tiny_hf_checkpoint(tmp_path, hidden_size=16 * heads, num_attention_heads=heads,
                               num_key_value_heads=kv_heads, intermediate_size=192, tie_word_embeddings=True,
                               attention_bias=biases, mlp_bias=biases)
    if biases:  # (initialized to zeros: make them count)
        from safetensors.torch import load_file, save_file

        state = load_file(str(dense / "model.safetensors"))
        g = torch.Generator().manual_seed(1)
        state = {k: torch.randn(v.shape, generator=g) * 0.3 if k.endswith(".bias") else v for k, v in state.items()}
        save_file(state, str(dense / "model.safetensors"), metadata={"format": "pt"})
    whole, _ = _build(dense, None)
    ckpt = save_checkpoint(whole, AutoConfig.from_pretrained(dense), AutoTokenizer.from_pretrained(smollm2_dir),
                           tmp_path / "woq", "tiny", {"method": "rtn"})
    _check_ranks(tmp_path, ckpt, size, False, True, read_share)


def test_tensor_parallel_ranks_read_their_share_of_a_gguf_file(tmp_path):
    """From a GGUF file -- the default model's: Q4_1 linears, a tied Q8_0 embedding, 9 query
    heads over 3 KV heads (split unevenly) -- two ranks pick the whole model's tokens, each
    reading only its rows and columns of the file's blocks (``GgufTensors``): under 0.6 of
    what the whole model reads."""
    from woq.models.fetch import fetch_default_gguf

    _check_ranks(tmp_path, fetch_default_gguf(), 2, False, True, 0.6)


@pytest.mark.parametrize("method,bits,act_order,size,read_share",
                         [("gptq", 4, False, 2, 0.6), ("gptq", 8, False, 2, 0.6), ("gptq", 4, True, 4, 0.45),
                          ("awq", 4, False, 2, 0.6)])
def test_tensor_parallel_ranks_read_their_share_of_a_gptq_or_awq_checkpoint(tmp_path, method, bits, act_order,
                                                                            size, read_share):
    """A GPTQ or AWQ checkpoint split over ranks: each reads its rows of q, k, v, gate and
    up (columns of GPTQ's codes, the packed words of AWQ's that hold them, and the zero
    points' words) and its columns of o and down (GPTQ's rows of codes, AWQ's, in whole
    groups), and picks the whole import's tokens. An act-order o or down is read whole:
    its groups hold permuted columns. Whole reads of every layer would exceed
    ``read_share``: 0.73 of the checkpoint at 2 ranks and 0.59 at 4 for int4, 0.81 at 2
    for int8. (Four ranks once: CI has two cores.)"""
    from safetensors.torch import load_file

    from quant_fixtures import awq_tensors, gptq_tensors, write_quantized_checkpoint
    from woq.kernels.format import QuantSpec, quantize

    dense = tiny_hf_checkpoint(tmp_path, hidden_size=128, intermediate_size=512)
    state = load_file(str(dense / "model.safetensors"))
    g = torch.Generator().manual_seed(bits)
    tensors, perms = {}, {}
    for name in [k[: -len(".weight")] for k in state if k.endswith("_proj.weight")]:
        W = state[name + ".weight"]
        qw = quantize(W, QuantSpec(bits, 32, False))
        perm = None
        if act_order:  # one input order per input: q/k/v share theirs, as gate/up do
            key = (name.split(".")[2], W.shape[1], "o_proj" in name or "down_proj" in name)
            perm = perms.setdefault(key, torch.randperm(W.shape[1], generator=g))
        tensors[name] = gptq_tensors(qw, perm=perm) if method == "gptq" else awq_tensors(qw)
    qconfig = {"quant_method": "gptq", "bits": bits, "group_size": 32, "sym": False, "desc_act": act_order} \
        if method == "gptq" else {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"}
    ckpt = write_quantized_checkpoint(dense, tmp_path / method, tensors, qconfig)
    _check_ranks(tmp_path, ckpt, size, False, True, read_share)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_serve_tensor_parallel_on_two_gpus(tmp_path, smollm2_dir):
    """The same over NCCL, one GPU a rank, fp16 (eager steps on both servers: the
    single-GPU server's graphs would round differently)."""
    from conftest import LiveServer

    ckpt = _servable(tmp_path, smollm2_dir, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                     num_key_value_heads=4)
    prompts, lengths = [PROMPT, FED, PROMPT[::-1] + FED[:3]], [32, 9, 20]
    args = ["--model", str(ckpt), "--served-model-name", "tiny", "--quant", "int4", "--group-size", "32",
            "--max-seq-len", "64", "--dtype", "float16", "--no-cuda-graphs", "--cache", str(tmp_path / "cache")]
    texts = {}
    for size in (1, 2):
        server = LiveServer(*args, "--tensor-parallel-size", str(size))
        try:
            texts[size] = _complete_all(server.url, prompts, lengths, pair=False)
            assert (size == 2) == ("rank 1 of 2 joined (nccl" in server.output())
        finally:
            server.stop()
    assert texts[2] == texts[1] and all(texts[1])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_serve_tensor_parallel_graphs_on_every_gpu(tmp_path, smollm2_dir):
    """With CUDA graphs (the default) on 2 and, where there are, 4 GPUs: every rank replays
    the decode and packed-prefill graphs rank 0 replays, look-ahead steps included, over the
    block-table entries rank 0 assigns, all-reducing through the peer buffers; a
    SmolLM2-shaped model (9 query heads over 3 KV heads: uneven splits) gives the greedy
    tokens of one GPU's graphs, requests joining and leaving the batch, and their
    log-probabilities within fp16 rounding. (A shard's partial sums are rounded before they
    are added, so a step whose two best tokens are within that rounding may pick the other
    one: ``_assert_same_greedy``.)"""
    from conftest import LiveServer

    ckpt = _servable(tmp_path, smollm2_dir, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                     num_key_value_heads=3)
    prompts, lengths = [PROMPT, FED, PROMPT[::-1] + FED[:3]], [32, 9, 20]
    # (few graphs to capture: 4 decode batch sizes, packed steps up to 128 tokens)
    args = ["--model", str(ckpt), "--served-model-name", "tiny", "--quant", "int4", "--max-seq-len", "256",
            "--max-num-seqs", "8", "--max-prefill-tokens", "128", "--dtype", "float16",
            "--cache", str(tmp_path / "cache")]
    texts = {}
    for size in [1, 2] + ([4] if torch.cuda.device_count() >= 4 else []):
        server = LiveServer(*args, "--tensor-parallel-size", str(size))
        try:
            texts[size] = [_greedy_logprobs(server.url, prompts, lengths) for _ in range(2)]
            if size > 1:
                assert f"rank 1 of {size} joined (nccl, peer all-reduce)" in server.output()
        finally:
            server.stop()
    # Round by round: the second round's prompts are prefix-cached, so its prefills take
    # other kernels (GEMVs over the uncached tail); every size meets the same cache state
    # in each round.
    for size in sorted(texts)[1:]:
        for r, got in enumerate(texts[size]):
            _assert_same_greedy(texts[1][r], got, 0.05, f"TP {size} round {r}")
