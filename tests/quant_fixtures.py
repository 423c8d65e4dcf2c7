"""Writers of the GPTQ and AWQ on-disk layouts, for import tests (fixtures made here, no
downloads). They follow the reference packers: AutoGPTQ's ``QuantLinear.pack`` (codes
packed along K into int32, zero points along N, stored minus one in the v1 format) and
AutoAWQ's ``WQLinear_GEMM.from_linear`` (8 codes along N per int32 in the order
0,2,4,6,1,3,5,7, zero points likewise, no offset)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from woq.kernels.format import QuantizedWeight

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())


def gptq_tensors(qw: QuantizedWeight, v1: bool = True, perm: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """GPTQ tensors of ``qw``; with ``perm``, the checkpoint's column perm[j] holds our column j
    (an act-order checkpoint: g_idx is no longer contiguous)."""
    bits, pack = qw.bits, 32 // qw.bits
    codes = qw.codes().numpy().astype(np.uint64)  # [N, K]
    N, K = codes.shape
    g_idx = np.arange(K) // qw.group_size
    if perm is not None:
        scrambled = np.zeros_like(codes)
        scrambled[:, perm.numpy()] = codes
        codes = scrambled
        g = np.zeros(K, dtype=np.int64)
        g[perm.numpy()] = g_idx
        g_idx = g
    intweight = codes.T  # [K, N]
    qweight = np.zeros((K // pack, N), dtype=np.uint64)
    for j in range(pack):
        qweight |= intweight[j::pack] << np.uint64(bits * j)
    zeros = qw.zero_points().numpy().astype(np.int64).T  # [G, N]
    zeros = (zeros - (1 if v1 else 0)).astype(np.uint64) & np.uint64((1 << bits) - 1)
    qzeros = np.zeros((zeros.shape[0], N // pack), dtype=np.uint64)
    for j in range(pack):
        qzeros |= zeros[:, j::pack] << np.uint64(bits * j)
    return {"qweight": _int32(qweight), "qzeros": _int32(qzeros), "scales": qw.scales.T.contiguous().half(),
            "g_idx": torch.from_numpy(g_idx.astype(np.int32))}


def awq_tensors(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    assert qw.bits == 4
    intweight = qw.codes().numpy().astype(np.uint64).T  # [K, N]
    zeros = qw.zero_points().numpy().astype(np.uint64).T  # [G, N]

    def pack(a: np.ndarray) -> np.ndarray:
        out = np.zeros((a.shape[0], a.shape[1] // 8), dtype=np.uint64)
        for col in range(a.shape[1] // 8):
            for i in range(8):
                out[:, col] |= a[:, col * 8 + AWQ_ORDER[i]] << np.uint64(4 * i)
        return out

    return {"qweight": _int32(pack(intweight)), "qzeros": _int32(pack(zeros)), "scales": qw.scales.T.contiguous().half()}


def write_quantized_checkpoint(src: Path, out: Path, tensors: dict[str, dict[str, torch.Tensor]], qconfig: dict) -> Path:
    """Copy the HF checkpoint ``src`` to ``out``, replacing each ``name.weight`` listed in
    ``tensors`` by its quantized tensors, and declare ``qconfig`` in config.json."""
    shutil.copytree(src, out)
    state = load_file(out / "model.safetensors")
    for name, parts in tensors.items():
        del state[f"{name}.weight"]
        state.update({f"{name}.{k}": v for k, v in parts.items()})
    (out / "model.safetensors").unlink()
    save_file(state, out / "model.safetensors")
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = qconfig
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out
