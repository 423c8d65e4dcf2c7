"""The peer-memory all-reduce (``kernels/peer_all_reduce.py``) on 2+ GPUs, one process a
rank over NCCL: against an fp64 reference of the ranks' inputs (fp32 sums in rank order,
one rounding: the correctly rounded sum wherever the fp32 sum is exact), bit-identical on
every rank, equal to NCCL's within its roundings, and the same inside a CUDA graph replayed
with new inputs each time (the epochs and the two buffers alternate on the device)."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

SIZES = [8, 4096, 8192 * 3, 65536 + 8, 262144]  # elements: a 16-byte unit up to 512 KiB of fp16


def _inputs(rank: int, size: int, n: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Every rank's input (each rank can rebuild them all: the fp64 reference)."""
    return [torch.randn(n, generator=torch.Generator().manual_seed(seed * 97 + r), dtype=torch.float64)
            .mul(4).to(dtype) for r in range(size)]


def _rank(rank: int, size: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=size, device_id=torch.device("cuda", rank))
    control = dist.new_group(backend="gloo")
    from woq.kernels import build
    from woq.kernels.options import RuntimeOptions
    from woq.kernels.peer_all_reduce import PeerAllReduce

    dev = torch.device("cuda", rank)
    peer = PeerAllReduce.open(rank, size, dev, build.load(RuntimeOptions()), control)
    results = {"peer_on": peer is not None}
    if peer is not None:
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            for seed, n in enumerate(SIZES):
                xs = _inputs(rank, size, n, dtype, seed)
                mine = xs[rank].to(dev)
                if not peer.takes(mine):
                    continue
                ours, nccl = peer(mine.clone()), mine.clone()
                dist.all_reduce(nccl)
                stacked = torch.stack([x.double() for x in xs])
                results[(str(dtype), n)] = (ours.cpu(), nccl.cpu(), stacked.sum(0), stacked.abs().sum(0))
        # a graph: captured once, replayed with new inputs (each replay a new epoch)
        n, dtype = 4096, torch.float16
        x = torch.zeros(n, dtype=dtype, device=dev)
        for _ in range(2):
            peer(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            peer(x)
        replays = []
        for seed in range(100, 105):
            xs = _inputs(rank, size, n, dtype, seed)
            x.copy_(xs[rank])
            graph.replay()
            stacked = torch.stack([v.double() for v in xs])
            replays.append((x.cpu(), stacked.sum(0), stacked.abs().sum(0)))
        results["graph"] = replays
    torch.cuda.synchronize()
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def _ulp(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The wider of ``dtype``'s two spacings around each reference value (at a power of two
    the one away from zero, which a value rounding to it may have come from)."""
    r = ref.to(dtype).abs()
    return torch.nextafter(r, torch.tensor(float("inf"), dtype=dtype)).double() - r.double()


def _bound(ref: torch.Tensor, magnitude: torch.Tensor, dtype: torch.dtype, size: int, accumulate_eps: float):
    """Half a unit of the rounded result, plus a rounding of each of the ``size - 1``
    additions at ``accumulate_eps`` relative to the inputs' magnitude (sum of |x|)."""
    return 0.5 * _ulp(ref, dtype) + (size - 1) * accumulate_eps * magnitude


def test_peer_all_reduce_matches_fp64_and_nccl(tmp_path):
    import socket

    size = min(torch.cuda.device_count(), 4)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(size, port, str(tmp_path)), nprocs=size, join=True, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(size)]
    assert all(r["peer_on"] for r in ranks), "the GPUs of this machine should reach each other's memory"
    fp32_eps = 2.0 ** -24
    checked = 0
    for key, (ours, nccl, ref, magnitude) in [(k, v) for k, v in ranks[0].items() if isinstance(k, tuple)]:
        dtype = ours.dtype
        for other in ranks[1:]:
            assert torch.equal(other[key][0], ours), f"{key}: ranks differ"
        # ours: fp32 sums, one rounding to dtype
        excess = (ours.double() - ref).abs() - _bound(ref, magnitude, dtype, size, fp32_eps)
        assert excess.max() <= 0, f"{key}: past the bound by {excess.max():.3g}"
        # NCCL: sums in dtype itself (a rounding per addition)
        eps = torch.finfo(dtype).eps / 2
        excess = (nccl.double() - ref).abs() - _bound(ref, magnitude, dtype, size, eps)
        assert excess.max() <= 0, f"{key}: NCCL past the bound by {excess.max():.3g}"
        checked += 1
    assert checked >= 12
    for r in ranks:
        for got, ref, magnitude in r["graph"]:
            assert ((got.double() - ref).abs() - _bound(ref, magnitude, torch.float16, size, fp32_eps)).max() <= 0
    for i, (got, _, _) in enumerate(ranks[0]["graph"]):
        assert all(torch.equal(got, other["graph"][i][0]) for other in ranks[1:])
