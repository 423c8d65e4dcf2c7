"""Where one decode step's time goes (GPU): a kernel-level profile of a batch-1 step.

For each model (random weights, real shapes, int4 g128), with the fused decoder kernels
(``kernels/fused.py``) and with the plain torch ops (``RuntimeOptions.fused_ops``), the
step the engine runs (its ``DecodeRunner``: the persistent step where the model asks for
it, else a kernel per op):

* kernels of one eager decode step (torch.profiler, CUDA activity), grouped by what they
  do: count and summed GPU time;
* the same step replayed as a CUDA graph (median over replays, CUDA events): the kernels'
  time plus the gaps between them; with programmatic launches and without;
* the step's linear layers alone, the graph step of 16 sequences, and prefills;
* the engine's batch-1 decode rate, i.e. the graph plus the host's work per step
  (scheduling, sampling, copying the token to the host).

``--ablation``: the graph step under other runtime options -- the kernel-per-op step
against the persistent step with other L2 hints, ring depths and attention shares
(``DecodeStepOptions``) -- and other launch points of the add + RMSNorm kernels.

    python benchmarks/profile_decode.py --out docs/bench
    python benchmarks/profile_decode.py --ablation --models llama3-8b
"""
from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_bandwidth, gpu_info, markdown_table, write_json  # noqa: E402
from engine import CONTEXT, NEW, PROMPT, configs, decode_tps, random_state, weight_bytes  # noqa: E402

from woq.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from woq.engine.decode import DecodeRunner  # noqa: E402
from woq.engine.engine import Engine  # noqa: E402
from woq.engine.sampling import SamplingParams, greedy  # noqa: E402
from woq.kernels.options import RuntimeOptions  # noqa: E402
from woq.kernels.timing import graph_time_us  # noqa: E402
from woq.models.batches import Decode, Prefill  # noqa: E402
from woq.models.builder import bind_kernels, build_model  # noqa: E402
from woq.models.kv_cache import KVCache  # noqa: E402
from woq.models.quant_config import QuantConfig  # noqa: E402

# (group, regex on the kernel name), first match wins
GROUPS = [
    ("lm_head / dense: woq dense GEMV", r"dense_gemv_kernel"),
    ("linear: woq GEMV", r"gemv_kernel|gemv_stream_kernel"),
    ("linear: woq mixed GEMM", r"woq::gemm_kernel"),
    ("linear: woq dequantize (for cuBLAS)", r"dequant_kernel"),
    ("lm_head / dense: cuBLAS", r"gemm|gemv2|sm90|sm80|cutlass|cublas|Kernel2|splitK"),
    ("persistent decode step (every decoder layer)", r"decode_step_kernel"),
    ("attention, with RoPE + KV write (Triton)", r"_decode_attention"),
    ("chunk attention (Triton)", r"_chunk_attention|_merge_splits"),
    ("add + RMSNorm (fused)", r"_add_rms_norm"),
    ("RoPE + KV write (fused)", r"_rope_and_cache"),
    ("SiLU * up (fused)", r"_silu_mul"),
    ("embedding", r"embedding|indexSelect"),
    ("argmax / sampling", r"argmax|reduce_kernel.*ArgMax|_chunk_max_kernel|_first_chunk_kernel"),
    ("torch elementwise / copies / indexing", r"."),
]


def group_of(name: str) -> str:
    return next(g for g, pattern in GROUPS if re.search(pattern, name))


def rebind(model, options: RuntimeOptions) -> None:
    """The model's kernels bound for ``options`` (only where they differ from its own:
    binding repacks every quantized weight)."""
    if model.options != options:
        bind_kernels(model, options)


def step_inputs(model, cache, position: int = PROMPT):
    """A batch-1 decode step at ``position`` of slot 0 (after a prefill of that many tokens)."""
    dev = model.device
    prompt = torch.randint(0, model.cfg.vocab_size, (1, position), device=dev)
    model(prompt, Prefill.pack([position], [0], dev), cache, last_only=True)
    ids = prompt[:, -1:]
    pos = torch.full((1, 1), position, device=dev)
    return ids, pos, torch.tensor([0], device=dev)


def eager_kernels(model, cache, ids, pos, slots) -> dict[str, dict]:
    """Kernels of one eager decode step as the engine runs it: {group: {count, us}}."""
    runner = DecodeRunner(model, cache)

    def step():
        return greedy(runner(ids, Decode.at(pos, slots)))  # (the engine's greedy pick)

    return kernels_of(step)


def kernels_of(step) -> dict[str, dict]:
    """Kernels of one call of ``step`` (after 3 warm-up calls): {group: {count, us, names}}."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    groups: dict[str, dict] = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        g = groups.setdefault(group_of(ev.name), {"count": 0, "us": 0.0, "names": set()})
        g["count"] += 1
        g["us"] += ev.device_time
        g["names"].add(ev.name[:60])
    for g in groups.values():
        g["names"] = sorted(g["names"])[:6]
    return groups


def host_ops(step, rows: int = 14) -> str:
    """The host side of one call of ``step``: torch ops by self CPU time (a table)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=50)


def graph_step_us(model, cache, ids, pos, slots, replays: int = 200) -> float:
    """Median µs of one decode step of ``ids.shape[0]`` sequences replayed as a CUDA graph
    (the engine's step: a new ``DecodeRunner``, so a persistent step built for the model's
    current options)."""
    graphs = DecodeGraphs(DecodeRunner(model, cache), ids.shape[0], scratch_slot=cache.num_rows - 1)
    graphs.capture()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graphs.run(ids, pos, slots)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


LINEAR_KINDS = ("qkv", "o", "gate_up", "down")


def decoder_linears(model) -> list[tuple[str, int, torch.nn.Module]]:
    """(kind, layer index, linear) of every decoder layer's projections, in step order."""
    return [(kind, i, linear) for i, layer in enumerate(model.layers)
            for kind, linear in zip(LINEAR_KINDS, (layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down))]


def linear_chain(model, linears) -> Callable[[], list]:
    """One call of each of ``linears`` in turn, on fixed random one-row inputs (none
    depends on another: the chain of a step's linear layers without the rest)."""
    inputs = {k: torch.randn(1, k, device=model.device, dtype=model.dtype) for k in {lin.in_features for lin in linears}}
    return lambda: [lin(inputs[lin.in_features]) for lin in linears]


@torch.inference_mode()
def linears_alone_us(model) -> dict[str, float]:
    """The batch-1 step's linear layers without the rest of the decoder: every layer's
    qkv, o, gate_up and down, in that order, then the LM head, on fixed random inputs,
    replayed as one graph (each kind alone too). Against the whole graph step, what the
    norms, attention, SiLU and their dependencies add; against the weight bytes, what the
    GEMVs lose to the roofline."""
    in_order = [linear for _, _, linear in decoder_linears(model)]

    def replay_us(linears) -> float:  # one graph of the chain, replayed
        return graph_time_us([linear_chain(model, linears)], calls=1, reps=200)

    out = {"all": replay_us(in_order + [model.lm_head]), "lm_head": replay_us([model.lm_head])}
    out.update({kind: replay_us([lin for k, _, lin in decoder_linears(model) if k == kind]) for kind in LINEAR_KINDS})
    return out


def prefill_ms_of(model, cache, prompts: int = 1, repeats: int = 5) -> tuple[float, dict]:
    """Median ms of one eager prefill of ``prompts`` PROMPT-token prompts packed into one
    forward (slots 0, 1, ...), as the engine runs it, and its kernels by group."""
    dev = model.device
    prompt = torch.randint(0, model.cfg.vocab_size, (1, prompts * PROMPT), device=dev)
    batch = Prefill.pack([PROMPT] * prompts, list(range(prompts)), dev)

    def step():
        return model(prompt, batch, cache, last_only=True).argmax(-1).tolist()

    times = []
    for i in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        if i:
            times.append(start.elapsed_time(end))
    print(host_ops(step), flush=True)
    return statistics.median(times), kernels_of(step)


def profile_model(name: str, bw: float, base: RuntimeOptions) -> list[dict]:
    config = configs()[name]
    model = build_model(config, random_state(config), QuantConfig("int4", 128), torch.float16, "cuda", CONTEXT,
                        progress=False, options=base)
    cfg = model.cfg
    linears_us = linears_alone_us(model)
    print("linears alone, graph µs:", {k: round(v, 1) for k, v in linears_us.items()}, flush=True)
    rows = []
    for fused in (True, False):
        options = replace(base, fused_ops=fused)
        rebind(model, options)
        cache = KVCache(cfg.num_layers, 2, cfg.num_kv_heads, CONTEXT, cfg.head_dim, model.dtype, "cuda")
        ids, pos, slots = step_inputs(model, cache)
        groups = eager_kernels(model, cache, ids, pos, slots)
        graph_us = graph_step_us(model, cache, ids, pos, slots)
        rebind(model, replace(options, programmatic_launch=False))  # the same step captured with plain launches
        graph_plain_us = graph_step_us(model, cache, ids, pos, slots)
        rebind(model, options)
        del cache
        # batch 16 (the GEMV's second row block) at the same position, and one eager
        # PROMPT-token prefill (what a new sequence costs the running ones)
        cache = KVCache(cfg.num_layers, 18, cfg.num_kv_heads, CONTEXT, cfg.head_dim, model.dtype, "cuda")
        ids16, pos16 = ids.expand(16, 1).contiguous(), pos.expand(16, 1).contiguous()
        graph16_us = graph_step_us(model, cache, ids16, pos16, torch.arange(16, device=ids.device))
        prefill_ms, prefill_groups = prefill_ms_of(model, cache)
        prefill16_ms, _ = prefill_ms_of(model, cache, prompts=16)
        print(f"  prefill {prefill_ms:.1f} ms; kernels:", flush=True)
        for g, v in sorted(prefill_groups.items(), key=lambda kv: -kv[1]["us"]):
            print(f"   {g:40s} {v['count']:5d} {v['us']:9.1f} us  {v['names']}", flush=True)
        del cache
        engine = Engine(model, None, set(), max_num_seqs=1, max_seq_len=CONTEXT).start()
        engine.generate(list(range(PROMPT)), SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
        tps = statistics.median(decode_tps(engine, cfg.vocab_size, 1).steady_tps for _ in range(3))
        engine.shutdown()
        kernel_us = sum(g["us"] for g in groups.values())
        wbytes = weight_bytes(model)
        rows.append({"model": name, "fused": fused, "groups": groups, "kernels": sum(g["count"] for g in groups.values()),
                     "kernel_us": kernel_us, "graph_step_us": graph_us, "graph_step_plain_us": graph_plain_us,
                     "graph_step_b16_us": graph16_us, "linears_alone_us": linears_us, "prefill_ms": prefill_ms, "prefill16_ms": prefill16_ms,
                     "prefill_kernel_ms": sum(g["us"] for g in prefill_groups.values()) / 1e3, "prefill_groups": prefill_groups,
                     "engine_step_us": 1e6 / tps, "decode_tps_b1": tps,
                     "weight_bytes": wbytes, "weights_roofline_us": 1e6 * wbytes / bw})
        print({k: v for k, v in rows[-1].items() if k not in ("groups", "prefill_groups")}, flush=True)
        for g, v in sorted(groups.items(), key=lambda kv: -kv[1]["us"]):
            print(f"   {g:40s} {v['count']:5d} {v['us']:9.1f} us  {v['names']}", flush=True)
    return rows


@contextlib.contextmanager
def _norms_launching(model, input_norm: str | None = None, post_norm: str | None = None):
    """The add + RMSNorm kernels letting the next GEMV launch at their start, after their
    inputs are in, or at their end (fused.LAUNCH_NEXT): before the qkv projection
    (``input_norm``) and before gate/up (``post_norm``); None keeps the model's choice."""
    saved = [(layer.input_norm.launch_next, layer.post_norm.launch_next) for layer in model.layers]
    for layer in model.layers:
        layer.input_norm.launch_next = input_norm or layer.input_norm.launch_next
        layer.post_norm.launch_next = post_norm or layer.post_norm.launch_next
    try:
        yield
    finally:
        for layer, (i, p) in zip(model.layers, saved):
            layer.input_norm.launch_next, layer.post_norm.launch_next = i, p


# label: (the persistent step's settings, DecodeStepOptions fields -- None: a kernel per op
# --, the add + RMSNorm kernels' launch points). "full step" is the baseline: the
# kernel-per-op step, which the launch variants change (at batch 1 the 8B model's served
# step is the persistent one: CausalLM.wants_persistent_decode).
ABLATIONS = {
    "full step": (None, {}),
    "persistent step: every layer in one kernel": ({}, {}),
    **{f"persistent step, L2: {label}": ({"cache_hints": hints}, {})
       for hints, label in ((0, "no hints"), (1, "weights evict_first only"), (2, "small data prefetched only"))},
    **{f"persistent step, {n} ring slots": ({"ring_slots": n}, {}) for n in (2, 3, 4)},
    **{f"persistent step, at most {n} shares a KV head": ({"max_shares": n}, {}) for n in (1, 2, 4, 8)},
    "launch: post-attention norm lets gate/up launch at its start": (None, {"post_norm": "start"}),
    "launch: post-attention norm lets gate/up launch at its end": (None, {"post_norm": "end"}),
    "launch: input norm lets qkv launch after its inputs": (None, {"input_norm": "inputs"}),
}


@contextlib.contextmanager
def _variant(model, base: RuntimeOptions, label: str):
    """The model bound for ``label``'s options and launch points, for the block."""
    step, norms = ABLATIONS[label]
    enabled = step is not None
    rebind(model, replace(base, decode_step=replace(base.decode_step, enabled=enabled, **(step or {}))))
    with _norms_launching(model, **norms):
        yield


def ablation(name: str, position: int, base: RuntimeOptions, batch: int = 1, rounds: int = 3,
             only: tuple[str, ...] = ()) -> dict:
    """Graph step (median µs) of ``batch`` sequences at ``position`` under each variant of
    ``ABLATIONS`` (the persistent ones at batch 1 only: it is a one-sequence step); the
    variants alternate over ``rounds`` rounds and each reports the median of its rounds.
    ``only``: the variants whose label contains one of these (and the full step)."""
    config = configs()[name]
    model = build_model(config, random_state(config), QuantConfig("int4", 128), torch.float16, "cuda", CONTEXT,
                        progress=False, options=base)
    cfg = model.cfg
    cache = KVCache(cfg.num_layers, batch + 1, cfg.num_kv_heads, CONTEXT, cfg.head_dim, model.dtype, "cuda")
    ids, pos, slots = step_inputs(model, cache, position)
    if batch > 1:  # (the other rows attend over whatever their slots hold: the same amount of work)
        ids, pos = ids.expand(batch, 1).contiguous(), pos.expand(batch, 1).contiguous()
        slots = torch.arange(batch, device=ids.device)
    variants = [k for k, (step, _) in ABLATIONS.items() if (batch == 1 or step is None)
                and (k == "full step" or not only or any(o in k for o in only))]
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for label in variants:
            with _variant(model, base, label):
                times[label].append(graph_step_us(model, cache, ids, pos, slots))
            print(f"{name} b{batch} @{position} {label}: {times[label][-1]:.1f} us", flush=True)
    del model, cache
    torch.cuda.empty_cache()
    full = statistics.median(times["full step"])
    return {"model": name, "position": position, "batch": batch, "rows": [
        {"variant": k, "graph_step_us": statistics.median(v), "saved_us": full - statistics.median(v), "rounds_us": v}
        for k, v in times.items()]}


def ablation_summary(result: dict) -> str:
    lines = [f"GPU: {result['gpu']}, torch {result['torch']}. int4 g128 random weights, decode at the batch and "
             "position shown; graph step: median µs of 200 CUDA-graph replays (programmatic launches), each variant captured "
             f"afresh, the variants alternating over {result.get('rounds', 3)} rounds (median of the rounds). \"full step\": "
             "the kernel-per-op step, which the launch variants change; the persistent step's variants (batch 1 only) "
             "are its DecodeStepOptions (at batch 1 the served 8B step is the persistent one with the defaults). "
             "\"saved\": the full step's µs minus the variant's. `python benchmarks/profile_decode.py --ablation`\n"]
    for m in result["models"]:
        lines.append(f"\n**{m['model']}, batch {m.get('batch', 1)}, position {m['position']}**\n")
        lines.append(markdown_table(["variant", "graph step µs", "saved µs", "per layer µs"],
                                    [[r["variant"], r["graph_step_us"], r["saved_us"],
                                      r["saved_us"] / configs()[m["model"]].num_hidden_layers] for r in m["rows"]]))
    return "\n".join(lines) + "\n"


def summary(result: dict) -> str:
    lines = [f"GPU: {result['gpu']}, torch {result['torch']}; copy bandwidth {result['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s. "
             f"int4 g128 random weights, batch 1, decode at position {PROMPT} ({NEW}-token runs for the engine rate), "
             "the step the engine runs (engine/decode.py: the persistent step where the model asks for it and the "
             "fused ops are on, else a kernel per op). Kernel µs: summed GPU time of one eager step's kernels (torch.profiler); graph step: the same step replayed "
             "as a CUDA graph (median of 200, CUDA events), with programmatic launches (RuntimeOptions.programmatic_launch, the default) and "
             "without; its linears alone: the step's linear layers and LM head in the same order on fixed inputs, one "
             "graph, nothing else (linears_alone_us in the JSON has each kind); engine step: 1 / the engine's batch-1 decode rate; graph step b16: the graph of 16 sequences "
             f"at that position; prefill: one eager {PROMPT}-token prompt with its first token, and 16 of them packed into "
             "one forward as the engine prefills simultaneous arrivals (median of 5).\n"]
    head = ["model", "decoder ops", "kernels / step", "kernel µs", "graph step µs", "graph step µs, plain launches",
            "its linears alone µs", "engine step µs", "tok/s b1", "weights-only roofline µs", "graph step µs b16", f"prefill ms ({PROMPT} tokens)", "its kernels ms",
            f"prefill ms (16 × {PROMPT} packed)"]
    lines.append(markdown_table(head, [[r["model"], "fused" if r["fused"] else "torch", r["kernels"], r["kernel_us"],
                                        r["graph_step_us"], r.get("graph_step_plain_us", "-"),
                                        r.get("linears_alone_us", {}).get("all", "-"), r["engine_step_us"], r["decode_tps_b1"], r["weights_roofline_us"],
                                        r.get("graph_step_b16_us", "-"), r.get("prefill_ms", "-"),
                                        r.get("prefill_kernel_ms", "-"), r.get("prefill16_ms", "-")]
                                       for r in result["rows"]]))
    for r in result["rows"]:
        lines.append(f"\n**{r['model']}, {'fused' if r['fused'] else 'torch'} ops** — kernels of one step:\n")
        lines.append(markdown_table(["group", "kernels", "µs", "share"],
                                    [[g, v["count"], v["us"], f"{100 * v['us'] / r['kernel_us']:.0f} %"]
                                     for g, v in sorted(r["groups"].items(), key=lambda kv: -kv[1]["us"])]))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m,llama3-8b")
    ap.add_argument("--out", type=Path, default=Path("docs/bench"))
    ap.add_argument("--ablation", action="store_true",
                    help="graph step under other decode-step options and launch points")
    ap.add_argument("--positions", default=f"{PROMPT},1024", help="decode positions of the ablation")
    ap.add_argument("--batches", default="1,4,16", help="batch sizes of the ablation")
    ap.add_argument("--variants", default="", help="comma-separated parts of the ablation variants' labels to run "
                                                   "(default: all)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the ablation's alternating variants")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    base = RuntimeOptions()
    if args.ablation:
        only = tuple(v for v in args.variants.split(",") if v)
        result = dict(gpu_info(), rounds=args.rounds,
                      models=[ablation(name, int(p), base, int(b), rounds=args.rounds, only=only)
                              for name in args.models.split(",")
                              for b in args.batches.split(",") for p in args.positions.split(",")])
        write_json(args.out / "decode_ablation.json", result)
        (args.out / "decode_ablation.md").write_text(ablation_summary(result))
        print(ablation_summary(result))
        return
    bw = copy_bandwidth()
    rows = [r for name in args.models.split(",") for r in profile_model(name, bw, base)]
    result = dict(gpu_info(), bandwidth_bytes_per_s=bw, rows=rows)
    write_json(args.out / "decode_profile.json", result)
    (args.out / "decode_profile.md").write_text(summary(result))
    print(summary(result))


if __name__ == "__main__":
    main()
