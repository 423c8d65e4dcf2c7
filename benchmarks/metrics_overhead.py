"""What the per-kernel metrics cost: decode tokens/s with them off and on (the server's
defaults: every call counted, one graph replay in ``--kernel-timing-every`` run as the
graph's timed twin, the persistent step's stages stamped), on one model, alternating.

Llama-3-8B-shaped int4 g128 (random weights), CUDA graphs, batch 1 (the persistent step) and
16 (a kernel per op). Two engines share the model: one captured its graphs with the metrics
off, one with them on (observed through the service's ``Metrics``, Prometheus registry
included); each round times both, in alternating order, each figure the median of 3
``decode_tps`` runs (``engine.py``). The result: the medians over the rounds, their ratio.

    python benchmarks/metrics_overhead.py --rounds 8 --out docs/bench
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_bandwidth, gpu_info, markdown_table, save_results  # noqa: E402
from engine import CONTEXT, PROMPT, configs, median_decode_tps, random_state  # noqa: E402

from woq.engine.engine import Engine  # noqa: E402
from woq.engine.sampling import SamplingParams  # noqa: E402
from woq.kernels.observe import KernelTiming  # noqa: E402
from woq.models.builder import build_model  # noqa: E402
from woq.models.quant_config import QuantConfig  # noqa: E402
from woq.service.config import ServeSettings  # noqa: E402
from woq.service.metrics import Metrics  # noqa: E402

BATCHES = (1, 16)


def run(rounds: int) -> dict:
    bandwidth = copy_bandwidth()
    config = configs()["llama3-8b"]
    state = random_state(config)
    model = build_model(config, state, QuantConfig("int4", 128), torch.float16, "cuda", CONTEXT, progress=False)
    del state
    torch.cuda.empty_cache()
    kw = dict(max_num_seqs=max(BATCHES), max_queue=4096, max_seq_len=CONTEXT, max_prefill_tokens=2048)
    off = Engine(model, None, set(), **kw).start()
    metrics = Metrics()
    every = ServeSettings.model_fields["kernel_timing_every"].default
    timing = KernelTiming(metrics, every)
    metrics.bind_timing(timing, bandwidth)
    model.observe_kernels(timing)  # (before the engine: its graphs record their calls and get timed twins)
    on = Engine(model, None, set(), observer=metrics, **kw).start()
    for engine in (off, on):  # warm-up
        engine.generate(list(range(PROMPT)), SamplingParams(max_tokens=8, ignore_eos=True))
    tps: dict[str, list[float]] = {}
    for r in range(rounds):
        for name, engine in (("off", off), ("on", on))[:: 1 if r % 2 == 0 else -1]:
            model.observe_kernels(timing if name == "on" else None)  # (the eager prefills too)
            for b in BATCHES:
                tps.setdefault(f"{name}_b{b}", []).append(median_decode_tps(engine, config.vocab_size, b).steady_tps)
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in tps.items()), flush=True)
    off.shutdown()
    on.shutdown()
    timing.drain(wait=True)
    rows = {b: {"off": statistics.median(tps[f"off_b{b}"]), "on": statistics.median(tps[f"on_b{b}"])} for b in BATCHES}
    for row in rows.values():
        row["ratio"] = row["on"] / row["off"]
    return dict(gpu_info(), model="llama3-8b int4 g128", kernel_timing_every=every, rounds=rounds, tps=tps,
                batches={str(b): v for b, v in rows.items()})


def summary(result: dict) -> str:
    table = [[b, f"{r['off']:.1f}", f"{r['on']:.1f}", f"{100 * (r['ratio'] - 1):+.2f} %"]
             for b, r in result["batches"].items()]
    return (f"GPU: {result['gpu']}, torch {result['torch']}. {result['model']} (random weights), CUDA graphs; decode "
            f"tok/s with the kernel metrics off and on (one graph replay in {result['kernel_timing_every']} timed), "
            f"medians of {result['rounds']} alternating rounds (each round's figures in the JSON).\n\n"
            + markdown_table(["batch", "metrics off", "metrics on", "on / off - 1"], table)
            + "\n\n`python benchmarks/metrics_overhead.py --rounds " + str(result["rounds"]) + "`\n")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(result["batches"]), figsize=(4 * len(result["batches"]), 3))
    for ax, b in zip(axes, result["batches"]):
        for name, color in (("off", "tab:gray"), ("on", "tab:blue")):
            v = result["tps"][f"{name}_b{b}"]
            ax.plot(range(len(v)), v, "o-", color=color, label=f"metrics {name}")
        ax.set_title(f"batch {b}")
        ax.set_xlabel("round")
        ax.set_ylabel("decode tok/s")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"kernel metrics' cost, {result['model']}, {result['gpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--out", type=Path, default=Path("docs/bench"))
    a = p.parse_args()
    save_results(a.out, "metrics_overhead", run(a.rounds), summary, plot)


if __name__ == "__main__":
    main()
