"""A GEMV's time in the decode step against its time in the kernel benchmark's chain.

The live roofline gauges (``woq_kernel_roofline_ratio``) time a GEMV inside the step by its
blocks' ``%globaltimer`` stamps: from its wait for the previous kernel to its last block's
end. Under programmatic launches its first weight stages stream in before that wait, during
the kernel before it, so what a layer kind reads in place depends on its neighbours. This
benchmark shows it: Llama-3-8B-shaped int4 g128 (random weights), fp16, CUDA graphs, the
kernel-per-op step at batch 2 and 4; every GEMV of the step's timed twin stamped
(``KernelTiming(stamped_layers=all)``), medians over timed replays, per layer kind: the first
decoder layer, the median of the others, and the same layers called in a chain of their own
kind (``graph_time_us`` over the model's 32 weights of that kind: rotated past L2, as the
kernel benchmark calls them). The gauge reports the second layer's call.

    python benchmarks/gemv_in_place.py --out docs/bench
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_bandwidth, gpu_info, markdown_table, save_results  # noqa: E402
from engine import CONTEXT, configs, decode_tps, random_state  # noqa: E402

from woq.engine.engine import Engine  # noqa: E402
from woq.kernels.observe import KernelTiming  # noqa: E402
from woq.kernels.plans import GEMV, Epilogue  # noqa: E402
from woq.kernels.timing import graph_time_us  # noqa: E402
from woq.models.builder import QuantConfig, build_model  # noqa: E402

BATCHES = (2, 4)
KINDS = ("qkv", "o", "gate_up", "down")


class _Steps:
    """A kernel observer that keeps only the timed steps (the twins' stamps are read directly)."""

    def __init__(self):
        self.steps: list[tuple[int, float]] = []

    def count(self, call, calls):
        pass

    def time(self, call, seconds):
        pass

    def record_step(self, batch, seconds, weight_bytes):
        self.steps.append((batch, seconds))


def _layer_linears(model, kind: str) -> list:
    return [layer.attn.qkv if kind == "qkv" else layer.attn.o if kind == "o" else getattr(layer.mlp, kind)
            for layer in model.layers]


def run(replays: int) -> dict:
    bandwidth = copy_bandwidth()
    config = configs()["llama3-8b"]
    state = random_state(config)
    model = build_model(config, state, QuantConfig("int4", 128), torch.float16, "cuda", CONTEXT, progress=False)
    del state
    torch.cuda.empty_cache()
    layers = config.num_hidden_layers
    steps = _Steps()
    timing = KernelTiming(steps, 1, stamped_layers=layers)
    model.observe_kernels(timing)
    engine = Engine(model, None, set(), max_num_seqs=max(BATCHES), max_queue=64, max_seq_len=CONTEXT,
                    max_prefill_tokens=2048).start()
    result = dict(gpu_info(), model="llama3-8b int4 g128", bandwidth=bandwidth, batches={})
    for b in BATCHES:
        per_layer: dict[str, list[list[float]]] = {k: [[] for _ in range(layers)] for k in KINDS}
        steps.steps.clear()
        for _ in range(replays):
            decode_tps(engine, config.vocab_size, b)
            timing.drain(wait=True)
            for twin in timing.captured:
                calls = twin.gemv.every_call() if twin.gemv is not None else []
                if not calls or calls[0][0].m != b:
                    continue
                seen: dict[str, int] = {}
                for call, seconds in calls:
                    i = seen.get(call.layer, 0)
                    seen[call.layer] = i + 1
                    per_layer[call.layer][i].append(seconds)
        model.observe_kernels(None)
        x = torch.randn(b, config.hidden_size, device="cuda", dtype=torch.float16)
        xi = torch.randn(b, config.intermediate_size, device="cuda", dtype=torch.float16)
        rows = {}
        for kind in KINDS:
            linears = _layer_linears(model, kind)
            inp = xi if kind == "down" else x
            epilogue = Epilogue.SWIGLU if kind == "gate_up" else Epilogue.NONE
            chain = graph_time_us([lambda lin=lin: lin(inp, epilogue) for lin in linears], calls=2 * layers)
            in_place = [statistics.median(s) * 1e6 for s in per_layer[kind] if s]
            rows[kind] = dict(n=linears[0].out_features, k=linears[0].in_features, chain_us=chain,
                              first_us=in_place[0], second_us=in_place[1], others_us=statistics.median(in_place[1:]),
                              per_layer_us=in_place)
        model.observe_kernels(timing)
        step = [s * 1e6 for bb, s in steps.steps if bb == b]
        result["batches"][str(b)] = dict(kinds=rows, step_us=statistics.median(step) if step else None,
                                         path=GEMV, timed_replays=len(step))
    engine.shutdown()
    return result


def summary(result: dict) -> str:
    out = [f"GPU: {result['gpu']}, torch {result['torch']}. {result['model']} (random weights), fp16, CUDA graphs, "
           f"the kernel-per-op decode step. In place: each GEMV's block stamps in the step's timed twin (median over "
           f"timed replays; layer 0, and the median of layers 1-31). Chain: the same 32 layers' calls of one kind in "
           f"a CUDA graph of their own (programmatic launches, weights rotated past L2), µs per call.\n"]
    for b, r in result["batches"].items():
        table, sums = [], [0.0, 0.0]
        for kind, k in r["kinds"].items():
            table.append([kind, f"{k['n']}x{k['k']}", f"{k['chain_us']:.1f}", f"{k['first_us']:.1f}",
                          f"{k['others_us']:.1f}", f"{k['others_us'] / k['chain_us']:.2f}"])
            sums[0] += k["chain_us"]
            sums[1] += k["others_us"]
        table.append(["a layer's four", "", f"{sums[0]:.1f}", "", f"{sums[1]:.1f}", f"{sums[1] / sums[0]:.2f}"])
        out.append(f"\n**Batch {b}** (step {r['step_us']:.0f} µs median, {r['timed_replays']} timed replays)\n\n"
                   + markdown_table(["layer kind", "N x K", "chain µs", "in place, layer 0 µs",
                                     "in place, layers 1-31 µs", "in place / chain"], table))
    return "\n".join(out) + "\n\n`python benchmarks/gemv_in_place.py`\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(result["batches"]), figsize=(5 * len(result["batches"]), 3.2))
    for ax, (b, r) in zip(axes, result["batches"].items()):
        for kind, k in r["kinds"].items():
            line, = ax.plot(range(len(k["per_layer_us"])), k["per_layer_us"], "o-", ms=3, label=kind)
            ax.axhline(k["chain_us"], color=line.get_color(), ls="--", lw=0.8)
        ax.set_title(f"batch {b}: in place (dots) vs chain (dashed)", fontsize=9)
        ax.set_xlabel("decoder layer")
        ax.set_ylabel("µs per call")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"GEMV time in the decode step, {result['model']}, {result['gpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replays", type=int, default=3, help="decode runs per batch (each times every replay)")
    p.add_argument("--out", type=Path, default=Path("docs/bench"))
    a = p.parse_args()
    save_results(a.out, "gemv_in_place", run(a.replays), summary, plot)


if __name__ == "__main__":
    main()
