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
kernel benchmark calls them).

It also keeps what the live gauge would receive: the reported layer's call of each kind
at every timed replay (``--stamped-layers 3``: the third layer's, as the server reports;
with ``--paired`` timed as the server times it, between calls of the two layers before it
of its kind: ``kernels/observe.py``, ``BlockStampRows``), their median, mean and maximum, and
their bytes / time / copy bandwidth. The other options
set up the engine as a server runs it: the prompt length before decoding (the dashboard's
chat requests are 43 tokens), one timed replay in ``--sample-every`` (the server's
``--kernel-timing-every``, 8), sampling, the engine's batch slots, and weights loaded and
quantized from an HF directory as ``woq serve`` does.

    python benchmarks/gemv_in_place.py --out docs/bench
    python benchmarks/gemv_in_place.py --prompt 43 --sample-every 8 --stamped-layers 3 --paired \
        --temperature 0.7 --max-num-seqs 16 --model /tmp/llama3-8b --name gemv_in_place_server
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_bandwidth, gpu_info, markdown_table, save_results  # noqa: E402
from engine import CONTEXT, NEW, configs, decode_tps, random_state  # noqa: E402

from woq.engine.engine import Engine  # noqa: E402
from woq.engine.sampling import SamplingParams  # noqa: E402
from woq.kernels.observe import KernelTiming  # noqa: E402
from woq.kernels.plans import GEMV, Epilogue  # noqa: E402
from woq.kernels.timing import graph_time_us  # noqa: E402
from woq.models.builder import build_model  # noqa: E402
from woq.models.loader import load_model  # noqa: E402
from woq.models.quant_config import QuantConfig  # noqa: E402

BATCHES = (2, 4)
KINDS = ("qkv", "o", "gate_up", "down")


class _Steps:
    """A kernel observer that keeps the timed steps and the GEMV latencies the live gauge
    would receive (the reported layer's calls, every timed replay); the other layers' stamps
    are read from the twins directly."""

    def __init__(self):
        self.steps: list[tuple[int, float]] = []
        self.gauge: dict[tuple[int, str], list[tuple[int, float]]] = {}

    def count(self, call, calls):
        pass

    def time(self, call, seconds):
        if call.path == GEMV:
            self.gauge.setdefault((call.m, call.layer), []).append((call.bytes_moved(), seconds))

    def record_step(self, batch, seconds, weight_bytes):
        self.steps.append((batch, seconds))


def _layer_linears(model, kind: str) -> list:
    return [layer.attn.qkv if kind == "qkv" else layer.attn.o if kind == "o" else getattr(layer.mlp, kind)
            for layer in model.layers]


def run(a: argparse.Namespace) -> dict:
    bandwidth = copy_bandwidth()
    if a.model:  # loaded and quantized as the server does
        model = load_model(a.model, QuantConfig("int4", 128), torch.float16, "cuda", CONTEXT, progress=False).model
        config = model.cfg
        layers, vocab = config.num_layers, config.vocab_size
    else:
        config = configs()["llama3-8b"]
        state = random_state(config)
        model = build_model(config, state, QuantConfig("int4", 128), torch.float16, "cuda", CONTEXT, progress=False)
        del state
        layers, vocab = config.num_hidden_layers, config.vocab_size
    torch.cuda.empty_cache()
    steps = _Steps()
    timing = KernelTiming(steps, a.sample_every, stamped_layers=a.stamped_layers or layers, paired=a.paired)
    params = SamplingParams(max_tokens=NEW, temperature=a.temperature, seed=0, ignore_eos=True)
    model.observe_kernels(timing)
    engine = Engine(model, None, set(), max_num_seqs=a.max_num_seqs, max_queue=64, max_seq_len=CONTEXT,
                    max_prefill_tokens=2048).start()
    result = dict(gpu_info(), model="llama3-8b int4 g128", bandwidth=bandwidth, prompt=a.prompt,
                  sample_every=a.sample_every, temperature=a.temperature, source=a.model or "random state",
                  paired=a.paired, batches={})
    for b in BATCHES:
        per_layer: dict[str, list[list[float]]] = {k: [[] for _ in range(layers)] for k in KINDS}
        steps.steps.clear()
        for _ in range(a.replays):
            decode_tps(engine, vocab, b, params, prompt_tokens=a.prompt)
            timing.drain(wait=True)
            for twin in timing.captured:
                calls = twin.blocks.every_call() if twin.blocks is not None else []
                if not calls or calls[0][0].m != b:
                    continue
                seen: dict[str, int] = {}
                for call, seconds in calls:
                    i = seen.get(call.layer, 0)
                    seen[call.layer] = i + 1
                    per_layer[call.layer][i].append(seconds)
        model.observe_kernels(None)
        x = torch.randn(b, model.layers[0].attn.o.out_features, device="cuda", dtype=torch.float16)
        xi = torch.randn(b, model.layers[0].mlp.down.in_features, device="cuda", dtype=torch.float16)
        rows = {}
        for kind in KINDS:
            linears = _layer_linears(model, kind)
            inp = xi if kind == "down" else x
            epilogue = Epilogue.SWIGLU if kind == "gate_up" else Epilogue.NONE
            chain = graph_time_us([lambda lin=lin: lin(inp, epilogue) for lin in linears], calls=2 * layers)
            in_place = [statistics.median(s) * 1e6 for s in per_layer[kind] if s]
            gauge = steps.gauge.get((b, kind), [])
            rows[kind] = dict(n=linears[0].out_features, k=linears[0].in_features, chain_us=chain,
                              first_us=in_place[0], second_us=in_place[1],
                              others_us=in_place[-1] if a.paired else statistics.median(in_place[1:]),
                              per_layer_us=in_place, gauge_us=[t * 1e6 for _, t in gauge],
                              gauge_ratio=sum(m for m, _ in gauge) / sum(t for _, t in gauge) / bandwidth
                              if gauge else None)
        steps.gauge.clear()
        model.observe_kernels(timing)
        step = [s * 1e6 for bb, s in steps.steps if bb == b]
        result["batches"][str(b)] = dict(kinds=rows, step_us=statistics.median(step) if step else None,
                                         path=GEMV, timed_replays=len(step))
    engine.shutdown()
    return result


def summary(result: dict) -> str:
    out = [f"GPU: {result['gpu']}, torch {result['torch']}. {result['model']} (random weights), fp16, CUDA graphs, "
           f"the kernel-per-op decode step. In place: each GEMV's block stamps in the step's timed twin at the last "
           f"timed replay of each run (contexts near prompt + 128), median over the runs; layer 0, and the median of "
           f"the later stamped layers. Chain: the same 32 layers' calls of one kind in "
           f"a CUDA graph of their own (programmatic launches, weights rotated past L2), µs per call. Prompts of "
           f"{result['prompt']} tokens + 128 generated, temperature {result['temperature']}; one replay in "
           f"{result['sample_every']} timed. Weights: {result['source']}. The gauge's samples: the reported layer's "
           f"call at every timed replay, as the live gauge receives them; its ratio: their bytes / their time / "
           f"the copy bandwidth ({result['bandwidth'] / 1e12:.2f} TB/s).\n"]
    paired = result.get("paired", False)
    later = "the reported layer, paired µs" if paired else "in place, later layers µs"
    for b, r in result["batches"].items():
        table, sums = [], [0.0, 0.0]
        for kind, k in r["kinds"].items():
            g = k["gauge_us"]
            table.append([kind, f"{k['n']}x{k['k']}", f"{k['chain_us']:.1f}", f"{k['first_us']:.1f}",
                          f"{k['others_us']:.1f}", f"{k['others_us'] / k['chain_us']:.2f}",
                          f"{len(g)}: {statistics.median(g):.1f} / {statistics.mean(g):.1f} / {max(g):.1f}" if g else "",
                          f"{k['gauge_ratio']:.3f}" if g else ""])
            sums[0] += k["chain_us"]
            sums[1] += k["others_us"]
        table.append(["a layer's four", "", f"{sums[0]:.1f}", "", f"{sums[1]:.1f}", f"{sums[1] / sums[0]:.2f}", "", ""])
        out.append(f"\n**Batch {b}** (step {r['step_us']:.0f} µs median, {r['timed_replays']} timed replays)\n\n"
                   + markdown_table(["layer kind", "N x K", "chain µs", "in place, layer 0 µs",
                                     later, f"{'paired' if paired else 'in place'} / chain",
                                     "gauge's samples: n, median / mean / max µs", "gauge's ratio"], table))
    return "\n".join(out) + f"\n\n`{result['command']}`\n"


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
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens of each request")
    p.add_argument("--sample-every", type=int, default=1, help="one replay in N runs the timed twin")
    p.add_argument("--stamped-layers", type=int, default=0,
                   help="the GEMV calls of each kind stamped (the server's: 3; default: every layer)")
    p.add_argument("--paired", action="store_true",
                   help="time the reported layer's calls between calls of the two layers before it, as the server does "
                        "(default: every stamped call in place)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--max-num-seqs", type=int, default=max(BATCHES), help="the engine's (the server's: 16)")
    p.add_argument("--model", help="an HF model directory, loaded and quantized as the server does "
                                   "(default: random Llama-3-8B-shaped weights)")
    p.add_argument("--out", type=Path, default=Path("docs/bench"))
    p.add_argument("--name", default="gemv_in_place")
    a = p.parse_args()
    result = run(a)
    result["command"] = "python " + " ".join(sys.argv)
    save_results(a.out, a.name, result, summary, plot)


if __name__ == "__main__":
    main()
