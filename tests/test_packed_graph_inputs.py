"""What a packed graph's replay reads (``engine.cuda_graphs.PackedGraphs.run``): its host
values go over in one copy of one input buffer, of which every graph input is a view. On
the CPU, with the graphs replaced by recorders of those views, each replay's inputs equal
the packing worked out token by token here, padding included (the GPU test
``test_gpu_engine.py::test_packed_graphs_give_the_eager_packed_forward`` replays the real
graphs against the eager forward)."""
import random

import torch

from woq.engine.cuda_graphs import PackedGraphs
from woq.models.batches import TILE_TOKENS
from woq.models.kv_cache import KVCache

from conftest import random_llama

SCRATCH = 6


class _Recorder:
    """Stands for one captured graph: on replay, copies of what that graph reads."""

    def __init__(self, graphs: PackedGraphs, t: int, vocab: int):
        self.graphs, self.t = graphs, t
        self.out = torch.arange(graphs._chunks(t) * vocab, dtype=torch.float32).view(-1, vocab)
        self.seen = None

    def replay(self) -> torch.Tensor:
        g, t = self.graphs, self.t
        self.seen = (g.ids[0, :t].tolist(), g.positions[0, :t].tolist(), g.slots[:t].tolist(),
                     g.last[:g._chunks(t)].tolist(), g.tiles[:g._tiles(t)].tolist())
        return self.out


def _expected(ids, lens, rows, starts, fed, t, chunks_t, tiles_t):
    """The inputs of the graph of ``t`` tokens, worked out token by token."""
    want_ids, positions, slots, last, tiles = list(ids), [], [], [], []
    if fed is not None:
        want_ids[:len(fed)] = fed
    row = 0
    for n, slot, start in zip(lens, rows, starts):
        positions += [start + i for i in range(n)]
        slots += [slot] * n
        last.append(row + n - 1)
        tiles += [[row + i, min(TILE_TOKENS, n - i), start + i, slot] for i in range(0, n, TILE_TOKENS)]
        row += n
    pad = t - len(ids)
    return (want_ids + [0] * pad, positions + [0] * pad, slots + [SCRATCH] * pad, last + [0] * (chunks_t - len(lens)),
            tiles + [[0, 0, 0, 0]] * (tiles_t - len(tiles)))


def test_a_replay_reads_the_chunks_packed_token_by_token_and_padded():
    """Random chunk sets of 1-6 chunks (decode tokens and prompt chunks, at random first
    positions), some with their first ids fed from a device tensor, replayed in random
    order so that a small step follows a large one: every view a graph reads holds the
    packing worked out token by token, its padding rows on the scratch row."""
    model = random_llama(torch.float32, "cpu", 512)
    cfg = model.cfg
    cache = KVCache(cfg.num_layers, SCRATCH + 1, cfg.num_kv_heads, 512, cfg.head_dim, model.dtype, "cpu")
    graphs = PackedGraphs(model, cache, 512, max_chunks=SCRATCH, scratch_slot=SCRATCH)
    graphs.graphs = {t: _Recorder(graphs, t, 3) for t in graphs.buckets}
    rng = random.Random(0)
    for case in range(200):
        c = rng.randint(1, SCRATCH)
        lens = [rng.choice([1, rng.randint(1, 200)]) for _ in range(c)]
        if sum(lens) > 512:
            lens = [1] * c
        rows = rng.sample(range(SCRATCH), c)
        starts = [rng.randint(0, 300) for _ in range(c)]
        ids = [rng.randint(1, cfg.vocab_size - 1) for _ in range(sum(lens))]
        fed = [rng.randint(1, cfg.vocab_size - 1) for _ in range(rng.randint(1, c))] if case % 3 == 0 else None
        out = graphs.run(ids, lens, rows, starts, None if fed is None else torch.tensor(fed))
        t = next(b for b in graphs.buckets if b >= sum(lens))
        recorder = graphs.graphs[t]
        assert recorder.seen == _expected(ids, lens, rows, starts, fed, t, graphs._chunks(t), graphs._tiles(t)), case
        assert torch.equal(out, recorder.out[:c])
