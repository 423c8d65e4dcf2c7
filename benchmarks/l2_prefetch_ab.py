"""A/B of the decode step's L2 prefetch (kernels/l2_prefetch.py) on the GPU: graph step
time of a Llama-3-8B-shaped int4 model at batch 1 and 16 for several budgets and both
prefetch instructions, and the step's logits unchanged by it.

    python benchmarks/l2_prefetch_ab.py --out docs/bench
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import gpu_info, markdown_table, write_json  # noqa: E402
from engine import CONTEXT, configs, random_state  # noqa: E402
from profile_decode import graph_step_us, step_inputs  # noqa: E402

from woq.models import llama  # noqa: E402
from woq.models.builder import QuantConfig, build_model  # noqa: E402
from woq.models.kv_cache import KVCache  # noqa: E402
from woq.models.llama import Batch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--budgets-mb", default="0,4,8,12,16,24,32")
    ap.add_argument("--kinds", default="bulk,line")
    ap.add_argument("--out", type=Path, default=Path("docs/bench"))
    args = ap.parse_args()
    config = configs()[args.model]
    model = build_model(config, random_state(config), QuantConfig("int4", 128), torch.float16, "cuda", CONTEXT,
                        progress=False)
    cfg = model.cfg
    cache = KVCache(cfg.num_layers, 18, cfg.num_kv_heads, CONTEXT, cfg.head_dim, model.dtype, "cuda")
    ids, pos, slots = step_inputs(model, cache)
    ids16, pos16 = ids.expand(16, 1).contiguous(), pos.expand(16, 1).contiguous()

    def logits():
        return model(ids, Batch(pos, slots, lengths=pos[:, 0] + 1), cache, last_only=True)

    llama.set_l2_prefetch(0)
    ref = logits()
    rows = []
    for kind in args.kinds.split(","):
        for mb in (int(b) for b in args.budgets_mb.split(",")):
            if mb == 0 and rows:
                continue
            llama.set_l2_prefetch(mb << 20, kind)
            same = torch.equal(logits(), ref)
            b1 = graph_step_us(model, cache, ids, pos, slots)
            b16 = graph_step_us(model, cache, ids16, pos16, torch.arange(16, device=ids.device))
            rows.append({"kind": kind if mb else "off", "budget_mb": mb, "step_us_b1": b1, "step_us_b16": b16,
                         "logits_equal": same})
            print(rows[-1], flush=True)
    llama.set_l2_prefetch(0)
    base = rows[0]
    table = markdown_table(["prefetch", "budget MB", "graph step µs b1", "vs off", "graph step µs b16", "vs off",
                            "logits equal"],
                           [[r["kind"], r["budget_mb"], f"{r['step_us_b1']:.1f}", f"{base['step_us_b1'] / r['step_us_b1']:.3f}×",
                             f"{r['step_us_b16']:.1f}", f"{base['step_us_b16'] / r['step_us_b16']:.3f}×", r["logits_equal"]]
                            for r in rows])
    info = gpu_info()
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "l2_prefetch_ab.json", {"gpu": info, "model": args.model, "rows": rows})
    (args.out / "l2_prefetch_ab.md").write_text(f"GPU: {info}. {args.model} int4 g128, random weights, decode at "
                                                 f"position 128, CUDA graph replays (median of 200).\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
