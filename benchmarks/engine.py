"""Offline engine benchmark on the GPU (no HTTP): decode and prefill throughput.

Random-weight models with real shapes (Llama-3-8B; SmolLM2-135M), fp16 / int8 / int4-g128,
each with the default runtime options (the engine's decode runner takes the persistent
batch-1 step where the model asks for it: ``engine/decode.py``): decode tokens/s at batch
1, 4, 16 and the maximum (greedy, 128 new tokens after a 128-token prompt, CUDA graphs;
median of 3 runs), prefill tokens/s of a 2048-token prompt (median of 3 after one
warm-up), and at batch 1 the fraction of the roofline (tokens/s x bytes read per token /
measured copy bandwidth). In the same run, HF transformers fp16 ``generate`` on the same
weights (eager dynamic cache, and static cache). (The per-kernel metrics' cost:
``metrics_overhead.py``.)

    python benchmarks/engine.py --out docs/bench [--models llama3-8b] [--batches 1,16]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_bandwidth, gpu_info, markdown_table, write_json  # noqa: E402

from woq.engine.engine import Engine  # noqa: E402
from woq.engine.sampling import SamplingParams  # noqa: E402
from woq.models.builder import build_model  # noqa: E402
from woq.models.quant_config import QuantConfig  # noqa: E402
from woq.models.quant_linear import DenseLinear, WeightOnlyLinear  # noqa: E402

PROMPT, NEW = 128, 128
HF_NEW = 32  # HF generate is slow (its static cache without torch.compile especially): fewer tokens
CONTEXT = 2048 + 64  # room for the 2048-token prefill measurement


def configs():
    from transformers import LlamaConfig

    llama8b = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
                          rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=False)
    smol = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
                       rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True)
    return {"llama3-8b": llama8b, "smollm2-135m": smol}


def random_state(config) -> dict[str, torch.Tensor]:
    """fp16 random weights on the GPU with the HF names and shapes of ``config``."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {}
    for k, shape in shapes.items():
        if k.endswith("norm.weight"):
            state[k] = torch.ones(shape, dtype=torch.float16, device="cuda")
        else:
            state[k] = torch.randn(shape, dtype=torch.float16, device="cuda", generator=g) * 0.02
    return state


def hf_decode_tps(config, state, cache: str) -> float:
    """HF transformers fp16 generate: decode tokens/s at batch 1 (prefill time subtracted)."""
    from transformers import AutoModelForCausalLM

    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    model.load_state_dict(state, assign=True, strict=False)  # share our tensors: no second copy
    if config.tie_word_embeddings:
        model.tie_weights()
    model.eval()
    ids = torch.randint(0, config.vocab_size, (1, PROMPT), device="cuda")
    kw = dict(do_sample=False, pad_token_id=0, cache_implementation=cache)

    def timed(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    # Warm-up at both lengths: with cache_implementation="static", transformers compiles the
    # forward for each cache length, and a compile inside a timed call made the difference
    # meaningless (0.5 tok/s for the 8B model).
    timed(HF_NEW), timed(1)
    t_all, t_one = timed(HF_NEW), timed(1)
    return (HF_NEW - 1) / (t_all - t_one)


def weight_bytes(model) -> int:
    total = 0
    for m in model.modules():
        if isinstance(m, WeightOnlyLinear):
            total += m.gpu.nbytes() if m.gpu is not None else m.qweight.nbytes()
        elif isinstance(m, DenseLinear):
            total += m.weight.numel() * m.weight.element_size()
    return total


@dataclass(frozen=True)
class DecodeRun:
    steady_tps: float  # all sequences' tokens/s while every one of them is decoding
    end_to_end_tps: float  # decode tokens over first token -> last token, later arrivals' prefills inside
    per_request_tps: float  # one request's decode tokens/s, averaged over the requests


def decode_tps(engine: Engine, vocab: int, batch: int, params: SamplingParams | None = None,
               prompt_tokens: int = PROMPT) -> DecodeRun:
    """Decode rates of ``batch`` requests of ``prompt_tokens`` tokens + NEW new tokens,
    submitted at once (``params``: greedy unless given)."""
    done = threading.Semaphore(0)
    times: list[list[float]] = [[] for _ in range(batch)]  # when each token of each request arrived

    def sink_for(i):
        def sink(ev):
            times[i].extend([time.perf_counter()] * len(ev.token_ids))
            if ev.finish_reason:
                done.release()
        return sink

    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(0, vocab, (prompt_tokens,), generator=g).tolist()
        engine.submit(prompt, params or SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True), sink_for(i))
    for _ in range(batch):
        done.acquire()
    firsts, lasts = [t[0] for t in times], [t[-1] for t in times]
    # steady: from the moment the last request has its first token (every prefill done)
    # until the first request ends, the tokens all requests received in between
    start, end = max(firsts), min(lasts)
    steady = sum(start < x <= end for t in times for x in t) / (end - start)
    end_to_end = sum(len(t) - 1 for t in times) / (max(lasts) - min(firsts))
    per_request = statistics.mean((len(t) - 1) / (t[-1] - t[0]) for t in times)
    return DecodeRun(steady, end_to_end, per_request)


def median_decode_tps(engine: Engine, vocab: int, batch: int, repeats: int = 3,
                      params: SamplingParams | None = None) -> DecodeRun:
    """``decode_tps`` of the run with the median steady rate among ``repeats``."""
    runs = sorted((decode_tps(engine, vocab, batch, params) for _ in range(repeats)), key=lambda r: r.steady_tps)
    return runs[repeats // 2]


def prefill_tps(engine: Engine, vocab: int, tokens: int = 2048, repeats: int = 3) -> float:
    """Median prompt tokens/s of ``tokens``-token prompts (after one of the same length:
    the first call at a new M picks cuBLAS algorithms and fills the allocator)."""
    rates = []
    for i in range(repeats + 1):
        prompt = torch.randint(0, vocab, (tokens,)).tolist()
        t0 = time.perf_counter()
        engine.generate(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        if i > 0:
            rates.append(tokens / (time.perf_counter() - t0))
    return statistics.median(rates)


def bytes_per_token(config, wbytes: int) -> float:
    """Bytes a batch-1 decode step reads, the roofline's numerator: the weights, and the fp16
    KV cache at the run's middle position (a PROMPT-token prompt, NEW new tokens)."""
    kv_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 2
    return wbytes + kv_bytes * (PROMPT + NEW / 2)


def run(models: list[str], batches: list[int], out: Path) -> dict:
    info = gpu_info()
    bw = copy_bandwidth()
    print(f"{info['gpu']}: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for name in models:
        config = configs()[name]
        state = random_state(config)
        hf = {c: hf_decode_tps(config, state, c) for c in ("dynamic", "static")}
        print(f"{name}: HF transformers fp16 decode tok/s at batch 1: {hf}", flush=True)
        torch.cuda.empty_cache()
        max_batch = max(batches)
        for fmt, quant in (("fp16", QuantConfig("none")), ("int8", QuantConfig("int8")),
                           ("int4-g128", QuantConfig("int4", 128))):
            model = build_model(config, dict(state), quant, torch.float16, "cuda", CONTEXT, progress=False)
            wbytes = weight_bytes(model)
            engine = Engine(model, None, set(), max_num_seqs=max_batch, max_queue=4096, max_seq_len=CONTEXT,
                            max_prefill_tokens=2048).start()
            engine.generate(list(range(PROMPT)), SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
            row = dict(model=name, format=fmt, weight_bytes=wbytes, hf_eager_tps=hf["dynamic"],
                       hf_static_tps=hf["static"])
            for b in batches:
                r = median_decode_tps(engine, config.vocab_size, b)
                row[f"decode_tps_b{b}"], row[f"end_to_end_tps_b{b}"] = r.steady_tps, r.end_to_end_tps
                row[f"per_request_tps_b{b}"] = r.per_request_tps
                print(f"  {name} {fmt} batch {b}: {r.steady_tps:.0f} tok/s steady, {r.end_to_end_tps:.0f} end to end",
                      flush=True)
            row["prefill_tps_2048"] = prefill_tps(engine, config.vocab_size)
            per_token = bytes_per_token(config, wbytes)
            row["roofline_tps_b1"] = bw / per_token
            row["pct_roofline_b1"] = 100 * row["decode_tps_b1"] / row["roofline_tps_b1"]
            row["vs_hf_eager_b1"] = row["decode_tps_b1"] / hf["dynamic"]
            engine.shutdown()
            rows.append(row)
            print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
            del model, engine
            gc.collect()
            torch.cuda.empty_cache()
        del state
        gc.collect()
        torch.cuda.empty_cache()
    result = dict(info, bandwidth_bytes_per_s=bw, prompt_tokens=PROMPT, new_tokens=NEW, batches=batches, rows=rows)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "engine.json", result)
    (out / "engine.md").write_text(summary(result))
    plot(result, out / "engine.png")
    return result


def summary(result: dict) -> str:
    bs = result["batches"]
    wide = [b for b in bs if b > 1]
    head = ["model", "format", "weights GB"] + [f"decode tok/s b{b}" for b in bs] + [f"b{b} / b1" for b in wide] + \
           [f"end to end b{b}" for b in wide] + ["% roofline b1", "× HF eager b1", "HF fp16 eager / static b1",
                                                 "prefill tok/s (2048)"]
    table = []
    for r in result["rows"]:
        table.append([r["model"], r["format"], r["weight_bytes"] / 1e9] + [r[f"decode_tps_b{b}"] for b in bs] +
                     [f"{r[f'decode_tps_b{b}'] / r['decode_tps_b1']:.1f}×" for b in wide] +
                     [r.get(f"end_to_end_tps_b{b}", "-") for b in wide] +
                     [r["pct_roofline_b1"], f"{r['vs_hf_eager_b1']:.1f}×", f"{r['hf_eager_tps']:.0f} / {r['hf_static_tps']:.0f}",
                      r["prefill_tps_2048"]])
    return (f"GPU: {result['gpu']}, torch {result['torch']}; copy bandwidth {result['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s. "
            f"Random weights, real shapes; greedy, {result['prompt_tokens']}-token prompts, {result['new_tokens']} new tokens "
            f"(ignore_eos), CUDA graphs, the batch's requests submitted at once (median of 3 runs). Decode tok/s = all "
            "sequences' tokens over the time they all decode together (after the last arrival's prefill, until the "
            "first one ends); end to end = their decode tokens from the first first token to the last token, "
            "the arrivals' prefills (packed, at most 2048 prompt tokens per forward) included. "
            f"Roofline b1 = bandwidth / (weight bytes + KV bytes read per token). HF: transformers fp16 generate, same weights.\n\n"
            + markdown_table(head, table) + "\n\nThe per-kernel metrics' cost: `metrics_overhead.md`.\n")


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models):
        for r in [r for r in result["rows"] if r["model"] == m]:
            ax.plot(result["batches"], [r[f"decode_tps_b{b}"] for b in result["batches"]], "o-", label=r["format"])
        hf = next(r for r in result["rows"] if r["model"] == m)
        ax.axhline(hf["hf_eager_tps"], color="gray", ls="--", label="HF fp16 eager (b1)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(m)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama3-8b,smollm2-135m")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--out", type=Path, default=Path("docs/bench"))
    a = ap.parse_args()
    res = run(a.models.split(","), [int(b) for b in a.batches.split(",")], a.out)
    print(summary(res))


if __name__ == "__main__":
    main()
