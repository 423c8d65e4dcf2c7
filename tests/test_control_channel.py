"""The tensor-parallel control channel (``engine/control_channel.py``) between real
processes on loopback (gloo for the address, TCP for the messages): every other rank
receives rank 0's messages whole and in order -- small ones, tensors, one of megabytes --
and a rank whose rank 0 has gone gets a ConnectionError, not a hang."""
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from woq.engine.control_channel import ControlChannel


def _messages() -> list:
    g = torch.Generator().manual_seed(3)
    return ([("decode_graph_next", i) for i in range(50)]
            + [("entries", torch.randint(0, 1000, (17, 3), generator=g, dtype=torch.int32))]
            + [("packed_graph", list(range(300_000)), [300_000], [4], [0])]  # (about 1.5 MB pickled)
            + [("stop",)])


def _rank(rank: int, size: int, rendezvous: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=size)
    channel = ControlChannel.connect(rank, size)
    try:
        if rank == 0:
            for m in _messages():
                channel.send(m)
            channel.close()
        else:
            got = [channel.receive() for _ in _messages()]
            try:
                channel.receive()
                after = "received"
            except ConnectionError:
                after = "ConnectionError"
            torch.save((got, after), f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("size", [2, 3])
def test_every_rank_receives_rank_0s_messages_in_order(tmp_path, size):
    mp.start_processes(_rank, args=(size, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=size, join=True,
                       start_method="spawn")
    sent = _messages()
    for r in range(1, size):
        got, after = torch.load(tmp_path / f"rank{r}.pt")
        assert len(got) == len(sent)
        for a, b in zip(got, sent):
            assert a[0] == b[0]
            for x, y in zip(a[1:], b[1:]):
                assert torch.equal(x, y) if isinstance(y, torch.Tensor) else x == y
        assert after == "ConnectionError"
