"""All-reduce latency against message size: NCCL and the peer-memory all-reduce
(``woq/kernels/peer_all_reduce.py``), fp16, on every GPU group size asked for.

One process a GPU (NCCL, ``NCCL_NVLS_ENABLE=0``: no multicast); each size is timed as a
CUDA graph of 20 back-to-back all-reduces of one tensor, 15 replays, the median per call
(``woq.kernels.timing.graph_time_us``), on rank 0. A decode step of an 8B model all-reduces
batch x 4096 x 2 bytes twice a layer: 8 KiB at batch 1, 512 KiB at 64.

    python benchmarks/all_reduce.py --sizes 2,4 --out docs/bench
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from common import gpu_info, markdown_table, on_ranks, save_results  # noqa: E402

KIB = 1024
MESSAGES = [2 * KIB << i for i in range(15)]  # 2 KiB .. 32 MiB
PEER_CAPACITY = 8 << 20  # (the benchmark's buffers reach past the server's default, to show the crossover)


def _rank(rank: int, size: int, dev: torch.device, control) -> list[dict]:
    from woq.kernels import build
    from woq.kernels.options import RuntimeOptions
    from woq.kernels.peer_all_reduce import PeerAllReduce
    from woq.kernels.timing import graph_time_us

    peer = PeerAllReduce.open(rank, size, dev, build.load(RuntimeOptions()), control, capacity=PEER_CAPACITY)
    rows = []
    for nbytes in MESSAGES:
        x = torch.randn(nbytes // 2, dtype=torch.float16, device=dev)
        nccl = graph_time_us([lambda: dist.all_reduce(x)])
        ours = graph_time_us([lambda: peer(x)]) if peer is not None and peer.takes(x) else None
        rows.append({"bytes": nbytes, "nccl_us": nccl, "peer_us": ours})
    return rows


def _size(nbytes: int) -> str:
    return f"{nbytes // KIB} KiB" if nbytes < 1 << 20 else f"{nbytes >> 20} MiB"


def summary(result: dict) -> str:
    lines = [f"# All-reduce latency, fp16, {result['gpu']}", "",
             "Median µs per all-reduce (a CUDA graph of 20 in a row, 15 replays); peer: the "
             "one-shot all-reduce over CUDA IPC buffers; NCCL with NVLS (multicast) off. "
             f"Command: `{result['command']}`.", ""]
    for size, rows in result["groups"].items():
        lines += [f"## {size} GPUs", "",
                  markdown_table(["message", "NCCL µs", "peer µs", "NCCL / peer"],
                                 [[_size(r["bytes"]), r["nccl_us"], "-" if r["peer_us"] is None else r["peer_us"],
                                   "-" if r["peer_us"] is None else f"{r['nccl_us'] / r['peer_us']:.2f}"]
                                  for r in rows]), ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for size, rows in result["groups"].items():
        kib = [r["bytes"] / KIB for r in rows]
        line, = ax.plot(kib, [r["nccl_us"] for r in rows], "o-", ms=3, label=f"NCCL, {size} GPUs")
        peer = [(k, r["peer_us"]) for k, r in zip(kib, rows) if r["peer_us"] is not None]
        ax.plot([k for k, _ in peer], [t for _, t in peer], "s--", ms=3, color=line.get_color(),
                label=f"peer, {size} GPUs")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message (KiB, fp16)")
    ax.set_ylabel("µs per all-reduce")
    ax.set_title(f"All-reduce latency, {result['gpu']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="2", help="GPU group sizes, comma-separated")
    p.add_argument("--out", type=Path, default=Path("docs/bench"))
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes.split(",") if int(s) <= torch.cuda.device_count()]
    result = {**gpu_info(), "command": "python benchmarks/all_reduce.py " + " ".join(sys.argv[1:]),
              "groups": {str(s): on_ranks(_rank, s) for s in sizes}}
    save_results(a.out, "all_reduce", result, summary, plot)


if __name__ == "__main__":
    main()
