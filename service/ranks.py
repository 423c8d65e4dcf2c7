"""The processes of ``woq serve --tensor-parallel-size N``: one per rank, in one
``torch.distributed`` group (NCCL on CUDA, one GPU a rank; gloo on the CPU).

Launched by a multi-process launcher (``torchrun``, or a multi-node one), every process
finds ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` in its environment and
joins through ``env://``. Started alone, ``woq serve`` is rank 0 and starts the other N - 1
as copies of its own command with those variables set (on one machine). Rank 0 serves
HTTP and runs the engine; the others follow its steps (``engine/tensor_parallel.py``).
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..engine.control_channel import ControlChannel
from ..engine.tensor_parallel import Leader
from ..models.sharding import TensorParallel
from .config import ServeSettings

log = logging.getLogger("woq.service")


@dataclass
class Ranks:
    """This process's rank, its model device, and on rank 0 the processes it started and the
    ``Leader`` its engine announces calls through; ``channel``: where they travel."""

    tp: TensorParallel
    device: str
    channel: ControlChannel
    children: list[subprocess.Popen] = field(default_factory=list)
    leader: Leader | None = None
    closing: threading.Event = field(default_factory=threading.Event)

    @property
    def rank(self) -> int:
        return self.tp.rank

    def watch_children(self) -> None:
        """Rank 0, once serving: end this process if a rank it started exits before
        ``close``. The group cannot step without it (every collective would wait for it),
        so a server that stopped answering would otherwise hang with its requests; ended,
        its supervisor (Kubernetes, systemd) restarts it whole."""
        def watch() -> None:
            while not self.closing.wait(1.0):  # (a second: a supervisor's restart takes far longer)
                for rank, child in enumerate(self.children, 1):
                    status = child.poll()
                    if status is not None and not self.closing.is_set():
                        log.error("tensor-parallel rank %d exited (status %s): the group cannot go on; stopping",
                                  rank, status)
                        for other in self.children:
                            other.kill()
                        os._exit(1)

        if self.children:
            threading.Thread(target=watch, name="woq-ranks-watch", daemon=True).start()

    def close(self) -> None:
        """Rank 0: let the other ranks return, and wait for those it started. Every rank: leave the group."""
        self.closing.set()
        if self.leader is not None:
            self.leader.stop()
        dist.destroy_process_group()
        for child in self.children:
            try:
                child.wait(60)
            except subprocess.TimeoutExpired:
                child.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _follow_the_leader() -> None:
    """A rank other than 0 ends when rank 0 tells it to (its drain is rank 0's), not on a
    terminal's or an orchestrator's signal to the group; on Linux it is killed when its
    parent dies (rank 0, or the launcher), rather than waiting for it forever."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start_ranks(settings: ServeSettings) -> Ranks:
    """Join (or, started alone, start and join) the group of ``settings.tensor_parallel_size`` ranks."""
    size = settings.tensor_parallel_size
    env = os.environ
    launched = "RANK" in env and "WORLD_SIZE" in env
    children = []
    if launched:
        rank, init = int(env["RANK"]), "env://"
        if int(env["WORLD_SIZE"]) != size:
            raise SystemExit(f"--tensor-parallel-size {size} but the launcher started {env['WORLD_SIZE']} processes")
    else:
        rank, port = 0, _free_port()
        init = f"tcp://127.0.0.1:{port}"
        for r in range(1, size):
            child_env = {**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(size),
                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            children.append(subprocess.Popen([sys.executable, "-m", "woq", *sys.argv[1:]], env=child_env))
    local = int(env.get("LOCAL_RANK", rank))
    on_cuda = settings.device.startswith("cuda") or (settings.device == "auto" and torch.cuda.is_available())
    if on_cuda:
        if torch.cuda.device_count() <= local:
            raise SystemExit(f"rank {rank} needs GPU {local}; this machine has {torch.cuda.device_count()}")
        torch.cuda.set_device(local)
    if rank > 0:
        _follow_the_leader()
    dist.init_process_group("nccl" if on_cuda else "gloo", init_method=init, rank=rank, world_size=size)
    control = dist.new_group(backend="gloo") if on_cuda else None  # (host-side: addresses and handles)
    channel = ControlChannel.connect(rank, size, control)
    peer = None
    if on_cuda and settings.peer_all_reduce:
        from ..kernels import build
        from ..kernels.peer_all_reduce import PeerAllReduce

        peer = PeerAllReduce.open(rank, size, torch.device("cuda", local), build.load(settings.runtime_options()),
                                  control)
    log.info("tensor-parallel rank %d of %d joined (%s%s)", rank, size, "nccl" if on_cuda else "gloo",
             ", peer all-reduce" if peer is not None else "")
    return Ranks(TensorParallel(rank, size, peer=peer), f"cuda:{local}" if on_cuda else "cpu", channel, children,
                 Leader(channel) if rank == 0 else None)
