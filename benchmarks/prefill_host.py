"""Short prefills, eager against CUDA-graph replays: wall ms of one prompt's prefill (to
its first token's logits on the host), the host's share of the eager one, and the graph
replay of the same prompt (``engine.cuda_graphs.PrefillGraphs``). ``--cprofile``: where
the eager prefill's host time goes (Python functions by own time).

    python benchmarks/prefill_host.py --out docs/bench
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import gpu_info, markdown_table, write_json  # noqa: E402
from engine import CONTEXT, configs, random_state  # noqa: E402

from woq.engine.cuda_graphs import PrefillGraphs  # noqa: E402
from woq.models.builder import QuantConfig, build_model  # noqa: E402
from woq.models.kv_cache import KVCache  # noqa: E402
from woq.models.llama import Batch  # noqa: E402


def _median_ms(fn, repeats: int = 10) -> tuple[float, float]:
    """Median wall ms of ``fn()`` (which ends by reading a result on the host), and the
    median ms until ``fn`` had queued its work (the time ``queue()`` it returns takes)."""
    for _ in range(3):
        fn()()
    walls, hosts = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        finish = fn()
        hosts.append((time.perf_counter() - t0) * 1e3)
        finish()
        walls.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(walls), statistics.median(hosts)


def measure(name: str, lengths: list[int], cprofile: bool) -> list[dict]:
    config = configs()[name]
    model = build_model(config, random_state(config), QuantConfig("int4", 128), torch.float16, "cuda", CONTEXT,
                        progress=False)
    cfg = model.cfg
    cache = KVCache(cfg.num_layers, 2, cfg.num_kv_heads, CONTEXT, cfg.head_dim, model.dtype, "cuda")
    graphs = PrefillGraphs(model, cache)
    graphs.capture()
    rows = []
    for n in lengths:
        prompt = torch.randint(0, cfg.vocab_size, (n,)).tolist()

        def eager():
            ids = torch.tensor([prompt], device="cuda")
            logits = model(ids, Batch.prefill([n], [1], "cuda"), cache, last_only=True)
            return lambda: logits.argmax(-1).tolist()

        def graph():
            logits = graphs.run(prompt, 1)
            return lambda: logits.argmax(-1).tolist()

        eager_ms, eager_host_ms = _median_ms(eager)
        graph_ms, _ = _median_ms(graph)
        rows.append({"model": name, "tokens": n, "eager_ms": eager_ms, "eager_host_ms": eager_host_ms,
                     "graph_ms": graph_ms, "speedup": eager_ms / graph_ms})
        print(rows[-1], flush=True)
        if cprofile:
            prof = cProfile.Profile()
            prof.enable()
            eager()()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    del model, cache, graphs
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m,llama3-8b")
    ap.add_argument("--lengths", default="16,128,500")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--cprofile", action="store_true")
    args = ap.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    rows = [r for name in args.models.split(",") for r in measure(name, lengths, args.cprofile)]
    table = markdown_table(["model", "prompt tokens", "eager prefill ms", "its host ms (until queued)",
                            "graph replay ms", "eager / graph"],
                           [[r["model"], r["tokens"], f"{r['eager_ms']:.2f}", f"{r['eager_host_ms']:.2f}",
                             f"{r['graph_ms']:.2f}", f"{r['speedup']:.1f}×"] for r in rows])
    head = (f"GPU: {gpu_info()['gpu']}, torch {torch.__version__}. int4 g128 random weights; one prompt's prefill "
            "to its first token's logits on the host (median of 10 after 3 warm-ups): eager (the packed forward), "
            "and replayed through the prefill graph of its padded length (engine/cuda_graphs.py). "
            "`python benchmarks/prefill_host.py`\n\n")
    print(head + table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        write_json(args.out / "prefill_graphs.json", dict(gpu_info(), rows=rows))
        (args.out / "prefill_graphs.md").write_text(head + table + "\n")


if __name__ == "__main__":
    main()
