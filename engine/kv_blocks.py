"""Host-side allocator of paged-KV blocks, with automatic prefix caching.

KV lives in fixed-size blocks of ``block_size`` tokens drawn from one pool of
``num_blocks``. Block 0 is scratch (padding rows of CUDA graphs write there) and is never
handed out. A running sequence owns a block table (a list of block ids); block ``i`` of it
holds the KV of tokens ``[i*bs, (i+1)*bs)``.

Every block 1..num_blocks-1 is in exactly one of three states:

* free        - ref count 0, no hash: content is garbage, allocatable at once;
* evictable   - ref count 0 but registered under a hash: its KV is still valid and a later
                prompt with the same prefix can take it back (``match_prefix``); it is
                reused for fresh allocations only once the free list is empty, least
                recently unreferenced first (LRU);
* referenced  - ref count > 0: held by that many sequences (possibly registered).

A block is registered under the *chained* hash of its content: the hash of block ``i``
covers the token ids of block ``i`` and the hash of block ``i-1`` (and the pool's salt), so
equal hashes mean equal whole prefixes, not merely equal 16-token windows. Only full blocks
are hashed or shared: a partially filled block is still being written and belongs to one
sequence. Sharing (``match_prefix``, ``fork``) therefore never exposes a block that anyone
writes into.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Iterator, Sequence
from typing import NamedTuple

__all__ = ["BlockPool", "NoFreeBlocks", "PoolStats", "block_hashes"]

SCRATCH_BLOCK = 0
_ROOT = bytes(32)  # the "parent hash" of block 0 of every sequence


class NoFreeBlocks(RuntimeError):
    """Fewer blocks are allocatable than were asked for (nothing was allocated)."""


class PoolStats(NamedTuple):
    query_tokens: int  # tokens passed to match_prefix
    hit_tokens: int  # tokens whose KV match_prefix returned as cached
    evictions: int  # cached blocks whose content was dropped to satisfy allocate


def _salt_key(salt: bytes) -> bytes:
    # A fixed-width digest of the salt keeps the hashed message unambiguous: every field
    # before the token bytes has a fixed length, so no (salt, tokens) pair can collide with
    # another by shifting bytes from one field into the next.
    return hashlib.sha256(b"woq-kv-salt\0" + bytes(salt)).digest()


def _iter_chain(tokens: Sequence[int], block_size: int, salt_key: bytes, parent: bytes,
                first_block: int = 0) -> Iterator[bytes]:
    """Chained hashes of the full blocks ``first_block, first_block+1, ...`` of ``tokens``,
    lazily (a caller that stops at a cache miss hashes no further); ``parent`` is the hash
    of block ``first_block - 1`` (``_ROOT`` for block 0)."""
    n_full = len(tokens) // block_size
    if first_block >= n_full:
        return
    # One packing of all ints into int64 bytes, then zero-copy slices per block.
    raw = memoryview(array("q", tokens[first_block * block_size:n_full * block_size]).tobytes())
    stride = 8 * block_size
    sha256 = hashlib.sha256
    h = parent
    for off in range(0, len(raw), stride):
        d = sha256(h)
        d.update(salt_key)
        d.update(raw[off:off + stride])
        h = d.digest()
        yield h


def block_hashes(tokens: Sequence[int], block_size: int, salt: bytes = b"") -> list[bytes]:
    """Chained SHA-256 of each *full* block of ``tokens`` (a trailing partial block is not
    hashed): ``h[i] = sha256(h[i-1] || sha256(salt) || int64 bytes of block i)``, with
    ``h[-1]`` 32 zero bytes. Stable across processes and runs (unlike ``hash()``)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return list(_iter_chain(tokens, block_size, _salt_key(salt), _ROOT))


class BlockPool:
    """Reference-counted pool of KV blocks 1..num_blocks-1 with an LRU prefix cache.

    ``salt`` enters every hash: pools (or restarts) with different models, dtypes or
    quantization must use different salts so that they never share a cache entry.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True,
                 salt: bytes = b"") -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is scratch), got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._salt_key = _salt_key(salt)
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))
        # Unreferenced registered blocks; first item = unreferenced longest ago (evicted first).
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_of: dict[int, bytes] = {}  # block -> hash it is registered under
        self._block_of: dict[bytes, int] = {}  # hash -> the one block registered under it
        self.query_tokens = 0
        self.hit_tokens = 0
        self.evictions = 0

    # ---- sizes and stats ----

    @property
    def num_free(self) -> int:
        """Blocks allocatable now: truly free plus cached-but-unreferenced (evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks with ref count > 0."""
        return self.num_blocks - 1 - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks currently registered under a hash (referenced or evictable)."""
        return len(self._hash_of)

    @property
    def stats(self) -> PoolStats:
        """The counters as one tuple (also attributes: query_tokens, hit_tokens, evictions)."""
        return PoolStats(self.query_tokens, self.hit_tokens, self.evictions)

    def ref_count(self, block: int) -> int:
        """How many sequences hold ``block`` (0: free or evictable)."""
        return self._ref[block]

    # ---- allocation ----

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks (ref count 1 each). Truly free blocks go first; then the LRU
        evictable blocks, whose cache entries are dropped. All or nothing: raises
        ``NoFreeBlocks`` (and changes nothing) if fewer than ``n`` are allocatable."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            raise NoFreeBlocks(f"asked for {n} KV blocks, {self.num_free} allocatable")
        out: list[int] = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                del self._block_of[self._hash_of.pop(b)]
                self.evictions += 1
            self._ref[b] = 1
            out.append(b)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block. A block reaching 0 becomes evictable if it is
        registered (its KV stays reusable), else returns to the free list. The list is
        walked in reverse so that a sequence's tail blocks enter the LRU before its head:
        the tail (least likely to be shared by a later prompt) is evicted first, and a
        partially evicted chain keeps its usable leading run."""
        for b, k in Counter(self._checked(blocks)).items():
            if self._ref[b] < k:
                raise ValueError(f"block {b} freed more times than it is referenced")
        for b in reversed(blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def fork(self, blocks: Sequence[int]) -> None:
        """Add one reference to each block (already referenced): another sequence shares
        them. Only full blocks should be shared; the caller copies a partial tail block."""
        for b in self._checked(blocks):
            if self._ref[b] <= 0:
                raise ValueError(f"cannot fork unreferenced block {b}")
        for b in blocks:
            self._ref[b] += 1

    # ---- prefix cache ----

    def match_prefix(self, tokens: Sequence[int]) -> list[int]:
        """Blocks holding the longest cached run of full blocks that prefixes ``tokens``
        (stops at the first block whose chained hash is not cached), with a reference taken
        on each (an evictable block leaves the LRU). Always ``[]`` with caching off.

        Every returned token is a hit, so a caller that needs logits for the prompt's last
        token should pass ``tokens[:-1]`` (at least one token must still be computed)."""
        self.query_tokens += len(tokens)
        if not self.prefix_caching:
            return []
        out: list[int] = []
        for h in _iter_chain(tokens, self.block_size, self._salt_key, _ROOT):
            b = self._block_of.get(h)
            if b is None:
                break
            out.append(b)
        for b in out:
            if self._ref[b] == 0:
                del self._evictable[b]
            self._ref[b] += 1
        self.hit_tokens += len(out) * self.block_size
        return out

    def register(self, blocks: Sequence[int], tokens: Sequence[int], start_block: int = 0) -> None:
        """Record that the sequence with block table ``blocks`` has the KV of
        ``tokens[0:len(tokens)]`` written: every full block with index >= ``start_block``
        gets registered under its chained hash unless it already is. If another block
        already holds that hash, the existing mapping wins and this block stays a private,
        unregistered duplicate (freed straight to the free list). No-op with caching off."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        n_full = len(tokens) // bs
        if n_full > len(blocks):
            raise ValueError(f"{len(tokens)} tokens need {n_full} full blocks, table has {len(blocks)}")
        start_block = max(start_block, 0)
        if start_block >= n_full:
            return
        for b in self._checked(blocks[start_block:n_full]):
            if self._ref[b] <= 0:
                raise ValueError(f"cannot register block {b}: not held by the caller")
        # Resume the chain from the previous block's registered hash when there is one (a
        # registered block's hash is that of its content, which cannot change while this
        # sequence holds it); a private duplicate has none, so hash from the start.
        parent = self._hash_of.get(blocks[start_block - 1]) if start_block > 0 else None
        first = start_block if parent is not None else 0
        hashes = _iter_chain(tokens, bs, self._salt_key, parent or _ROOT, first)
        for i, h in enumerate(hashes, first):
            if i < start_block:
                continue
            b = blocks[i]
            old = self._hash_of.get(b)
            if old is not None:
                if old != h:
                    raise ValueError(f"block {b} is already registered for other tokens")
                continue
            if h not in self._block_of:
                self._block_of[h] = b
                self._hash_of[b] = h

    # ---- invariants ----

    def check(self) -> None:
        """Raise AssertionError unless the pool's bookkeeping is consistent (for tests)."""
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise AssertionError(msg)

        free = list(self._free)
        free_set = set(free)
        ev = set(self._evictable)
        need(len(free_set) == len(free), "a block is twice in the free list")
        need(SCRATCH_BLOCK not in free_set and SCRATCH_BLOCK not in ev, "scratch block handed out")
        need(self._ref[SCRATCH_BLOCK] == 0, "scratch block referenced")
        need(SCRATCH_BLOCK not in self._hash_of, "scratch block registered")
        need(not (free_set & ev), "a block is both free and evictable")
        for b in range(1, self.num_blocks):
            r = self._ref[b]
            need(r >= 0, f"block {b} has ref count {r}")
            states = (b in free_set) + (b in ev) + (r > 0)
            need(states == 1, f"block {b} is in {states} of free/evictable/referenced")
            if b in free_set:
                need(b not in self._hash_of, f"free block {b} still registered")
            if b in ev:
                need(b in self._hash_of, f"evictable block {b} not registered")
        need(len(self._hash_of) == len(self._block_of), "hash maps differ in size")
        for b, h in self._hash_of.items():
            need(self._block_of.get(h) == b, f"hash of block {b} maps elsewhere")
        need(self.prefix_caching or not self._hash_of, "blocks registered with caching off")
        need(self.num_used == sum(r > 0 for r in self._ref), "num_used disagrees with ref counts")

    def _checked(self, blocks: Sequence[int]) -> Sequence[int]:
        for b in blocks:
            if not 0 < b < self.num_blocks:
                raise ValueError(f"block id {b} outside 1..{self.num_blocks - 1}")
        return blocks
