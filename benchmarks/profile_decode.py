"""Where one decode step's time goes (GPU): a kernel-level profile of a batch-1 step.

For each model (random weights, real shapes), with the fused decoder kernels
(``kernels/fused.py``) and with the plain torch ops:

* kernels of one eager decode step (torch.profiler, CUDA activity), grouped by what they
  do: count and summed GPU time;
* the same step replayed as a CUDA graph (median over replays, CUDA events): the kernels'
  time plus the gaps between them;
* the engine's batch-1 decode rate, i.e. the graph plus the host's work per step
  (scheduling, sampling, copying the token to the host).

    python benchmarks/profile_decode.py --out docs/bench
    python benchmarks/profile_decode.py --ablation --models llama3-8b   # what each part adds
"""
from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_bandwidth, gpu_info, markdown_table, write_json  # noqa: E402
from engine import CONTEXT, NEW, PROMPT, configs, decode_tps, random_state, weight_bytes  # noqa: E402

from woq.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from woq.engine.engine import Engine  # noqa: E402
from woq.engine.sampling import SamplingParams, greedy  # noqa: E402
from woq.kernels import pdl  # noqa: E402
from woq.kernels.timing import graph_time_us  # noqa: E402
from woq.models import llama  # noqa: E402
from woq.models.builder import QuantConfig, build_model  # noqa: E402
from woq.models.kv_cache import KVCache  # noqa: E402
from woq.models.llama import Batch  # noqa: E402

# (group, regex on the kernel name), first match wins
GROUPS = [
    ("linear: woq GEMV", r"gemv_kernel|gemv_stream_kernel"),
    ("linear: woq mixed GEMM", r"woq::gemm_kernel"),
    ("lm_head / dense: cuBLAS", r"gemm|gemv2|sm90|sm80|cutlass|cublas|Kernel2|splitK"),
    ("persistent decode step (every decoder layer)", r"decode_step_kernel"),
    ("attention, with RoPE + KV write (Triton)", r"_decode_attention"),
    ("add + RMSNorm (fused)", r"_add_rms_norm"),
    ("RoPE + KV write (fused)", r"_rope_and_cache"),
    ("SiLU * up (fused)", r"_silu_mul"),
    ("embedding", r"embedding|indexSelect"),
    ("argmax / sampling", r"argmax|reduce_kernel.*ArgMax|_chunk_max_kernel|_first_chunk_kernel"),
    ("torch elementwise / copies / indexing", r"."),
]


def group_of(name: str) -> str:
    return next(g for g, pattern in GROUPS if re.search(pattern, name))


def step_inputs(model, cache, position: int = PROMPT):
    """A batch-1 decode step at ``position`` of slot 0 (after a prefill of that many tokens)."""
    dev = model.device
    prompt = torch.randint(0, model.cfg.vocab_size, (1, position), device=dev)
    model(prompt, Batch.prefill([position], [0], dev), cache, last_only=True)
    ids = prompt[:, -1:]
    pos = torch.full((1, 1), position, device=dev)
    return ids, pos, torch.tensor([0], device=dev)


def eager_kernels(model, cache, ids, pos, slots) -> dict[str, dict]:
    """Kernels of one eager decode step: {group: {count, us}}."""

    def step():
        logits = model(ids, Batch(pos, slots, lengths=pos[:, 0] + 1), cache, last_only=True)
        return greedy(logits)  # (the engine's greedy pick)

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
    """Median µs of one decode step of ``ids.shape[0]`` sequences replayed as a CUDA graph."""
    graphs = DecodeGraphs(model, cache, ids.shape[0], scratch_slot=cache.num_slots - 1)
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
    batch = Batch.prefill([PROMPT] * prompts, list(range(prompts)), dev)

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


def profile_model(name: str, bw: float) -> list[dict]:
    config = configs()[name]
    model = build_model(config, random_state(config), QuantConfig("int4", 128), torch.float16, "cuda", CONTEXT,
                        progress=False)
    cfg = model.cfg
    linears_us = linears_alone_us(model)
    print("linears alone, graph µs:", {k: round(v, 1) for k, v in linears_us.items()}, flush=True)
    rows = []
    for fused in (True, False):
        llama.set_fused_ops(fused)
        cache = KVCache(cfg.num_layers, 2, cfg.num_kv_heads, CONTEXT, cfg.head_dim, model.dtype, "cuda")
        ids, pos, slots = step_inputs(model, cache)
        groups = eager_kernels(model, cache, ids, pos, slots)
        graph_us = graph_step_us(model, cache, ids, pos, slots)
        pdl.set_enabled(False)  # the same step captured with plain launches
        graph_plain_us = graph_step_us(model, cache, ids, pos, slots)
        pdl.set_enabled(True)
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
        engine = Engine(model, None, set(), max_batch_size=1, max_seq_len=CONTEXT).start()
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
    llama.set_fused_ops(True)
    return rows


@contextlib.contextmanager
def _without(part: str):
    """The decoder with one kind of its non-GEMV kernels replaced by a view of its input
    (no kernel at all): what remains of the step is its GEMVs and the other parts, so the
    graph step's difference is what that part costs in place, its launch and the wait it
    puts between two GEMVs included. Batch 1 only (the views assume one row)."""
    from woq.kernels import decode_attention, fused

    originals = {"norm": (fused, "add_rms_norm"), "attention": (decode_attention, "rope_cache_attention")}
    stand_ins = {
        "norm": lambda x, residual, weight, eps, launch_next="start": (x, x if residual is None else residual),
        "attention": lambda qkv, positions, slots, lengths, cos, sin, k, v, heads, head_dim, **options:
            qkv.reshape(-1)[: heads * head_dim].view(1, heads, head_dim),
    }
    parts = [p for p in part.split("+") if p]
    saved = {p: getattr(*originals[p]) for p in parts}
    for p in parts:
        setattr(*originals[p], stand_ins[p])
    try:
        with _attention_in_o(False) if "attention" in parts else contextlib.nullcontext():
            yield
    finally:
        for p in parts:
            setattr(*originals[p], saved[p])


@contextlib.contextmanager
def _class_setting(cls, name: str, value):
    """``cls.name = value`` for the block, the previous value back after it."""
    saved = getattr(cls, name)
    setattr(cls, name, value)
    try:
        yield
    finally:
        setattr(cls, name, saved)


def _attention_in_o(enabled: bool):
    """The decode attention done by the o GEMV's grid (kernels/csrc/attention.cuh), or as its
    own kernel before it (decode_attention.py): models/llama.py, ``Attention.attention_in_o``."""
    from woq.models.llama import Attention

    return _class_setting(Attention, "attention_in_o", enabled)


def kernel_per_op_step():
    """The batch-1 decode step as one kernel per op (models/llama.py: ``CausalLM.persistent_decode``
    off), the step the ablation's variants other than the persistent ones change."""
    from woq.models.llama import CausalLM

    return _class_setting(CausalLM, "persistent_decode", False)


@contextlib.contextmanager
def _persistent_decode(skip: int = 0, model=None, **options):
    """Every decoder layer of a batch-1 step in one persistent kernel (kernels/decode_step.py):
    models/llama.py, ``CausalLM.persistent_decode``; ``skip``: parts it leaves out, for
    timing only (``DecodeStep.skip``); ``options``: other ``cache_hints``, ``ring_slots`` or
    ``max_shares`` (the step is then rebuilt for ``model``, before and after)."""
    from woq.kernels.decode_step import DecodeStep
    from woq.models.llama import CausalLM

    with contextlib.ExitStack() as settings:
        settings.enter_context(_class_setting(CausalLM, "persistent_decode", True))
        for k, v in {"skip": skip, **options}.items():
            settings.enter_context(_class_setting(DecodeStep, k, v))
        if model is not None:
            model._decode_steps.clear()
        try:
            yield
        finally:
            if model is not None:
                model._decode_steps.clear()


@contextlib.contextmanager
def _attention_with(**options):
    """Decode attention with other shares (``splits``), tiles (``block``) or pipeline
    ``stages`` than its defaults (``decode_attention.tiles``)."""
    from woq.kernels import decode_attention

    original = decode_attention.rope_cache_attention
    decode_attention.rope_cache_attention = lambda *a, **kw: original(*a, **{**kw, **options})
    try:
        with _attention_in_o(False):
            yield
    finally:
        decode_attention.rope_cache_attention = original


@contextlib.contextmanager
def _swiglu_kernel():
    """SwiGLU's activation as its own kernel after the gate/up GEMV, as before the GEMV's
    epilogue took it (``ops.gemv(..., swiglu=True)``): what that fusion saves."""
    from woq.kernels import fused, ops

    original = ops.run_path

    def separate(path, x, gw, bias, swiglu=False):
        y = original(path, x, gw, bias)
        return fused.silu_mul(y, interleaved=gw.swiglu_rows) if swiglu else y

    ops.run_path = separate
    try:
        yield
    finally:
        ops.run_path = original


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


@contextlib.contextmanager
def _gemv_grids(model, grids: dict[str, tuple[int, int]], m: int = 1):
    """Every layer's GEMVs of the kinds in ``grids`` launched at ``m`` rows with the register
    stream at (k-warps, blocks; 0: the kernel's own count) instead of their tuned launch."""
    from woq.kernels import ops

    weights = [(lin.gpu, grids[kind]) for kind, _, lin in decoder_linears(model) if kind in grids]
    saved = [gw.grids.get(m) for gw, _ in weights]
    for gw, (k_warps, blocks) in weights:
        gw.grids[m] = (k_warps, blocks, ops.GEMV_STREAM)
    try:
        yield
    finally:
        for (gw, _), g in zip(weights, saved):
            if g is None:  # (no tuned launch at m: the kernel's own choice again)
                gw.grids.pop(m, None)
            else:
                gw.grids[m] = g


@contextlib.contextmanager
def _with(*variants):
    """Several variants at once."""
    with contextlib.ExitStack() as stack:
        for v in variants:
            stack.enter_context(v)
        yield


# Other GEMV grids in the step than the tuner's (measured alone, after an add + RMSNorm:
# kernels/tuning.py), as (label, kind, k-warps, blocks); H100 results in
# docs/bench/decode_step_tried.md.
GRID_VARIANTS = [("o 4 k-warps, 128 blocks", "o", 4, 0), ("o 2 k-warps, 128 blocks", "o", 2, 128),
                 ("o 1 k-warp, 128 blocks", "o", 1, 128), ("o 2 k-warps, 256 blocks", "o", 2, 256),
                 ("qkv 2 k-warps, 96 blocks", "qkv", 2, 96), ("qkv 8 k-warps, 384 blocks", "qkv", 8, 0),
                 ("gate/up 1 k-warp, 448 blocks", "gate_up", 1, 448), ("gate/up 4 k-warps, 896 blocks", "gate_up", 4, 0),
                 ("gate/up 8 k-warps, 1792 blocks", "gate_up", 8, 0), ("down 1 k-warp, 256 blocks", "down", 1, 256),
                 ("down 2 k-warps, 128 blocks", "down", 2, 128), ("down 4 k-warps, 256 blocks", "down", 4, 0),
                 ("down 8 k-warps, 256 blocks (no split-K)", "down", 8, 0)]

ABLATIONS = {"full step": lambda model: contextlib.nullcontext(),
             "no add + RMSNorm": lambda model: _without("norm"),
             "SiLU * up as its own kernel": lambda model: _swiglu_kernel(),
             "no attention": lambda model: _without("attention"),
             "attention done by o's GEMV grid": lambda model: _attention_in_o(True),
             "persistent step: every layer in one kernel": lambda model: _persistent_decode(),
             "persistent step, L2: no hints": lambda model: _persistent_decode(cache_hints=0),
             "persistent step, L2: weights evict_first": lambda model: _persistent_decode(cache_hints=1),
             "persistent step, L2: small data prefetched": lambda model: _persistent_decode(cache_hints=2),
             "persistent step, L2: weights evict_first, small data prefetched":
                 lambda model: _persistent_decode(cache_hints=3),
             **{f"persistent step, L2: weights evict_first, small data prefetched, {n} ring slots":
                (lambda model, n=n: _persistent_decode(cache_hints=3, ring_slots=n)) for n in (2, 3, 4)},
             **{f"persistent step, at most {n} shares a KV head": (lambda model, n=n: _persistent_decode(
                 model=model, max_shares=n)) for n in (1, 2, 4, 8)},
             # (timing only: the parts of the persistent step, left out; its results are then wrong)
             "persistent step without its attention": lambda model: _persistent_decode(skip=1),
             "persistent step without its attention, L2: weights evict_first, small data prefetched":
                 lambda model: _persistent_decode(skip=1, cache_hints=3),
             "persistent step without its GEMV arithmetic": lambda model: _persistent_decode(skip=2),
             "persistent step without waits (blocks run free)": lambda model: _persistent_decode(skip=4),
             "persistent step without waits and attention": lambda model: _persistent_decode(skip=5),
             "persistent step streaming only (no attention, arithmetic, waits)":
                 lambda model: _persistent_decode(skip=7),
             "GEMVs, embedding, LM head only": lambda model: _without("norm+attention"),  # (SiLU: in the gate/up GEMV)
             "attention, tiles of 128 tokens, 1 stage": lambda model: _attention_with(block=128, stages=1),
             "attention, tiles of 64 tokens, 3 stages": lambda model: _attention_with(block=64, stages=3),
             "attention, tiles of 256 tokens, 1 stage": lambda model: _attention_with(block=256, stages=1),
             "attention, 8 shares": lambda model: _attention_with(splits=8),
             # (the model's own: the post-attention norm lets gate/up launch after its inputs, the
             # input norm and attention let the next kernel launch at their start; models/llama.py)
             "launch: post-attention norm lets gate/up launch at its start":
                 lambda model: _norms_launching(model, post_norm="start"),
             "launch: post-attention norm lets gate/up launch at its end":
                 lambda model: _norms_launching(model, post_norm="end"),
             "launch: input norm lets qkv launch after its inputs": lambda model: _norms_launching(model, input_norm="inputs"),
             "launch: attention lets o launch after its q": lambda model: _attention_with(launch_next="inputs"),
             "launch: attention lets o launch at its end": lambda model: _attention_with(launch_next="end"),
             # attention's programs small enough to share an SM with a GEMV block (Triton's maxnreg)
             "regs: attention 8 warps, <= 128 registers": lambda model: _attention_with(max_registers=128),
             "regs: attention 4 warps, <= 128 registers": lambda model: _attention_with(warps=4, max_registers=128),
             "regs: attention 4 warps, <= 128 registers, tiles of 64":
                 lambda model: _attention_with(warps=4, max_registers=128, block=64, stages=1),
             "regs: attention 4 warps, <= 64 registers, tiles of 64":
                 lambda model: _attention_with(warps=4, max_registers=64, block=64, stages=1),
             "regs: attention 8 warps, <= 128 registers + o 4 k-warps, 128 blocks":
                 lambda model: _with(_attention_with(max_registers=128), _gemv_grids(model, {"o": (4, 0)})),
             "grid: o 4 k-warps, 128 blocks + down 8 k-warps, 256 blocks":
                 lambda model: _gemv_grids(model, {"o": (4, 0), "down": (8, 0)}),
             **{f"grid: {label}": (lambda model, kind=kind, grid=(kw, blocks): _gemv_grids(model, {kind: grid}))
                for label, kind, kw, blocks in GRID_VARIANTS}}
TAKEN_OUT = ("no ", "GEMVs", "persistent")  # batch 1 only: views of one row, the one-sequence kernel


def ablation(name: str, position: int, batch: int = 1, rounds: int = 3, only: tuple[str, ...] = ()) -> dict:
    """Graph step (median µs) of ``batch`` sequences at ``position`` with each part of the
    decoder taken out (batch 1 only), and with other shares, tiles or stages of the decode
    attention; the variants alternate over ``rounds`` rounds and each reports the median of
    its rounds. ``only``: the variants whose label contains one of these (and the full step)."""
    config = configs()[name]
    model = build_model(config, random_state(config), QuantConfig("int4", 128), torch.float16, "cuda", CONTEXT,
                        progress=False)
    cfg = model.cfg
    cache = KVCache(cfg.num_layers, batch + 1, cfg.num_kv_heads, CONTEXT, cfg.head_dim, model.dtype, "cuda")
    ids, pos, slots = step_inputs(model, cache, position)
    if batch > 1:  # (the other rows attend over whatever their slots hold: the same amount of work)
        ids, pos = ids.expand(batch, 1).contiguous(), pos.expand(batch, 1).contiguous()
        slots = torch.arange(batch, device=ids.device)
    variants = {k: v for k, v in ABLATIONS.items() if (batch == 1 or not k.startswith(TAKEN_OUT))
                and (k == "full step" or not only or any(o in k for o in only))}
    times: dict[str, list[float]] = {k: [] for k in variants}
    with kernel_per_op_step():
        for _ in range(rounds):
            for label, variant in variants.items():
                with variant(model):
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
             "the kernel-per-op step, which every variant but the persistent ones changes (at batch 1 the served "
             "8B step is the persistent one: models/llama.py). \"no X\": that kind of kernel "
             "replaced by a view of its input, so \"saved\" is what it costs in place, its launch and the wait "
             "between the GEMVs around it included (batch 1 only). `python benchmarks/profile_decode.py --ablation`\n"]
    for m in result["models"]:
        lines.append(f"\n**{m['model']}, batch {m.get('batch', 1)}, position {m['position']}**\n")
        lines.append(markdown_table(["variant", "graph step µs", "saved µs", "per layer µs"],
                                    [[r["variant"], r["graph_step_us"], r["saved_us"],
                                      r["saved_us"] / configs()[m["model"]].num_hidden_layers] for r in m["rows"]]))
    return "\n".join(lines) + "\n"


def summary(result: dict) -> str:
    lines = [f"GPU: {result['gpu']}, torch {result['torch']}; copy bandwidth {result['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s. "
             f"int4 g128 random weights, batch 1, decode at position {PROMPT} ({NEW}-token runs for the engine rate). "
             "Kernel µs: summed GPU time of one eager step's kernels (torch.profiler); graph step: the same step replayed "
             "as a CUDA graph (median of 200, CUDA events), with programmatic launches (kernels/pdl.py, the default) and "
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
    ap.add_argument("--ablation", action="store_true", help="graph step with each non-GEMV part taken out")
    ap.add_argument("--positions", default=f"{PROMPT},1024", help="decode positions of the ablation")
    ap.add_argument("--batches", default="1,4,16", help="batch sizes of the ablation")
    ap.add_argument("--variants", default="", help="comma-separated parts of the ablation variants' labels to run "
                                                   "(default: all)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the ablation's alternating variants")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.ablation:
        only = tuple(v for v in args.variants.split(",") if v)
        result = dict(gpu_info(), rounds=args.rounds, models=[ablation(name, int(p), int(b), rounds=args.rounds, only=only) for name in args.models.split(",")
                                          for b in args.batches.split(",") for p in args.positions.split(",")])
        write_json(args.out / "decode_ablation.json", result)
        (args.out / "decode_ablation.md").write_text(ablation_summary(result))
        print(ablation_summary(result))
        return
    bw = copy_bandwidth()
    rows = [r for name in args.models.split(",") for r in profile_model(name, bw)]
    result = dict(gpu_info(), bandwidth_bytes_per_s=bw, rows=rows)
    write_json(args.out / "decode_profile.json", result)
    (args.out / "decode_profile.md").write_text(summary(result))
    print(summary(result))


if __name__ == "__main__":
    main()
