"""The chunk-attention kernel (``kernels/chunk_attention.py``) against fp64: packed chunks
of several sequences -- decode tokens, whole prompts, chunks after a cached prefix --
over shuffled block tables, with and without key splits (skipped without a GPU)."""
import pytest
import torch
from test_gpu_fused import DTYPES, PAGED_ROWS, gather_fp64, paged_case

from woq.models.batches import TILE_TOKENS, Chunk, query_tiles

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# (tokens, first position) of one chunk per row of PAGED_ROWS: decode tokens deep in a
# sequence and at its start, a whole prompt, chunks after a cached prefix that start inside
# a block, on a block boundary, and one of many tiles
CHUNKS = [(1, 299), (37, 0), (1, 0), (17, 16), (16, 100), (200, 700)]


def causal_fp64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Queries ``[n, H, D]`` at positions ``start...`` over keys/values ``[Hkv, start + n, D]``,
    each seeing the positions up to its own (GQA), in fp64: ``[n, H, D]``."""
    n, H, D = q.shape
    group = H // k.shape[0]
    kk, vv = (t.double().repeat_interleave(group, 0) for t in (k, v))  # [H, L, D]
    s = q.double().transpose(0, 1) @ kk.transpose(1, 2) / D ** 0.5  # [H, n, L]
    visible = torch.arange(k.shape[1], device=q.device)[None, :] <= start + torch.arange(n, device=q.device)[:, None]
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
    return (p @ vv).transpose(0, 1)


def packed_case(heads: int, kv_heads: int, dim: int, dtype, block_size: int, case: list[tuple[int, int]]):
    """One chunk per row of PAGED_ROWS (``case``: tokens, first position) over a paged pool
    (NaN outside the rows' blocks): q ``[T + 2, heads, dim]`` (2 rows no tile covers), the
    layer's k, v and table, the query tiles (and 3 padding tiles), the chunks and T."""
    cache = paged_case(kv_heads, dim, dtype, block_size, [p + n for n, p in case], heads + dim + block_size)
    offsets = torch.tensor([0] + [n for n, _ in case]).cumsum(0).tolist()
    chunks = [Chunk(o, n, r, p) for o, (n, p), r in zip(offsets, case, PAGED_ROWS)]
    T = offsets[-1]
    tiles = query_tiles(chunks, TILE_TOKENS) + [(T, 0, 0, 0)] * 3  # (and padding)
    tiles = torch.tensor(tiles, dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(dim)
    q = torch.randn(T + 2, heads, dim, device="cuda", generator=g).to(dtype)
    return q, cache.k[0], cache.v[0], cache.block_table, tiles, chunks, T


def assert_causal(out, q, k, v, table, chunks, dtype) -> None:
    """Each chunk's rows of ``out`` against the fp64 reference over its sequence's keys."""
    for c in chunks:
        n = c.start + c.tokens
        ref = causal_fp64(q[c.row:c.row + c.tokens], gather_fp64(k, table, c.slot, n), gather_fp64(v, table, c.slot, n),
                          c.start)
        got = out[c.row:c.row + c.tokens].double()
        err = ((got - ref).norm() / ref.norm()).item()
        assert err < (3e-3 if dtype == torch.float16 else 2e-2), (c, err)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (32, 8, 128), (4, 4, 64)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 64])
# key splits: none; 8 (every tile's keys split in a launch of few rows, the small tiles'
# only in one of more); 3 (not a power of two) for every tile of a few
@pytest.mark.parametrize("splits,few", [(1, False), (8, True), (8, False), (3, True)],
                         ids=["unsplit", "split-all", "split-small", "split-3"])
def test_chunk_attention_attends_causally_through_the_table(heads, kv_heads, dim, dtype, block_size, splits, few):
    """Every packed row attends to exactly its sequence's positions up to its own, read
    through a shuffled table (NaN everywhere else in the pool); rows no tile covers and
    padding tiles (0 tokens) leave the output alone; a programmatic launch gives the same."""
    from woq.kernels.chunk_attention import SPLIT_ALL_TOKENS, chunk_attention

    case = CHUNKS[:3] if few else CHUNKS
    assert (sum(n for n, _ in case) + 2 <= SPLIT_ALL_TOKENS) == few
    q, k, v, table, tiles, chunks, T = packed_case(heads, kv_heads, dim, dtype, block_size, case)
    out = torch.full_like(q, float("nan"))
    chunk_attention(q, k, v, table, tiles, TILE_TOKENS, out, splits=splits)
    assert torch.isnan(out[T:]).all()  # (not covered)
    assert_causal(out, q, k, v, table, chunks, dtype)
    again = torch.full_like(q, float("nan"))
    chunk_attention(q, k, v, table, tiles, TILE_TOKENS, again, programmatic=True, splits=splits)
    assert torch.equal(again[:T], out[:T])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("keys,stages", [(64, 2), (32, 3), (128, 2)])  # (not the default 64/3)
def test_chunk_attention_walk_option_sets_an_unsplit_launch(dtype, dim, keys, stages):
    """``ChunkAttentionOptions`` sets how an unsplit launch walks the keys (keys a step, never
    under a cache block; stages): the fp64 reference still holds for every chunk, and a
    split launch ignores it (the same sums as the default's)."""
    from woq.kernels.chunk_attention import chunk_attention
    from woq.kernels.options import ChunkAttentionOptions

    walk = ChunkAttentionOptions(keys, stages)
    q, k, v, table, tiles, chunks, T = packed_case(8, 2, dim, dtype, 16, CHUNKS)
    out = torch.full_like(q, float("nan"))
    chunk_attention(q, k, v, table, tiles, TILE_TOKENS, out, splits=1, walk=walk)
    assert torch.isnan(out[T:]).all()
    assert_causal(out, q, k, v, table, chunks, dtype)
    split = chunk_attention(q, k, v, table, tiles, TILE_TOKENS, splits=8, walk=walk)
    assert torch.equal(split[:T], chunk_attention(q, k, v, table, tiles, TILE_TOKENS, splits=8)[:T])
