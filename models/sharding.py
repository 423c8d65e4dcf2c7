"""Tensor-parallel shards of quantized linear weights, in the logical format.

A rank of a TP group holds, of each decoder layer:

* **column-parallel** weights, split along N (output rows): qkv by heads, gate/up by
  intermediate rows (an even share: each rank's gate rows and up rows, so that the SwiGLU
  interleave of ``kernels/format.py`` is built per shard and the fused epilogue still
  pairs a gate row with its up row). Heads split by KV group (``qkv_heads``): with at
  least as many KV heads as ranks, each rank takes a contiguous run of KV heads, as even
  as possible (larger runs on lower ranks), and all of their query heads; with fewer, each
  rank keeps one KV head (replicated on the ranks sharing it), the ranks spread over the
  KV heads as evenly as possible, and the ranks sharing a KV head split its query heads.
  A rank's attention then reads only the KV heads it holds, whatever the split (SmolLM2's
  9 query and 3 KV heads go over 2 or 4 ranks);
* **row-parallel** weights, split along K (input columns): o and down. Each rank's input is
  its column-parallel neighbour's output, so the split follows the input's natural order
  (o: the rank's query heads' columns; down: its intermediate rows), and the partial
  outputs are summed (all-reduce). A shard whose boundaries fall on group boundaries (a
  group's scale covers K elements of one rank) is the weight's column slice; one that cuts
  a group is built like an act-order shard (below) with the identity permutation: each
  cut group's run of the rank's columns is padded to the group size. Per-channel weights
  split anywhere (the row's one scale goes to every shard).

Act-order (GPTQ ``g_idx``) imports hold contiguous groups over permuted input columns and
the permutation (``ImportedLinear.in_perm``, ``models/imported.py``). A rank's input
columns are then scattered over the groups: its shard takes, group by group, the permuted
columns whose original index is its own, and pads each group's run to the group size with
codes equal to their zero point. A padded column dequantizes to exactly 0, so it adds
nothing to the output whatever the input value it gathers; the shard's K grows by the
padding (at most one partial group per group a rank touches).

Every shard holds the very codes, scales and zero points of the full weight (no
requantization), so the shards' partial products add up to the full layer's exactly in
exact arithmetic: ``tests/test_sharding.py``. ``TensorParallel`` is a rank's place in its
group: the builder splits each layer with it. A rank reads only its share,
``output_rows`` / ``input_columns``, widened to whole groups where its columns cut one,
from a safetensors checkpoint of dense weights (then quantized), a GPTQ/AWQ import or a
woq checkpoint (``models/builder.py``); where a share cannot be read alone, the layer is
read whole, then split. The model's config
takes the rank's shapes (which may differ between ranks), and the forward sums o's and
down's outputs over the group (``Pass.summed`` in ``models/llama.py``). The embedding and
the LM head are **vocab-parallel** where the vocabulary splits evenly: each rank holds its
share of their rows; a token's embedding comes from the rank holding it (the others add
zeros to the all-reduce), and each rank's logits of its rows are gathered into the whole
vocabulary's on every rank (sampling reads them all). Otherwise both stay whole on every
rank (``tests/test_tensor_parallel.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..kernels.format import QuantizedWeight, pack_codes
from .config import ArchConfig
from .imported import ImportedLinear


class ShardError(ValueError):
    """A weight that cannot be split this way (the message says why)."""


def rows(qw: QuantizedWeight, index: torch.Tensor) -> QuantizedWeight:
    """The weight's output rows ``index`` (a long tensor), in that order."""
    return replace(qw, packed=qw.packed[index], scales=qw.scales[index],
                   zeros=None if qw.zeros is None else qw.zeros[index], out_features=len(index))


def _even_share(n: int, rank: int, tp: int, what: str) -> range:
    if n % tp:
        raise ShardError(f"{what} ({n}) does not split over {tp} ranks")
    share = n // tp
    return range(rank * share, (rank + 1) * share)


def _split(n: int, parts: int, i: int) -> range:
    """Part ``i`` of ``n`` items cut into ``parts`` contiguous runs, as even as possible,
    the larger runs first."""
    share, extra = divmod(n, parts)
    start = i * share + min(i, extra)
    return range(start, start + share + (i < extra))


def qkv_heads(heads: int, kv_heads: int, rank: int, tp: int) -> tuple[range, range]:
    """The query heads and the KV heads rank ``rank`` computes, split by KV group (module
    docstring): with ``kv_heads >= tp``, a contiguous run of KV heads and all their query
    heads; otherwise the one KV head its query heads read (replicated on the ranks sharing
    it), those ranks splitting its query heads. Even splits are equal shares of each.

    Uneven runs go to the lower ranks: rank 0 then holds at least as many KV heads (and
    query heads) as any other rank. It must: rank 0 sizes the KV cache for the group, as
    many blocks as fit its own memory, and every rank allocates that many blocks for its
    own KV heads (``engine/tensor_parallel.py``), so no rank's blocks may outgrow rank 0's."""
    if kv_heads < 1 or heads % kv_heads:
        raise ShardError(f"{heads} attention heads do not group over {kv_heads} KV heads")
    group = heads // kv_heads
    if kv_heads >= tp:
        kv = _split(kv_heads, tp, rank)
        return range(kv.start * group, kv.stop * group), kv
    # Fewer KV heads than ranks: KV head k is kept by the ranks _split(tp, kv_heads, k).
    # (Every rank checks the most shared KV head, 0, so that all of them refuse alike.)
    sharing = len(_split(tp, kv_heads, 0))
    if group < sharing:
        raise ShardError(f"{heads} attention heads ({kv_heads} KV heads) cannot be split over {tp} ranks: "
                         f"{sharing} ranks would share KV head 0 and its {group} query head{'s' * (group > 1)}")
    k = next(k for k in range(kv_heads) if rank in _split(tp, kv_heads, k))
    ranks = _split(tp, kv_heads, k)
    q = _split(group, len(ranks), rank - ranks.start)
    return range(k * group + q.start, k * group + q.stop), range(k, k + 1)


def qkv_rows(heads: int, kv_heads: int, head_dim: int, rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s rows of the fused ``[q; k; v]`` weight: its query heads, then its KV
    heads' k rows, then their v rows (the order a rank's attention splits them in)."""
    q, kv = qkv_heads(heads, kv_heads, rank, tp)

    def head_rows(first_head: int, hs: range) -> list[int]:
        return [(first_head + h) * head_dim + d for h in hs for d in range(head_dim)]

    return torch.tensor(head_rows(0, q) + head_rows(heads, kv) + head_rows(heads + kv_heads, kv))


def gate_up_rows(inter: int, rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s rows of the fused ``[gate; up]`` weight (not interleaved): its share
    of the gate rows, then the same share of the up rows."""
    share = _even_share(inter, rank, tp, "intermediate rows")
    return torch.tensor(list(share) + [inter + r for r in share])


def _columns(qw: QuantizedWeight, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
             group_size: int) -> QuantizedWeight:
    K = codes.shape[1]
    if qw.bits == 4 and K % 2:
        raise ShardError(f"an int4 shard needs an even number of input columns, not {K}")
    return QuantizedWeight(pack_codes(codes, qw.bits), scales, zeros, qw.bits, group_size, K, qw.out_features)


def whole_groups(own: range, group: int, K: int) -> tuple[int, int]:
    """The columns ``[lo, hi)`` of the groups of ``group`` columns that input columns ``own``
    of a ``K``-column weight touch (the last group may be the weight's partial one): what a
    rank reads to quantize, or take the groups of, a share that cuts a group."""
    return own.start // group * group, min(-(-own.stop // group) * group, K)


def row_shard(linear: ImportedLinear, own: range) -> ImportedLinear:
    """The weight's input columns ``own`` (a rank's, in the input's order): their column
    slice where ``own`` starts and ends on group boundaries (or at K), else, as for
    act-order weights, each touched group's run padded to the group size (module
    docstring). Its ``in_perm`` (None for a slice) indexes the rank's own input."""
    qw = linear.weight
    K, G = qw.in_features, qw.group_size
    if not (0 <= own.start < own.stop <= K and own.step == 1):
        raise ShardError(f"input columns {own.start}..{own.stop} are not a share of {K}")
    codes = qw.codes()
    if qw.per_channel:  # one scale per row, whatever the columns (in the input's order)
        if linear.in_perm is not None:
            codes = codes[:, torch.argsort(linear.in_perm.long())]
        return ImportedLinear(_columns(qw, codes[:, own.start:own.stop], qw.scales, qw.zeros, len(own)))
    if linear.in_perm is None and own.start % G == 0 and (own.stop % G == 0 or own.stop == K):
        g = slice(own.start // G, -(-own.stop // G))  # (the last group may be the weight's partial one)
        zeros = None if qw.zeros is None else qw.zeros[:, g]
        return ImportedLinear(_columns(qw, codes[:, own.start:own.stop], qw.scales[:, g], zeros, G))
    # Act-order, or columns that cut a group (the identity order): column j of the weight
    # multiplies input column perm[j]. A shard's groups are G consecutive columns each, so
    # a run shorter than a group is padded to one: the next run stays under its own scale.
    perm = torch.arange(K) if linear.in_perm is None else linear.in_perm.long().cpu()
    mine = (perm >= own.start) & (perm < own.stop)
    zero_points = qw.zero_points()
    cols, local, groups = [], [], []
    for g in range(qw.num_groups):
        j = torch.nonzero(mine[g * G:(g + 1) * G]).flatten() + g * G
        if len(j) == 0:
            continue
        pad = G - len(j)
        # padded columns: the row's zero point (dequantizes to 0), gathering input column 0
        cols.append(torch.cat([codes[:, j], zero_points[:, g:g + 1].expand(-1, pad)], 1))
        local.append(torch.cat([perm[j] - own.start, torch.zeros(pad, dtype=torch.long)]))
        groups.append(g)
    index = torch.tensor(groups)
    zeros = None if qw.zeros is None else qw.zeros[:, index]
    shard = _columns(qw, torch.cat(cols, 1), qw.scales[:, index], zeros, G)
    return ImportedLinear(shard, torch.cat(local))


def check_split(cfg: ArchConfig, size: int) -> None:
    """Refuse (``ShardError``) a model whose heads or intermediate rows do not split over
    ``size`` ranks, as each rank's build would (``TensorParallel.local_config``): checked
    before the ranks start, so that a split the model cannot take ends in one line
    without N processes loading torch first."""
    for rank in range(size):
        TensorParallel(rank, size).local_config(cfg)


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group: ``rank`` of ``size`` ranks of the
    ``torch.distributed`` process ``group`` (None: the default group). ``peer``: the group's
    peer-memory all-reduce (``kernels/peer_all_reduce.py``) for the messages it takes, or
    None: NCCL (gloo on the CPU) for all."""

    rank: int
    size: int
    group: object = None
    peer: object = None

    def local_config(self, cfg: ArchConfig) -> ArchConfig:
        """The per-rank shapes: its query heads, the KV heads they read, its intermediate rows."""
        q, kv = qkv_heads(cfg.num_heads, cfg.num_kv_heads, self.rank, self.size)
        inter = _even_share(cfg.intermediate_size, self.rank, self.size, "intermediate rows")
        return replace(cfg, num_heads=len(q), num_kv_heads=len(kv), intermediate_size=len(inter))

    def vocab_rows(self, vocab: int) -> range | None:
        """This rank's share of the vocabulary (its rows of the embedding and the LM head);
        None where the vocabulary does not split evenly: both stay whole on every rank."""
        if self.size == 1 or vocab % self.size:
            return None
        return _even_share(vocab, self.rank, self.size, "vocabulary")

    def input_columns(self, kind: str, cfg: ArchConfig) -> range:
        """This rank's input columns of a row-parallel layer: o's are its query heads'
        (``qkv_heads``: an uneven split gives ranks different counts), down's its share of
        the intermediate rows (``gate_up_rows``)."""
        if kind == "o":
            q, _ = qkv_heads(cfg.num_heads, cfg.num_kv_heads, self.rank, self.size)
            return range(q.start * cfg.head_dim, q.stop * cfg.head_dim)
        if kind == "down":
            return _even_share(cfg.intermediate_size, self.rank, self.size, "intermediate rows")
        raise ShardError(f"a {kind} layer is not row-parallel")

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' ``x`` side by side along the last dimension, in rank order (the LM
        head's logits of each rank's vocabulary rows: the whole vocabulary's)."""
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def minimum(self, values: list[int], device: torch.device) -> list[int]:
        """Each of ``values``' smallest over the group (a collective: every rank calls it)."""
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return t.tolist()

    def all_reduce(self, y: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel layer's partial outputs (or the embedding's) over the group, in place."""
        if self.peer is not None and self.peer.takes(y):
            return self.peer(y)
        import torch.distributed as dist

        dist.all_reduce(y, group=self.group)
        return y

    def output_rows(self, kind: str, cfg: ArchConfig) -> torch.Tensor | None:
        """The rows of a column-parallel layer (qkv, gate_up, a vocab-parallel LM head) this
        rank keeps, in its order (increasing); None for any other layer."""
        if kind == "qkv":
            return qkv_rows(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.rank, self.size)
        if kind == "gate_up":
            return gate_up_rows(cfg.intermediate_size, self.rank, self.size)
        share = self.vocab_rows(cfg.vocab_size) if kind == "lm_head" else None
        return None if share is None else torch.arange(share.start, share.stop)

    def shard_bias(self, kind: str, cfg: ArchConfig, bias: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's bias of a layer of ``kind``: its rows' of a column-parallel layer; a
        row-parallel layer's on rank 0 only (the all-reduce adds it once); a whole LM head's."""
        if bias is None:
            return None
        index = self.output_rows(kind, cfg)
        if index is not None:
            return bias[index.to(bias.device)]
        return bias if kind == "lm_head" or self.rank == 0 else None

    def shard(self, kind: str, cfg: ArchConfig, weight: QuantizedWeight | torch.Tensor,
              in_perm: torch.Tensor | None, bias: torch.Tensor | None):
        """This rank's ``(weight, in_perm, bias)`` of a layer of ``kind`` (qkv, o, gate_up,
        down, lm_head: its ``vocab_rows``, or whole), quantized or dense (``shard_bias``)."""
        index = self.output_rows(kind, cfg)
        if index is None and kind not in ("o", "down", "lm_head"):
            raise ShardError(f"no tensor-parallel split for a {kind} layer")
        bias = self.shard_bias(kind, cfg, bias)
        if index is None and kind == "lm_head":
            return weight, in_perm, bias
        if index is None:  # (o, down)
            own = self.input_columns(kind, cfg)
            if isinstance(weight, torch.Tensor):
                return weight[:, own.start:own.stop].contiguous(), None, bias
            shard = row_shard(ImportedLinear(weight, in_perm), own)
            return shard.weight, shard.in_perm, bias
        if isinstance(weight, torch.Tensor):
            return weight[index.to(weight.device)].contiguous(), in_perm, bias
        return rows(weight, index.to(weight.packed.device)), in_perm, bias
