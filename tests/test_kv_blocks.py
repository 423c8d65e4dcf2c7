"""Paged-KV block pool: hash chains, LRU eviction, prefix matching, and a long random
workload checked against an independent model of ownership and cache contents."""
from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from woq.engine.kv_blocks import BlockPool, NoFreeBlocks, block_hashes


def _snapshot(pool: BlockPool) -> tuple:
    """Everything observable about the pool's state (for "nothing changed" checks)."""
    return (pool.num_free, pool.num_used, pool.num_cached, pool.stats,
            [pool.ref_count(b) for b in range(pool.num_blocks)])


def _fill(pool: BlockPool, tokens: list[int]) -> list[int]:
    """A sequence that computed ``tokens`` from scratch: fresh blocks, all full ones registered."""
    blocks = pool.allocate(-(-len(tokens) // pool.block_size))
    pool.register(blocks, tokens)
    return blocks


# ---------------------------------------------------------------- hash chains


def test_hash_chain_properties():
    rng = random.Random(0)
    toks = [rng.randrange(50_000) for _ in range(70)]
    h = block_hashes(toks, 16)
    assert len(h) == 4  # 70 tokens: 4 full blocks; the partial 5th is not hashed
    assert all(isinstance(x, bytes) and len(x) == 32 for x in h)
    assert len(set(h)) == 4
    assert block_hashes(list(toks), 16) == h  # same tokens, same hashes
    assert block_hashes(tuple(toks), 16) == h
    assert block_hashes(toks[:64], 16) == h  # the partial tail changes nothing
    assert block_hashes(toks[:63], 16) == h[:3]
    assert block_hashes(toks[:15], 16) == []

    changed = list(toks)
    changed[3] += 1  # in block 0: every hash after it changes too (chaining)
    h2 = block_hashes(changed, 16)
    assert all(a != b for a, b in zip(h, h2, strict=True))
    changed = list(toks)
    changed[40] += 1  # in block 2: blocks 0-1 unchanged, 2-3 changed
    h3 = block_hashes(changed, 16)
    assert h3[:2] == h[:2] and h3[2] != h[2] and h3[3] != h[3]
    changed = list(toks)
    changed[66] += 1  # in the unhashed partial block
    assert block_hashes(changed, 16) == h

    # Same block content at another position (after a different prefix) hashes differently.
    a = [1] * 16 + [7] * 16
    b = [2] * 16 + [7] * 16
    assert block_hashes(a, 16)[1] != block_hashes(b, 16)[1]

    # The salt (model identity) changes every hash.
    hs = block_hashes(toks, 16, salt=b"model-a")
    assert all(x != y for x, y in zip(h, hs, strict=True))
    assert all(x != y for x, y in zip(hs, block_hashes(toks, 16, salt=b"model-b"), strict=True))
    assert block_hashes(toks, 16, salt=b"model-a") == hs

    # Full 64-bit token ids count (no truncation to 32 bits), negative ids too.
    assert block_hashes([1] * 4, 4) != block_hashes([1 + (1 << 32)] + [1] * 3, 4)
    assert block_hashes([-1] * 4, 4) != block_hashes([(1 << 32) - 1] * 4, 4)
    # Block size is part of the chunking: same tokens, other size, other chain.
    assert block_hashes(toks[:32], 16)[1] != block_hashes(toks[:32], 8)[3]


def test_hashes_are_stable_across_processes():
    """Unlike hash(), the digest must not depend on the interpreter's hash seed."""
    code = ("from woq.engine.kv_blocks import block_hashes;"
            "print(block_hashes(list(range(40)), 16, b'salt')[-1].hex())")
    outs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                capture_output=True, text=True).stdout.strip())
    assert outs == {block_hashes(list(range(40)), 16, b"salt")[-1].hex()}


# ---------------------------------------------------------------- allocation and eviction


def test_fresh_pool_and_scratch_block():
    pool = BlockPool(9, 4)
    pool.check()
    assert (pool.num_free, pool.num_used) == (8, 0)
    got = pool.allocate(8)
    assert sorted(got) == list(range(1, 9))  # block 0 is never handed out
    assert (pool.num_free, pool.num_used) == (0, 8)
    pool.check()
    pool.free(got)
    assert (pool.num_free, pool.num_used) == (8, 0)
    pool.check()


def test_allocate_failure_changes_nothing():
    pool = BlockPool(6, 2)
    a = _fill(pool, [1, 2, 3, 4])  # 2 blocks, both registered
    pool.free(a)  # -> evictable
    b = pool.allocate(2)  # the 2 truly free ones (free before evictable)
    assert not set(a) & set(b)
    before = _snapshot(pool)
    assert pool.num_free == 3  # 1 free + 2 evictable
    with pytest.raises(NoFreeBlocks):
        pool.allocate(4)
    assert issubclass(NoFreeBlocks, RuntimeError)
    assert _snapshot(pool) == before  # no partial allocation, no eviction
    pool.check()
    assert pool.match_prefix([1, 2, 3, 4]) == a  # the cached blocks survived the failed call
    pool.check()


def test_eviction_is_lru_and_tail_first():
    pool = BlockPool(7, 2)  # 6 allocatable
    a = _fill(pool, [1, 2, 3, 4, 5, 6])  # 3 blocks
    b = _fill(pool, [7, 8, 9, 10])  # 2 blocks
    spare = pool.allocate(1)  # an unregistered block
    pool.free(a)  # unreferenced first -> evicted first; its tail before its head
    pool.free(b)
    pool.free(spare)  # unregistered: straight back to the free list
    assert pool.num_free == 6 and pool.num_cached == 5
    pool.check()

    assert pool.allocate(1) == spare  # truly free blocks go before any cached one
    assert pool.evictions == 0
    order = [pool.allocate(1)[0] for _ in range(5)]
    assert order == [a[2], a[1], a[0], b[1], b[0]]
    assert pool.evictions == 5 and pool.num_cached == 0
    pool.check()


def test_partial_eviction_keeps_leading_run():
    pool = BlockPool(5, 2)  # 4 allocatable
    toks = [1, 2, 3, 4, 5, 6, 7, 8]
    a = _fill(pool, toks)
    pool.free(a)
    x = pool.allocate(1)  # evicts the tail block a[3]
    assert x == [a[3]]
    # The head of the chain is still usable; matching stops at the first missing block.
    assert pool.match_prefix(toks) == a[:3]
    pool.check()


def test_referenced_blocks_are_never_evicted_and_match_leaves_lru():
    pool = BlockPool(5, 2)  # 4 allocatable
    a = _fill(pool, [1, 2, 3, 4])
    b = _fill(pool, [5, 6, 7, 8])
    pool.free(a)
    pool.free(b)  # LRU: a[1], a[0], b[1], b[0]
    got = pool.match_prefix([1, 2, 3, 4])  # takes a's blocks back out of the LRU
    assert got == a
    assert [pool.ref_count(x) for x in a] == [1, 1]
    assert pool.num_free == 2 and pool.num_used == 2
    assert pool.allocate(2) == [b[1], b[0]]  # a's blocks, though older, are referenced
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
    pool.check()
    # a is still cached and can be shared by another sequence.
    assert pool.match_prefix([1, 2, 9]) == a[:1]
    assert pool.ref_count(a[0]) == 2
    pool.check()


def test_match_prefix_returns_leading_run_and_counts_hits():
    pool = BlockPool(16, 4)
    toks = list(range(100, 116))  # 4 blocks
    a = _fill(pool, toks)
    assert pool.stats == (0, 0, 0)

    assert pool.match_prefix(toks) == a
    assert (pool.query_tokens, pool.hit_tokens) == (16, 16)
    # The partial tail is never matched.
    assert pool.match_prefix(toks + [1, 2, 3]) == a
    assert (pool.query_tokens, pool.hit_tokens) == (35, 32)
    # A change in block 2 stops the run there, though block 3's tokens still match.
    other = list(toks)
    other[9] = 0
    assert pool.match_prefix(other) == a[:2]
    assert (pool.query_tokens, pool.hit_tokens) == (51, 40)
    # A change in block 0: nothing, even though later blocks are identical.
    other = list(toks)
    other[0] = 0
    assert pool.match_prefix(other) == []
    assert pool.match_prefix(toks[:7]) == a[:1]
    assert pool.stats == (74, 44, 0)
    # Each match took one reference per returned block.
    assert [pool.ref_count(b) for b in a] == [5, 4, 3, 3]
    pool.check()


def test_register_duplicate_keeps_existing_mapping():
    pool = BlockPool(9, 2)
    toks = [1, 2, 3, 4]
    a = _fill(pool, toks)
    b = _fill(pool, toks)  # computed the same prefix concurrently: a private duplicate
    assert pool.num_cached == 2
    assert pool.match_prefix(toks) == a
    pool.free(b)  # unregistered: back to the free list, not the LRU
    assert pool.num_cached == 2 and pool.num_free == 8 - 2
    pool.check()
    pool.register(a, toks)  # registering again is idempotent
    pool.register(a, toks, start_block=1)
    assert pool.num_cached == 2
    with pytest.raises(ValueError):
        pool.register(a, [9, 9, 9, 9])  # a's blocks hold other tokens
    pool.check()


def test_register_incrementally():
    """Registering block by block as a sequence grows (resuming the chain from the
    previous block's hash, or rehashing from the start after a private duplicate) caches
    the same chain as registering everything at once."""
    toks = list(range(50, 90))  # 10 blocks of 4
    pool = BlockPool(32, 4)
    head = _fill(pool, toks[:8])  # blocks 0-1 already cached by another sequence
    blocks = pool.allocate(10)
    for n in range(1, len(toks) + 1):
        if n % 4 == 0:
            pool.register(blocks, toks[:n], start_block=n // 4 - 1)
    # Blocks 0-1 of the new sequence are duplicates; its blocks 2.. extend head's chain.
    assert pool.num_cached == 10
    assert pool.match_prefix(toks) == head + blocks[2:]
    other = list(toks)
    other[21] = 0  # in block 5
    assert pool.match_prefix(other) == head + blocks[2:5]
    pool.check()


def test_fork_shares_and_free_releases():
    pool = BlockPool(8, 2)
    a = _fill(pool, [1, 2, 3, 4])
    pool.fork(a)
    assert [pool.ref_count(b) for b in a] == [2, 2]
    pool.free(a)
    assert pool.num_used == 2 and pool.num_cached == 2
    pool.free(a)
    assert pool.num_used == 0 and pool.num_free == 7
    pool.check()
    with pytest.raises(ValueError):
        pool.free(a[:1])  # double free
    with pytest.raises(ValueError):
        pool.fork(a[:1])  # unreferenced
    with pytest.raises(ValueError):
        pool.free([0])  # the scratch block
    pool.check()


def test_prefix_caching_off():
    pool = BlockPool(6, 2, prefix_caching=False)
    toks = [1, 2, 3, 4]
    a = pool.allocate(2)
    pool.register(a, toks)
    assert pool.num_cached == 0
    assert pool.match_prefix(toks) == []
    assert pool.hit_tokens == 0
    pool.free(a)  # straight to the free list: nothing evictable, nothing evicted later
    assert pool.num_free == 5
    assert pool.match_prefix(toks) == []
    pool.allocate(5)
    assert pool.evictions == 0
    pool.check()


# ---------------------------------------------------------------- random workload


@dataclass
class _Seq:
    tokens: list[int]
    blocks: list[int]
    # Per block: how the sequence got it ("alloc": fresh, it writes the KV; "match" or
    # "fork": shared, full, read-only).
    origin: list[str] = field(default_factory=list)


class _Model:
    """Independent reference of the pool's contract, keyed by token content (tuples of
    the whole prefix a block ends) instead of hashes, with the LRU as a plain list."""

    def __init__(self, num_blocks: int, bs: int):
        self.bs = bs
        self.free: set[int] = set(range(1, num_blocks))
        self.lru: list[int] = []  # evictable, oldest first
        self.key_of: dict[int, tuple] = {}  # block -> cached prefix
        self.block_of: dict[tuple, int] = {}
        self.ref = [0] * num_blocks
        # The KV physically in each block: the full prefix it ends, once full (None while
        # partial or garbage). Set only by the sequence that allocated (writes) the block.
        self.written: dict[int, tuple | None] = {}

    def expect_alloc(self, got: list[int]) -> None:
        """Check ``got`` against the contract (free ones first, then LRU order) and apply."""
        n = len(got)
        assert len(set(got)) == n
        for b in got:
            assert self.ref[b] == 0, f"allocate handed out block {b}, still held"
        if n <= len(self.free):
            assert set(got) <= self.free
        else:
            k = n - len(self.free)
            assert set(got) == self.free | set(self.lru[:k])
            for b in self.lru[:k]:
                del self.block_of[self.key_of.pop(b)]
            del self.lru[:k]
        self.free -= set(got)
        for b in got:
            self.ref[b] = 1
            self.written[b] = None

    def expect_match(self, tokens: list[int]) -> list[int]:
        out = []
        for i in range(len(tokens) // self.bs):
            b = self.block_of.get(tuple(tokens[:(i + 1) * self.bs]))
            if b is None:
                break
            out.append(b)
        for b in out:
            if self.ref[b] == 0:
                self.lru.remove(b)
            self.ref[b] += 1
        return out

    def register(self, blocks: list[int], tokens: list[int], start: int) -> None:
        for i in range(start, len(tokens) // self.bs):
            b, key = blocks[i], tuple(tokens[:(i + 1) * self.bs])
            if b not in self.key_of and key not in self.block_of:
                self.key_of[b], self.block_of[key] = key, b

    def free_blocks(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                (self.lru.append if b in self.key_of else self.free.add)(b)

    def fork(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref[b] += 1


def _check_ledger(pool: BlockPool, model: _Model, seqs: dict[int, _Seq]) -> None:
    pool.check()
    bs = model.bs
    holders: dict[int, list[tuple[int, int]]] = {}
    for sid, s in seqs.items():
        assert len(s.blocks) == -(-len(s.tokens) // bs), "block table covers the tokens"
        for i, b in enumerate(s.blocks):
            holders.setdefault(b, []).append((sid, i))
            full = len(s.tokens) >= (i + 1) * bs
            if full:  # the KV in the block is exactly this sequence's prefix
                assert model.written[b] == tuple(s.tokens[:(i + 1) * bs]), (sid, i, b)
            else:  # being written into: must be private and freshly allocated
                assert s.origin[i] == "alloc"
    for b in range(pool.num_blocks):
        hs = holders.get(b, [])
        # Ref counts equal the number of sequences holding the block (both in the pool and
        # in the model), and block 0 is nobody's.
        assert pool.ref_count(b) == len(hs) == model.ref[b], (b, hs)
        if len(hs) > 1:
            # Shared: full everywhere, at one index, with identical token content, and at
            # most one holder got it fresh (the writer); every other one via match/fork.
            idx = {i for _, i in hs}
            assert len(idx) == 1
            i = idx.pop()
            prefixes = {tuple(seqs[sid].tokens[:(i + 1) * bs]) for sid, _ in hs}
            assert len(prefixes) == 1 and len(next(iter(prefixes))) == (i + 1) * bs
            assert sum(seqs[sid].origin[i] == "alloc" for sid, _ in hs) <= 1
    assert 0 not in holders
    assert pool.num_used == sum(r > 0 for r in model.ref)
    assert pool.num_free == len(model.free) + len(model.lru)
    assert pool.num_cached == len(model.key_of)


def _run_workload(seed: int, events: int, num_blocks: int, bs: int) -> BlockPool:
    rng = random.Random(seed)
    pool = BlockPool(num_blocks, bs, salt=b"test")
    model = _Model(num_blocks, bs)
    seqs: dict[int, _Seq] = {}
    requeued: list[list[int]] = []  # prompts of preempted sequences (recomputed later)
    next_id = 0
    # A few shared prefixes (system prompts, few-shot headers) of various lengths, some
    # not block-aligned; a tiny vocabulary so that tails sometimes coincide too.
    prefixes = [[rng.randrange(6) for _ in range(rng.randrange(0, 5 * bs))] for _ in range(6)]
    prefixes += [prefixes[0] + [rng.randrange(6) for _ in range(2 * bs)]]  # nested prefix
    counts = {"admit": 0, "admit_fail": 0, "grow": 0, "finish": 0, "preempt": 0, "fork": 0}

    def drop(sid: int) -> None:
        s = seqs.pop(sid)
        pool.free(s.blocks)
        model.free_blocks(s.blocks)

    def write_full(s: _Seq, lo: int, hi: int) -> None:
        """The sequence writes KV into its own blocks lo..hi-1 that are full now."""
        for i in range(lo, hi):
            if s.origin[i] == "alloc":
                model.written[s.blocks[i]] = tuple(s.tokens[:(i + 1) * bs])

    for _ in range(events):
        r = rng.random()
        if r < 0.25 and len(seqs) < 12:
            if requeued and rng.random() < 0.5:
                prompt = requeued.pop(rng.randrange(len(requeued)))
            else:
                prompt = rng.choice(prefixes) + [rng.randrange(6) for _ in range(rng.randrange(1, 3 * bs))]
            # The engine matches all but the last token (it needs that token's logits).
            matched = pool.match_prefix(prompt[:-1])
            assert matched == model.expect_match(prompt[:-1])
            for i, b in enumerate(matched):  # a hit returns exactly the KV of this prefix
                assert model.written[b] == tuple(prompt[:(i + 1) * bs])
            need = -(-len(prompt) // bs) - len(matched)
            try:
                fresh = pool.allocate(need)
            except NoFreeBlocks:
                assert need > len(model.free) + len(model.lru)
                pool.free(matched)
                model.free_blocks(matched)
                counts["admit_fail"] += 1
            else:
                model.expect_alloc(fresh)
                s = _Seq(list(prompt), matched + fresh, ["match"] * len(matched) + ["alloc"] * need)
                seqs[next_id] = s
                next_id += 1
                write_full(s, len(matched), len(prompt) // bs)
                pool.register(s.blocks, s.tokens, start_block=len(matched))
                model.register(s.blocks, s.tokens, len(matched))
                counts["admit"] += 1
        elif r < 0.80 and seqs:
            sid = rng.choice(list(seqs))
            s = seqs[sid]
            if len(s.tokens) % bs == 0:  # the next token starts a new block
                try:
                    got = pool.allocate(1)
                except NoFreeBlocks:
                    assert not model.free and not model.lru
                    requeued.append(s.tokens)
                    drop(sid)  # preempted for lack of memory
                    counts["preempt"] += 1
                    _check_ledger(pool, model, seqs)
                    continue
                model.expect_alloc(got)
                s.blocks += got
                s.origin.append("alloc")
            s.tokens.append(rng.randrange(6))
            if len(s.tokens) % bs == 0:
                i = len(s.tokens) // bs - 1
                write_full(s, i, i + 1)
                pool.register(s.blocks, s.tokens, start_block=i)
                model.register(s.blocks, s.tokens, i)
            counts["grow"] += 1
        elif r < 0.88 and seqs:
            drop(rng.choice(list(seqs)))
            counts["finish"] += 1
        elif r < 0.93 and seqs:
            sid = rng.choice(list(seqs))
            requeued.append(seqs[sid].tokens)
            drop(sid)
            counts["preempt"] += 1
        elif seqs and len(seqs) < 12:
            # n > 1 choices: share the full blocks, copy the partial tail into a fresh one.
            s = seqs[rng.choice(list(seqs))]
            n_full = len(s.tokens) // bs
            shared = s.blocks[:n_full]
            pool.fork(shared)
            model.fork(shared)
            tail = []
            if len(s.blocks) > n_full:
                try:
                    tail = pool.allocate(1)
                except NoFreeBlocks:
                    pool.free(shared)
                    model.free_blocks(shared)
                    _check_ledger(pool, model, seqs)
                    continue
                model.expect_alloc(tail)
            seqs[next_id] = _Seq(list(s.tokens), shared + tail, ["fork"] * n_full + ["alloc"] * len(tail))
            next_id += 1
            counts["fork"] += 1
        _check_ledger(pool, model, seqs)

    # Every kind of event happened, and the cache did work.
    assert all(v > 0 for v in counts.values()), counts
    assert pool.hit_tokens > 0 and pool.evictions > 0
    assert 0 < pool.hit_tokens <= pool.query_tokens
    for sid in list(seqs):
        drop(sid)
        _check_ledger(pool, model, seqs)
    # Nothing leaked: every block is allocatable again.
    assert pool.num_used == 0 and pool.num_free == num_blocks - 1
    assert sorted(pool.allocate(num_blocks - 1)) == list(range(1, num_blocks))
    return pool


@pytest.mark.parametrize("seed,bs,num_blocks", [(0, 4, 48), (1, 2, 40)])
def test_random_workload_against_reference(seed, bs, num_blocks):
    _run_workload(seed, 5_000, num_blocks, bs)
