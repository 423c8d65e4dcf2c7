"""Where a layer of the persistent decode step spends its time (GPU): the step's timeline.

The persistent step (``kernels/decode_step.py``, ``csrc/decode_step.cuh``) runs every
decoder layer in one kernel, its stages ordered by counters, so a kernel-level profile
sees one kernel. Given a trace buffer (``DecodeStep.trace``), thread 0 of every block
stores the GPU's global clock at each point of ``TraceEvent`` of every layer: its stage
input ready, its units done, its release, and, for the attention roles, each part of
their work. For the Llama-3-8B-shaped int4 g128 model at batch 1, per variant and
position, the median over layers 1..31 and over ``--replays`` eager steps of:

* ``ready``: from the last block's release of the stage before to the median block's
  input ready (the counter seen, the input read; the norm for qkv and gate/up);
* ``units``: the median block's units of the stage, from its input ready to done;
* the attention's parts for the roles that hold tokens (``seen`` from qkv's last release;
  ``loaded``, ``first tile landed``, ``tiles``, ``written``, ``merged`` each from the part
  before);
* ``span``: from the stage before's last release to this stage's last done -- what the
  stage adds to the layer. Their sum is the layer.

    python benchmarks/step_timeline.py --out docs/bench [--positions 128,1024]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import gpu_info, markdown_table, write_json  # noqa: E402
from engine import CONTEXT, configs, parse_step_settings, random_state  # noqa: E402
from profile_decode import _persistent_decode, step_inputs  # noqa: E402

from woq.kernels import ops  # noqa: E402
from woq.kernels.decode_step import DecodeStep  # noqa: E402
from woq.models.builder import QuantConfig, build_model  # noqa: E402
from woq.models.kv_cache import KVCache  # noqa: E402
from woq.models.llama import Batch  # noqa: E402

# csrc/decode_step.cuh's step::TraceEvent, in order
EVENTS = ("qkv_ready", "qkv_done", "qkv_released", "attention_seen", "attention_loaded", "attention_landed",
          "attention_tiles", "attention_written", "attention_released", "attention_end", "o_ready", "o_done",
          "gate_up_ready", "gate_up_done", "down_ready", "down_done", "down_released")
E = {name: i for i, name in enumerate(EVENTS)}

# variant label: DecodeStep settings (the step is rebuilt for each)
VARIANTS = {
    "persistent step": {},
    "at most 4 shares a KV head": {"max_shares": 4},
    "at most 1 share a KV head": {"max_shares": 1},
    "blocks run free (no waits)": {"skip": 4},
    # (results wrong: csrc/decode_step.cuh's kSkip*; what paces the units)
    "no GEMV arithmetic": {"skip": 2},
    "no attention": {"skip": 1},
    "no attention, no waits": {"skip": 5},
    "streaming only": {"skip": 7},
    "consumer only (no stream, attention, waits)": {"skip": 13},
    "no weight stream": {"skip": 8},
}


def median(values) -> float:
    values = [float(v) for v in values]
    return statistics.median(values) if values else float("nan")


def layer_intervals(t: torch.Tensor, layer: int) -> dict[str, float]:
    """µs of each interval of ``layer`` (> 0) from one step's trace ``[blocks, layers, events]`` (ns)."""
    ev = lambda name, l=layer: t[:, l, E[name]]  # noqa: E731
    roles = ev("attention_seen") > 0
    merged = roles & (ev("attention_released") > 0)
    last = lambda name, sel=slice(None): ev(name)[sel].max().item()  # noqa: E731
    last_down = ev("down_released", layer - 1).max().item()
    q, o, gu = last("qkv_released"), last("o_done"), last("gate_up_done")
    r = last("attention_released", merged) if merged.any() else q  # (no roles: the attention left out)
    role = lambda a, b, sel=roles: median((ev(b)[sel] - ev(a)[sel]).tolist())  # noqa: E731
    out = {
        "qkv ready": median(ev("qkv_ready").tolist()) - last_down,
        "qkv units": median((ev("qkv_done") - ev("qkv_ready")).tolist()),
        "qkv release": median((ev("qkv_released") - ev("qkv_done")).tolist()),
        "qkv span": q - last_down,
        "attention: qkv seen": median(ev("attention_seen")[roles].tolist()) - q,
        "attention: loaded, rotated": role("attention_seen", "attention_loaded"),
        "attention: first tile landed": role("attention_loaded", "attention_landed"),
        "attention: tiles": role("attention_landed", "attention_tiles"),
        "attention: written": role("attention_tiles", "attention_written"),
        "attention: merged, released": role("attention_written", "attention_released", merged),
        "attention span": r - q,
        "o ready": median(ev("o_ready").tolist()) - r,
        "o units": median((ev("o_done") - ev("o_ready")).tolist()),
        "o span": o - r,
        "gate/up ready": median(ev("gate_up_ready").tolist()) - o,
        "gate/up units": median((ev("gate_up_done") - ev("gate_up_ready")).tolist()),
        "gate/up span": gu - o,
        "down ready": median(ev("down_ready").tolist()) - gu,
        "down units": median((ev("down_done") - ev("down_ready")).tolist()),
        "down release": median((ev("down_released") - ev("down_done")).tolist()),
        "down span": last("down_released") - gu,
        "layer": last("down_released") - last_down,
        "roles: attention stage": role("qkv_released", "attention_end"),
        "roles holding tokens": float(roles.sum()),
    }
    return {k: (v if k == "roles holding tokens" else v / 1e3) for k, v in out.items()}


def traced_steps(model, cache, position: int, settings: dict, replays: int) -> dict[str, float]:
    """Median intervals over layers 1.. and ``replays`` eager steps of the persistent step
    built with ``settings`` (DecodeStep class attributes)."""
    ids, pos, slots = step_inputs(model, cache, position)
    batch = Batch(pos, slots, lengths=pos[:, 0] + 1)
    with _persistent_decode(model=model, **settings):  # (the step rebuilt with them, and dropped after)
        model(ids, batch, cache, last_only=True)  # (builds the step)
        step = model._persistent_step(cache)
        n_layers = model.cfg.num_layers
        step.trace = torch.zeros(DecodeStep.trace_words(n_layers, model.device), dtype=torch.int64, device="cuda")
        per_layer: dict[str, list[float]] = {}
        for _ in range(replays):
            step.trace.zero_()
            model(ids, batch, cache, last_only=True)
            torch.cuda.synchronize()
            t = step.trace.view(-1, n_layers, len(EVENTS)).cpu()
            for layer in range(1, n_layers):
                for k, v in layer_intervals(t, layer).items():
                    per_layer.setdefault(k, []).append(v)
    return {k: median(v) for k, v in per_layer.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("docs/bench"))
    ap.add_argument("--positions", default="128,1024")
    ap.add_argument("--variants", default="", help="comma-separated parts of VARIANTS' labels (default: all)")
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--step-settings", default="",
                    help="more variants: DecodeStep settings, e.g. 'ring_slots=3;max_shares=4,cache_hints=1'")
    args = ap.parse_args()
    if not ops.available():
        raise SystemExit("the woq CUDA kernels did not load")
    if torch.ops.woq.decode_step_trace_events() != len(EVENTS):
        raise SystemExit("EVENTS does not match csrc/decode_step.cuh's TraceEvent")
    config = configs()["llama3-8b"]
    model = build_model(config, random_state(config), QuantConfig("int4", 128), torch.float16, "cuda", CONTEXT,
                        progress=False)
    cfg = model.cfg
    cache = KVCache(cfg.num_layers, 2, cfg.num_kv_heads, CONTEXT, cfg.head_dim, model.dtype, "cuda")
    only = [v for v in args.variants.split(",") if v]
    variants = {k: v for k, v in VARIANTS.items() if not only or any(o in k for o in only)}
    variants.update({f"persistent step, {label}": v for label, v in parse_step_settings(args.step_settings).items()})
    results = []
    for position in (int(p) for p in args.positions.split(",")):
        for label, settings in variants.items():
            intervals = traced_steps(model, cache, position, settings, args.replays)
            results.append({"variant": label, "position": position, "settings": settings, "us": intervals})
            print(f"@{position} {label}: layer {intervals['layer']:.2f} us, attention span "
                  f"{intervals['attention span']:.2f} us", flush=True)
    result = dict(gpu_info(), replays=args.replays, results=results)
    write_json(args.out / "step_timeline.json", result)
    names = list(results[0]["us"])
    columns = [f"{r['variant']} @{r['position']}" for r in results]
    table = markdown_table(["µs, median of layers 1..31", *columns],
                           [[n, *(r["us"][n] for r in results)] for n in names])
    text = (f"GPU: {result['gpu']}, torch {result['torch']}. Llama-3-8B-shaped int4 g128 random weights, batch 1, "
            f"the persistent decode step's timeline (benchmarks/step_timeline.py), {args.replays} eager steps a "
            "column.\n\n" + table + "\n")
    (args.out / "step_timeline.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
