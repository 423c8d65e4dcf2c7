"""What per-request sampling features cost per decoded token: decode tokens/s of an engine
with every request plain greedy, and with every request asking for one feature.

Llama-3-8B-shaped int4 g128 (random weights; the Llama-3 tokenizer from ``--tokenizer``),
CUDA graphs, batch 1 and 16, PROMPT + NEW tokens (``engine.py``): greedy; temperature
sampling; top-5 log-probabilities; presence + frequency + repetition penalties and a logit
bias; a grammar (a regex, and a JSON schema, that a random model can follow for NEW tokens:
the mask is filled on the host each step, and the step is not decoded ahead). Alternating rounds, medians.

    python benchmarks/sampling_cost.py --tokenizer .tok --out docs/bench
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import gpu_info, markdown_table, save_results  # noqa: E402
from engine import CONTEXT, NEW, configs, median_decode_tps, random_state  # noqa: E402

from woq.engine.engine import Engine  # noqa: E402
from woq.engine.grammar import json_schema_grammar, regex_grammar  # noqa: E402
from woq.engine.sampling import SamplingParams  # noqa: E402
from woq.models.builder import build_model  # noqa: E402
from woq.models.quant_config import QuantConfig  # noqa: E402

BATCHES = (1, 16)
# an object whose one string must be longer than NEW tokens can write: a random model follows
# the mask for all NEW tokens without the grammar ending the request
LONG_JSON = {"type": "object", "properties": {"text": {"type": "string", "minLength": 4000}}, "required": ["text"]}
BASE = dict(max_tokens=NEW, ignore_eos=True)
FEATURES = {
    "greedy": SamplingParams(temperature=0, **BASE),
    "temperature 0.8, top-p 0.9": SamplingParams(temperature=0.8, top_p=0.9, seed=1, **BASE),
    "greedy + top-5 logprobs": SamplingParams(temperature=0, logprobs=5, **BASE),
    "greedy + penalties + logit bias": SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.5,
                                                      repetition_penalty=1.1, logit_bias=((13, 2.0), (42, -5.0)),
                                                      **BASE),
    "greedy + grammar (regex)": SamplingParams(temperature=0, grammar=regex_grammar(r"[a-z ]+"), **BASE),
    "greedy + JSON schema": SamplingParams(temperature=0, grammar=json_schema_grammar(LONG_JSON), **BASE),
}


def run(tokenizer_dir: Path, rounds: int) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = configs()["llama3-8b"]
    state = random_state(config)
    model = build_model(config, state, QuantConfig("int4", 128), torch.float16, "cuda", CONTEXT, progress=False)
    del state
    torch.cuda.empty_cache()
    engine = Engine(model, tokenizer, {tokenizer.eos_token_id}, max_num_seqs=max(BATCHES), max_queue=64,
                    max_seq_len=CONTEXT, max_prefill_tokens=2048).start()
    for params in FEATURES.values():  # warm-up (the grammar's tokenizer is built on its first use)
        engine.generate(list(range(100, 228)), replace(params, max_tokens=4))
    tps: dict[str, list[float]] = {}
    for r in range(rounds):
        for name, params in list(FEATURES.items())[:: 1 if r % 2 == 0 else -1]:
            for b in BATCHES:
                tps.setdefault(f"{name}|{b}", []).append(
                    median_decode_tps(engine, config.vocab_size, b, params=params).steady_tps)
        print(f"round {r} done", flush=True)
    engine.shutdown()
    rows = {name: {str(b): statistics.median(tps[f"{name}|{b}"]) for b in BATCHES} for name in FEATURES}
    return dict(gpu_info(), model="llama3-8b int4 g128", rounds=rounds, tps=tps, features=rows)


def summary(result: dict) -> str:
    base = result["features"]["greedy"]
    table = []
    for name, row in result["features"].items():
        cells = [name]
        for b in map(str, BATCHES):
            us = 1e6 * (1 / row[b] - 1 / base[b]) * int(b)  # extra µs per step
            cells += [f"{row[b]:.1f}", f"{row[b] / base[b]:.3f}", f"{us:+.0f}"]
        table.append(cells)
    head = ["feature (every request)"]
    for b in BATCHES:
        head += [f"b{b} tok/s", f"b{b} vs greedy", f"b{b} µs / step"]
    return (f"GPU: {result['gpu']}, torch {result['torch']}. {result['model']} (random weights), CUDA graphs; "
            f"steady decode tok/s, medians of {result['rounds']} alternating rounds (3 runs each); µs / step: "
            f"the extra time per decode step against greedy.\n\n" + markdown_table(head, table)
            + "\n\n`python benchmarks/sampling_cost.py --tokenizer <Llama-3 tokenizer dir>`\n")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["features"])
    fig, axes = plt.subplots(1, len(BATCHES), figsize=(5 * len(BATCHES), 3.2))
    for ax, b in zip(axes, map(str, BATCHES)):
        base = result["features"]["greedy"][b]
        ax.barh(range(len(names)), [result["features"][n][b] / base for n in names], color="tab:blue")
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.invert_yaxis()
        ax.axvline(1.0, color="gray", lw=0.8)
        ax.set_xlabel("decode tok/s vs greedy")
        ax.set_title(f"batch {b}", fontsize=9)
    fig.suptitle(f"sampling features' cost, {result['model']}, {result['gpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", type=Path, required=True, help="a Llama-3 tokenizer's files")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("docs/bench"))
    a = p.parse_args()
    save_results(a.out, "sampling_cost", run(a.tokenizer, a.rounds), summary, plot)


if __name__ == "__main__":
    main()
