"""The host-side channel a tensor-parallel rank 0 announces its model calls through.

Every decode step sends one message to every other rank, so its latency is on the step's
critical path wherever the followers are not far enough behind. ``broadcast_object_list``
pickles through tensors and runs two collectives a message (over NCCL it also waits for
the GPU queue); here rank 0 keeps a TCP connection to each other rank (Nagle off) and
writes each pickled message with its length (the two measured: docs/design/tensor_parallel.md).
The address comes from rank 0 through a host-side process group (gloo), so launchers
across hosts work the same (rank 0 listens on every interface; the others dial the
``MASTER_ADDR`` the group was formed with, or loopback when ``woq serve`` started them).
"""
from __future__ import annotations

import os
import pickle
import socket
import struct

import torch.distributed as dist

_LENGTH = struct.Struct("<Q")


class ControlChannel:
    """Rank 0: ``send`` a message to every other rank, in order. Another rank: ``receive``
    the next one (blocking)."""

    def __init__(self, sockets: list[socket.socket], receiving: bool):
        """``sockets``: rank 0's, one to each other rank; another rank's, the one to rank 0
        (``receiving``)."""
        self._sockets = sockets
        self._reader = sockets[0].makefile("rb") if receiving else None

    @classmethod
    def connect(cls, rank: int, size: int, group=None) -> "ControlChannel":
        """Every rank of ``group`` (host-side) calls it: rank 0 listens, the others connect."""
        listener = None
        if rank == 0:
            listener = socket.create_server(("", 0), family=socket.AF_INET)
            listener.listen(size)
            address = [(os.environ.get("MASTER_ADDR", "127.0.0.1"), listener.getsockname()[1])]
        else:
            address = [None]
        dist.broadcast_object_list(address, src=0, group=group)
        if rank == 0:
            sockets = []
            for _ in range(size - 1):
                conn, _ = listener.accept()
                sockets.append(conn)
            listener.close()
        else:
            sockets = [socket.create_connection(address[0])]
        for s in sockets:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(sockets, receiving=rank != 0)

    def send(self, message) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        frame = _LENGTH.pack(len(data)) + data
        for s in self._sockets:
            s.sendall(frame)

    def receive(self):
        (n,) = _LENGTH.unpack(self._read(_LENGTH.size))
        return pickle.loads(self._read(n))

    def _read(self, n: int) -> bytes:
        data = self._reader.read(n)
        if len(data) < n:
            raise ConnectionError("rank 0 closed the control channel")
        return data

    def close(self) -> None:
        for s in self._sockets:
            s.close()
