"""The engine under serving load without HTTP: what the GPU side can do, to set against the
same workloads streamed over HTTP (``paged_serving.py``).

Closed-loop clients in this process submit greedy requests straight to an ``Engine`` (no
tokenizer, no server) and time each token's arrival at its sink: output tokens/s, TTFT and
ITL percentiles. Each ``--config NAME:BUDGET:MIX`` is an engine with a step token budget
(``--max-prefill-tokens``) and decode tokens mixed into prefill forwards (1) or run as
separate decode steps after each prefill (0). The clients start together with prompts of
one length, so their prefills largely coincide and few streams decode while a prompt is
prefilled: its ITL tail is not that of arrivals that drift apart, as over HTTP
(docs/design/kv_cache.md).

    python benchmarks/engine_load.py --model /tmp/llama3-8b --config mix512:512:1 --config sep2048:2048:0
"""
from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown_table, save_results  # noqa: E402

from woq.engine.engine import Engine  # noqa: E402
from woq.engine.sampling import SamplingParams  # noqa: E402
from woq.models.loader import load_model  # noqa: E402
from woq.models.quant_config import QuantConfig  # noqa: E402

WORKLOADS = {  # name: (clients, requests, prompt tokens, output tokens), as in paged_serving.py
    "p515_c16": (16, 48, 515, 128),
    "p515_c64": (64, 128, 515, 128),
    "p6150_c16": (16, 32, 6150, 256),
}


def engine_for(model, budget: int, mix: bool) -> Engine:
    class Separate(Engine):
        def _mixed_step(self, seqs, chunks):  # the decode step after the prefill, as before mixed steps
            self._decode_step(self._prefill(chunks))

    kind = Engine if mix else Separate
    return kind(model, None, set(), max_prefill_tokens=budget, max_seq_len=8192, max_queue=512).start()


def run_workload(engine: Engine, clients: int, requests: int, prompt: int, out: int) -> dict:
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 30000) for _ in range(prompt)] for _ in range(requests)]
    itl, ttft, tokens, left, lock = [], [], [0], list(range(requests)), threading.Lock()

    def client() -> None:
        while True:
            with lock:
                if not left:
                    return
                i = left.pop()
            start, last, done = time.perf_counter(), [None], threading.Event()

            def sink(ev) -> None:
                now = time.perf_counter()
                if ev.token_ids:
                    (ttft if last[0] is None else itl).append(now - (start if last[0] is None else last[0]))
                    last[0] = now
                    tokens[0] += len(ev.token_ids)
                if ev.finish_reason:
                    done.set()

            engine.submit(prompts[i], SamplingParams(max_tokens=out, temperature=0, ignore_eos=True), sink)
            done.wait()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0

    def pct(xs: list[float], p: float) -> float:
        return sorted(xs)[int(p * (len(xs) - 1))] * 1e3

    return {"tok_s": tokens[0] / wall, "ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99),
            "itl_p50_ms": pct(itl, 0.5), "itl_p99_ms": pct(itl, 0.99)}


def summary(r: dict) -> str:
    rows = [[c, w, f"{v['tok_s']:.0f}", f"{v['ttft_p50_ms']:.0f} / {v['ttft_p99_ms']:.0f}",
             f"{v['itl_p50_ms']:.1f} / {v['itl_p99_ms']:.1f}"]
            for c, ws in r["configs"].items() for w, v in ws.items()]
    return (f"GPU: {r['gpu']}, torch {r['torch']}. Engine alone (no HTTP), `{r['model']}` int4, greedy, closed "
            "loop.\n\n" + markdown_table(["config", "workload", "output tok/s", "TTFT p50 / p99 ms",
                                          "ITL p50 / p99 ms"], rows) + "\n")


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    names = list(WORKLOADS)
    for i, (c, ws) in enumerate(r["configs"].items()):
        xs = [j + 0.8 * i / len(r["configs"]) for j in range(len(names))]
        axes[0].bar(xs, [ws[w]["tok_s"] for w in names], width=0.8 / len(r["configs"]), label=c)
        axes[1].bar(xs, [ws[w]["itl_p99_ms"] for w in names], width=0.8 / len(r["configs"]), label=c)
    for ax, label in zip(axes, ("output tok/s", "ITL p99 ms")):
        ax.set_xticks(range(len(names)), names, fontsize=7)
        ax.set_ylabel(label)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{r['gpu']}: the engine alone", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Hugging Face directory (e.g. benchmarks/startup.py's random 8B)")
    ap.add_argument("--config", action="append", default=None, help="NAME:BUDGET:MIX (repeatable)")
    ap.add_argument("--out", type=Path, default=Path("docs/bench"))
    args = ap.parse_args()
    model = load_model(args.model, QuantConfig("int4"), dtype=torch.float16, device="cuda", max_seq_len=8192,
                       progress=False).model
    results = {}
    for spec in args.config or ["mix512:512:1", "sep2048:2048:0"]:
        name, budget, mix = spec.split(":")
        engine = engine_for(model, int(budget), mix == "1")
        try:
            results[name] = {w: run_workload(engine, *WORKLOADS[w]) for w in WORKLOADS}
        finally:
            engine.shutdown()
        del engine
        torch.cuda.empty_cache()
    save_results(args.out, "engine_load", {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                           "model": args.model, "configs": results}, summary, plot)


if __name__ == "__main__":
    main()
