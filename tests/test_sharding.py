"""Tensor-parallel shards of quantized weights (``models/sharding.py``): every shard holds
the full weight's own codes, scales and zero points, and the shards' partial products add
up to the full layer's (fp64 references of the exactly dequantized weights)."""
import pytest
import torch

from woq.kernels.format import QuantSpec, quantize
from woq.kernels.reference import dequantize
from woq.models.importers import ImportedLinear
from woq.models.sharding import ShardError, gate_up_rows, qkv_heads, qkv_rows, row_shard, rows

SPECS = [QuantSpec(4, 32, False), QuantSpec(4, 32, True), QuantSpec(8, 64, False), QuantSpec(4, None, False),
         QuantSpec(8, None, True)]


def _weight(n: int, k: int, spec: QuantSpec, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(n, k, generator=g), spec)


def _deq(qw) -> torch.Tensor:
    return dequantize(qw, torch.float64)


def _act_order(qw, seed: int) -> ImportedLinear:
    """An act-order import of ``qw`` as ``models/importers.py`` builds one: its columns in a
    random order, regrouped contiguously, with the permutation to gather the input by (the
    weight is then a different one, but a valid act-order weight in its own right)."""
    perm = torch.randperm(qw.in_features, generator=torch.Generator().manual_seed(seed))
    return ImportedLinear(qw, perm)


def _full_product(linear: ImportedLinear, x: torch.Tensor) -> torch.Tensor:
    if linear.in_perm is not None:
        x = x[:, linear.in_perm]
    return x @ _deq(linear.weight).T


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
@pytest.mark.parametrize("tp", [2, 4])
def test_column_shards_are_the_full_weights_rows(spec, tp):
    qw = _weight(96, 128, spec)
    share = qw.out_features // tp
    shards = [rows(qw, torch.arange(r * share, (r + 1) * share)) for r in range(tp)]
    assert torch.equal(torch.cat([s.packed for s in shards]), qw.packed)
    assert torch.equal(torch.cat([s.scales for s in shards]), qw.scales)
    assert torch.equal(torch.cat([_deq(s) for s in shards]), _deq(qw))


@pytest.mark.parametrize("heads,kv_heads,tp", [(8, 8, 2), (8, 4, 4), (8, 2, 4), (32, 8, 4), (8, 1, 2), (9, 3, 2),
                                               (9, 3, 4), (12, 3, 4), (9, 3, 6), (10, 5, 3)])
def test_qkv_shards_hold_their_heads_and_the_kv_heads_those_read(heads, kv_heads, tp):
    D = 16
    qw = _weight((heads + 2 * kv_heads) * D, 64, QuantSpec(4, 32, False))
    full = _deq(qw)
    q_rows, k_rows, v_rows = full.split([heads * D, kv_heads * D, kv_heads * D])
    group = heads // kv_heads
    computed = []
    for r in range(tp):
        q, kv = qkv_heads(heads, kv_heads, r, tp)
        assert all(h // group in kv for h in q)  # (its query heads read only its KV heads)
        assert all(any(h // group == k for h in q) for k in kv)  # (and it holds no other)
        computed += list(q)
        got = _deq(rows(qw, qkv_rows(heads, kv_heads, D, r, tp)))
        want = torch.cat([q_rows.view(heads, D, -1)[list(q)].reshape(-1, 64),
                          k_rows.view(kv_heads, D, -1)[list(kv)].reshape(-1, 64),
                          v_rows.view(kv_heads, D, -1)[list(kv)].reshape(-1, 64)])
        assert torch.equal(got, want), r
    assert computed == list(range(heads))  # (every query head on one rank, in rank order)


@pytest.mark.parametrize("heads,kv_heads,tp,want", [
    # (query heads, KV heads) of each rank: KV heads split, larger runs first ...
    (9, 3, 2, [((0, 6), (0, 2)), ((6, 9), (2, 3))]),
    (10, 5, 3, [((0, 4), (0, 2)), ((4, 8), (2, 4)), ((8, 10), (4, 5))]),
    # ... or a KV head a rank, lower KV heads on more ranks, its query heads split larger first
    (9, 3, 4, [((0, 2), (0, 1)), ((2, 3), (0, 1)), ((3, 6), (1, 2)), ((6, 9), (2, 3))]),
    (12, 3, 4, [((0, 2), (0, 1)), ((2, 4), (0, 1)), ((4, 8), (1, 2)), ((8, 12), (2, 3))]),
    (6, 2, 4, [((0, 2), (0, 1)), ((2, 3), (0, 1)), ((3, 5), (1, 2)), ((5, 6), (1, 2))]),
])
def test_uneven_heads_split_by_kv_group(heads, kv_heads, tp, want):
    got = [qkv_heads(heads, kv_heads, r, tp) for r in range(tp)]
    assert [((q.start, q.stop), (kv.start, kv.stop)) for q, kv in got] == want
    assert all(len(got[0][1]) >= len(kv) for _, kv in got)  # (rank 0 sizes the KV cache: the most KV heads)


def test_qkv_shards_refuse_a_kv_head_with_fewer_query_heads_than_ranks():
    with pytest.raises(ShardError, match=r"2 attention heads \(2 KV heads\) cannot be split over 3 ranks"):
        qkv_rows(2, 2, 16, 2, 3)  # (every rank refuses, not only those sharing a KV head)
    with pytest.raises(ShardError, match=r"3 attention heads \(1 KV heads\) cannot be split over 4 ranks"):
        qkv_heads(3, 1, 0, 4)


@pytest.mark.parametrize("tp", [2, 4])
def test_gate_up_shards_pair_each_gate_row_with_its_up_row(tp):
    inter = 64
    qw = _weight(2 * inter, 96, QuantSpec(4, 32, False))
    gate, up = _deq(qw).split(inter)
    for r in range(tp):
        shard = _deq(rows(qw, gate_up_rows(inter, r, tp)))
        share = slice(r * inter // tp, (r + 1) * inter // tp)
        assert torch.equal(shard, torch.cat([gate[share], up[share]])), r


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("act_order", [False, True])
def test_row_shards_add_up_to_the_full_layer(spec, tp, act_order):
    """Each rank's shard of an [N, K] weight takes its K / tp input columns (in the input's
    order); the partial products over the shards sum to the full product (fp64, to
    rounding), and without act-order each shard's weight is the full one's column slice."""
    N, K = 48, 256
    qw = _weight(N, K, spec, seed=tp)
    linear = _act_order(qw, seed=tp) if act_order else ImportedLinear(qw)
    x = torch.randn(5, K, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    total = torch.zeros(5, N, dtype=torch.float64)
    for r in range(tp):
        own = slice(r * K // tp, (r + 1) * K // tp)
        shard = row_shard(linear, range(own.start, own.stop))
        assert shard.weight.scales.dtype == qw.scales.dtype and shard.weight.bits == qw.bits
        total += _full_product(shard, x[:, own])
        if not act_order:
            assert shard.in_perm is None and torch.equal(_deq(shard.weight), _deq(qw)[:, own])
    assert torch.allclose(total, _full_product(linear, x), rtol=1e-12, atol=1e-9)


def test_act_order_shards_hold_each_of_their_columns_once_and_pad_with_zeros():
    """Every input column of a rank appears once among its shard's real columns, with the
    full weight's codes; the padding columns dequantize to exactly 0."""
    qw = _weight(16, 128, QuantSpec(4, 32, False))
    linear = _act_order(qw, seed=3)
    full = _deq(qw)  # column j multiplies input column perm[j]
    perm = linear.in_perm
    for r in range(2):
        shard = row_shard(linear, range(64 * r, 64 * (r + 1)))
        w = _deq(shard.weight)
        assert shard.weight.in_features % 32 == 0 and shard.weight.in_features >= 64
        real = w.abs().sum(0) != 0
        seen = []
        for j in range(w.shape[1]):
            if not real[j]:
                continue
            col = int(shard.in_perm[j]) + 64 * r  # the input column it gathers
            seen.append(col)
            assert torch.equal(w[:, j], full[:, (perm == col).nonzero().item()])
        assert sorted(seen) == list(range(64 * r, 64 * (r + 1)))


# Input columns of o over the ranks of uneven head splits (head_dim 16 and 64): boundaries
# within groups, and a last group the weight itself holds partly (K = 144 over g32, 576 over g128).
UNEVEN = {"9 heads over 4 ranks, g32": (144, [0, 32, 48, 96, 144]),
          "9 heads over 2 ranks, g32": (144, [0, 96, 144]),
          "SmolLM2 over 4 ranks, g128": (576, [0, 128, 192, 384, 576])}
UNEVEN_SPECS = [QuantSpec(4, 32, False), QuantSpec(8, 32, True), QuantSpec(4, None, False), QuantSpec(4, 128, True),
                QuantSpec(4, 128, False)]


@pytest.mark.parametrize("spec", UNEVEN_SPECS, ids=lambda s: s.describe())
@pytest.mark.parametrize("split", UNEVEN)
@pytest.mark.parametrize("act_order", [False, True])
def test_uneven_row_shards_add_up_to_the_full_layer(spec, split, act_order):
    """Shards of uneven column ranges that cut groups: their partial products sum to the full
    layer's (fp64); a shard that cuts no group is the weight's column slice, one that does
    pads each cut group's run (identity order: in_perm gathers the rank's columns)."""
    K, bounds = UNEVEN[split]
    N = 24
    qw = _weight(N, K, spec, seed=K)
    linear = _act_order(qw, seed=5) if act_order else ImportedLinear(qw)
    x = torch.randn(3, K, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    total = torch.zeros(3, N, dtype=torch.float64)
    G = qw.group_size
    for lo, hi in zip(bounds, bounds[1:]):
        shard = row_shard(linear, range(lo, hi))
        total += _full_product(shard, x[:, lo:hi])
        if act_order or qw.per_channel:
            continue
        if lo % G == 0 and (hi % G == 0 or hi == K):
            assert shard.in_perm is None and torch.equal(_deq(shard.weight), _deq(qw)[:, lo:hi])
        else:
            w, perm = _deq(shard.weight), shard.in_perm
            assert shard.weight.in_features % G == 0 and len(perm) == shard.weight.in_features
            real = perm + lo  # (the input column each gathers; a pad column, lo, with zero weights)
            pads = w.abs().sum(0) == 0
            assert sorted(real[~pads].tolist()) == list(range(lo, hi))
            assert torch.equal(w[:, ~pads], _deq(qw)[:, real[~pads]])
            assert len(w.T) - int(pads.sum()) == hi - lo
    assert torch.allclose(total, _full_product(linear, x), rtol=1e-12, atol=1e-9)


def test_row_shards_refuse_what_they_cannot_hold():
    with pytest.raises(ShardError, match="even number"):
        row_shard(ImportedLinear(_weight(16, 6, QuantSpec(4, None, False))), range(0, 3))  # 3 int4 columns
    with pytest.raises(ShardError, match="not a share of 96"):
        row_shard(ImportedLinear(_weight(16, 96, QuantSpec(8, None, False))), range(64, 128))
