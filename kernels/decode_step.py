"""The persistent batch-1 decode step (``csrc/decode_step.cuh``): all decoder layers of a
Llama-family model in one kernel launch, the weights streamed through a shared-memory ring
that never waits for activations, the layers' stages ordered by counters in global memory
instead of kernel boundaries.

``DecodeStep`` holds what the kernel reads besides each step's inputs: the layer table
(pointers to every weight, norm and cache and to the KV cache's block table, built once),
the step's buffers and its counters. It takes int4 g128 weights (with or without zero
points) in the GPU layout, fp16 or bf16, on sm_90; ``DecodeStep.supported`` says whether a
model's layers qualify.

Under tensor parallelism the layers are a rank's shards (qkv and gate/up its heads and
intermediate rows, o and down their columns) and every rank runs the step together: o's and
down's partial sums go to every rank's step area (``PeerAllReduce.step_areas``), which
orders the stages across the GPUs.
"""
from __future__ import annotations

import torch

from .device import sm_count, sm_major
from .layout import GpuWeight
from .options import DecodeStepOptions


class DecodeStep:
    """One decode step of ``layers`` for a batch of one sequence.

    ``layers``: per decoder layer, ``(qkv, o, gate_up, down, input_norm_weight,
    post_norm_weight)`` with the four weights as ``GpuWeight`` (gate/up with SwiGLU-
    interleaved rows); ``k_caches``/``v_caches``: per layer the paged cache ``[blocks,
    kv_heads, block_size, head_dim]`` (contiguous, ``block_size`` a power of two);
    ``block_table``: int32 ``[rows, blocks_per_row]``, every layer's (``models/kv_cache.py``:
    position t of row r is in block ``block_table[r, t // block_size]``), rewritten in place
    by its owner, never reallocated (the layer table holds its address); ``cos``/``sin``: the
    fp32 RoPE tables ``[positions, head_dim]``. ``heads``: the query heads of ``layers``
    (a rank's under tensor parallelism). ``peer_areas``: with two ranks or more, every rank's
    step area as opened here (``PeerAllReduce.step_areas``), and ``rank`` this one's.
    """

    def __init__(self, layers: list[tuple], k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 block_table: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int,
                 eps: float, options: DecodeStepOptions = DecodeStepOptions(), shares: int | None = None,
                 rank: int = 0, peer_areas: list[int] = ()):
        qkv0, o0, _, down0 = layers[0][:4]
        device, dtype = k_caches[0].device, o0.dtype
        kv_heads = k_caches[0].shape[1]
        # Shares of the live tokens per KV head (attention roles = kv_heads x shares, no more
        # than the SMs): each share is one block's work, at least a 64-token tile, so a short
        # sequence uses few of them; several are merged by the first (csrc/attention.cuh).
        if shares is None:  # the largest power of two the SMs hold, up to max_shares
            shares = 1
            max_shares = min(options.max_shares, torch.ops.woq.constant("step_max_shares"))
            while 2 * shares <= max_shares and kv_heads * 2 * shares <= sm_count(device):
                shares *= 2
        self.weights = [w for layer in layers for w in layer[:4]]  # (kept alive: the table points at them)
        self.norms = [n for layer in layers for n in layer[4:]]
        # (n-tiles, k-tiles, padded scale groups of each linear: the same in every layer)
        self.shapes = [w.n_tiles for w in layers[0][:4]] + [w.qweight.shape[1] for w in layers[0][:4]] + \
            [w.scales.shape[1] for w in layers[0][:4]]
        self.zeros = qkv0.zeros is not None
        self.eps, self.roles, self.kv_heads = eps, kv_heads * shares, kv_heads
        self.cache_hints, self.ring_slots = options.cache_hints, options.ring_slots
        self.rank, self.peer_areas = rank, list(peer_areas)
        self.qkv = torch.empty(qkv0.N, device=device, dtype=dtype)
        self.attn = torch.empty(heads * head_dim, device=device, dtype=dtype)
        self.act = torch.empty(down0.K, device=device, dtype=dtype)
        self.part = torch.empty(1, shares, heads, head_dim, device=device, dtype=torch.float32)
        # (a KV head's group of query heads in one 32-byte slot: csrc/attention.cuh)
        self.lse = torch.empty(1, shares, kv_heads, torch.ops.woq.constant("attention_max_group"), device=device,
                               dtype=torch.float32)
        self.merge_counters = torch.zeros(kv_heads, device=device, dtype=torch.int32)
        # (one per layer and stage, and the exit count: decode_step_counters in csrc/decode_step.cu)
        self.counters = torch.zeros(torch.ops.woq.decode_step_counters(len(layers)), device=device,
                                    dtype=torch.int32)
        # (a timed step's %globaltimer stamps: each block's end of each (layer, stage), then the
        # start, in column 0; zeros elsewhere, so a row's max is its latest stamp: kernels/observe.py)
        self.stamps = torch.zeros(torch.ops.woq.decode_step_counters(len(layers)), sm_count(device), device=device,
                                  dtype=torch.int64)
        self.block_table = block_table  # (kept alive, as the caches: the table points at them)
        self.caches = (k_caches, v_caches, cos, sin)
        self.table = torch.ops.woq.decode_step_plan(
            [w.qweight for w in self.weights], [w.scales for w in self.weights],
            [w.zeros for w in self.weights] if self.zeros else [], self.norms, k_caches, v_caches, block_table,
            self.qkv, self.attn, self.part, self.lse, self.merge_counters, cos, sin, heads, head_dim)

    @staticmethod
    def supported(layers: list[tuple[GpuWeight, ...]], device: torch.device) -> bool:
        """Whether the kernel takes these layers' ``(qkv, o, gate_up, down)`` weights here:
        int4 g128, all with zero points or none, fp16/bf16, a hidden size of at most the
        kernel's (``step_max_hidden``) that o maps back to (from heads x head_dim: the hidden
        size, or a tensor-parallel rank's share of whole groups), at most
        ``step_max_staged_units`` n-tiles of a weight an SM (a block's outputs of a
        stage are staged in shared memory for their bulk stores), the same shapes in every layer."""
        if device.type != "cuda" or sm_major(device) != 9:
            return False
        qkv, o, gate_up, down = layers[0]
        hidden = o.N
        if not (hidden == qkv.K == gate_up.K == down.N and gate_up.N == 2 * down.K and gate_up.swiglu_rows
                and (o.K == hidden or o.K % 128 == 0) and hidden % 16 == 0
                and hidden <= torch.ops.woq.constant("step_max_hidden") and down.K % 128 == 0):
            return False
        staged = torch.ops.woq.constant("step_max_staged_units")
        if any(-(-w.n_tiles // sm_count(device)) > staged for w in layers[0]):
            return False
        zeros = qkv.zeros is not None
        return all(w.bits == 4 and w.group_size == 128 and (w.zeros is not None) == zeros and w.dtype == o.dtype
                   and w.dtype in (torch.float16, torch.bfloat16) and (w.N, w.K) == (ref.N, ref.K)
                   for layer in layers for w, ref in zip(layer, layers[0]))

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 lengths: torch.Tensor, stamps: torch.Tensor | None = None) -> torch.Tensor:
        """The residual stream after every layer for the embedding ``h`` ``[hidden]`` (in
        place), the token at ``positions[0]`` of block-table row ``slots[0]`` cached, attention
        over ``lengths[0]`` positions; with ``stamps`` (``self.stamps``) the stages' end times
        written there. Launch-only: a CUDA graph captures it."""
        torch.ops.woq.decode_step(h, positions, slots, lengths, self.table, self.qkv, self.attn, self.act,
                                  self.counters, self.shapes, 4, 128, self.zeros, self.eps, self.roles,
                                  self.kv_heads, self.cache_hints, self.ring_slots, stamps, self.rank,
                                  self.peer_areas)
        return h
