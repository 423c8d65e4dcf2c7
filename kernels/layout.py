"""The GPU weight layout: a transform of the logical format (``kernels/format.py``), done
once at load time.

The GEMV (``csrc/gemv.cuh``) uses the weight as the A operand of ``mma.m16n8k16``: 16
output channels x 16 k per mma. In an A fragment, lane ``l`` (``g = l // 4``,
``t = l % 4``) holds, for one k16 block::

    a0 a1: W[g][2t], W[g][2t+1]        a2 a3: W[g+8][2t], W[g+8][2t+1]
    a4 a5: W[g][2t+8], W[g][2t+9]      a6 a7: W[g+8][2t+8], W[g+8][2t+9]

(W rows = output channels of the 16-row tile, columns = k). The layout stores, for each
16-row tile and each run of k, the bytes of each lane's fragments contiguously, so that
one 16-byte load per lane fetches them for 4 (int4) or 2 (int8) consecutive k16 blocks,
and a warp's 32 loads are one contiguous 512-byte segment::

    qweight: [n_tiles][K_pad / KT][32 lanes][16 bytes]      KT = 64 (int4) or 32 (int8)

Within a lane's 16 bytes, the 8 codes e0..e7 of one k16 block (in the a0..a7 order
above) are interleaved for the fast converters of ``csrc/convert.cuh``::

    int4, one 32-bit word per k16 block (words j = 0..3 <-> k16 blocks j of the 64):
        bits  31..28 27..24 23..20 19..16 15..12 11..8  7..4   3..0
        code    e7     e5     e3     e1     e6     e4    e2     e0     (order 0,2,4,6,1,3,5,7)

    int8, two 32-bit words per k16 block (words 2j, 2j+1 <-> k16 block j of the 32):
        word 2j:   bytes 3..0 = e3 e1 e2 e0                        (order 0,2,1,3)
        word 2j+1: bytes 3..0 = e7 e5 e6 e4

Codes are the logical format's unsigned codes (symmetric ones already biased by +128 or
+8), so no further biasing happens here. Scales and zero points become::

    scales, zeros: [n_tiles][groups_pad][16], rows of a tile in the order 0, 8, 1, 9, ...,
    7, 15: lane g reads one 32-bit pair (row g, row g+8), exactly the two rows its
    fragments cover.

Scales are fp16 whatever the activation dtype: the logical format's fp16 scale itself,
which a bf16 copy would round (the kernels multiply in fp32, or split it exactly for
bf16 weights: csrc/gemm.cuh, RowScale). A logical scale of another dtype must be exact in
fp16. Zero points are stored as exact small integers in the activation dtype (the kernels
fold them into the converter's magic subtraction); symmetric weights store none.

Padding: N to a multiple of 16, K to a multiple of KT and of the group size. Padded
codes equal their zero point, so padded weights are exactly 0; padded scales are 0.
Requirements checked here: K % 8 == 0 (16-byte activation rows), group size a power of
two >= 32 (or per-channel).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .format import QuantizedWeight, interleave_gate_up, midpoint

LAYOUT_VERSION = 1
TILE_N = 16


def tile_k(bits: int) -> int:
    """k covered by one 16-byte lane load."""
    return 64 if bits == 4 else 32


# Logical positions (row in tile, column in k16 block) of the 8 fragment elements e0..e7
# of lane l, as functions of g = l // 4 and t = l % 4.
_ROW_OFF = (0, 0, 8, 8, 0, 0, 8, 8)
_COL_OFF = (0, 1, 0, 1, 8, 9, 8, 9)
# Where each element goes inside its 32-bit word(s): nibble index (int4) / byte index (int8).
INT4_NIBBLE_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds element INT4_NIBBLE_ORDER[i]
INT8_BYTE_ORDER = (0, 2, 1, 3)  # byte i of a word holds element INT8_BYTE_ORDER[i] (+4 for word 2j+1)
# Row order of the 16 scales of a tile: pairs (g, g + 8).
SCALE_ROW_ORDER = tuple(r for g in range(8) for r in (g, g + 8))


@dataclass
class GpuWeight:
    """A weight in the GPU layout, with what the kernels need to know about it."""

    qweight: torch.Tensor  # uint8 [n_tiles, K_pad // KT, 32, 16]
    scales: torch.Tensor  # [n_tiles, groups_pad, 16] fp16
    zeros: torch.Tensor | None  # same shape in the act dtype, or None
    bits: int
    N: int
    K: int
    K_pad: int
    group_size: int  # K_pad when per-channel
    dtype: torch.dtype
    # Rows are a SwiGLU gate/up pair interleaved in eights (format.interleave_gate_up): every
    # path's output comes in that order, and the GEMV can write silu(gate) * up itself.
    swiglu_rows: bool = False

    @property
    def n_tiles(self) -> int:
        return self.qweight.shape[0]

    @property
    def groups_pad(self) -> int:
        return self.scales.shape[1]

    @property
    def per_channel(self) -> bool:
        return self.group_size >= self.K_pad

    def nbytes(self) -> int:
        t = [self.qweight, self.scales] + ([self.zeros] if self.zeros is not None else [])
        return sum(x.numel() * x.element_size() for x in t)


def refusal_of(qw: QuantizedWeight) -> str | None:
    """Why the GPU layout cannot hold ``qw`` (its layer then serves dequantize + cuBLAS in
    torch), or None."""
    if qw.in_features % 8:
        return f"in_features % 8 == 0 is needed (16-byte activation rows), got {qw.in_features}"
    if not torch.equal(qw.scales.to(torch.float16).to(qw.scales.dtype), qw.scales):
        return f"its {qw.scales.dtype} scales are not all exact in fp16, the layout's scale dtype"
    return None


def padded_sizes(N: int, K: int, bits: int, group_size: int) -> tuple[int, int, int, int]:
    """(N_pad, K_pad, group size in the layout, groups_pad)."""
    if K % 8:
        raise ValueError(f"the GPU kernels need in_features % 8 == 0, got {K}")
    kt = tile_k(bits)
    per_channel = group_size >= K
    if not per_channel and (group_size < 32 or group_size & (group_size - 1)):
        raise ValueError(f"the GPU kernels need a power-of-two group size >= 32, got {group_size}")
    N_pad = math.ceil(N / TILE_N) * TILE_N
    step = kt if per_channel else max(kt, group_size)
    K_pad = math.ceil(K / step) * step
    G = K_pad if per_channel else group_size
    return N_pad, K_pad, G, K_pad // G


def _fragment_index(device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-in-tile and column-in-k16 of element e (0..7) of lane l: two [32, 8] tensors."""
    lane = torch.arange(32, device=device)
    g, t = (lane // 4)[:, None], (lane % 4)[:, None]
    rows = g + torch.tensor(_ROW_OFF, device=device)[None, :]
    cols = 2 * t + torch.tensor(_COL_OFF, device=device)[None, :]
    return rows, cols


def padded_codes(qw: QuantizedWeight) -> tuple[torch.Tensor, int, int, int, int]:
    """Codes padded to [N_pad, K_pad] with each position's zero point, and the sizes."""
    N, K, bits = qw.out_features, qw.in_features, qw.bits
    N_pad, K_pad, G, groups_pad = padded_sizes(N, K, bits, qw.group_size)
    zp = torch.full((N_pad, groups_pad), midpoint(bits), dtype=torch.uint8, device=qw.device)
    if qw.zeros is not None:
        zp[:N, : qw.num_groups] = qw.zeros if G == qw.group_size else qw.zeros[:, :1]
    codes = zp.repeat_interleave(G, dim=1)[:, :K_pad].contiguous()
    codes[:N, :K] = qw.codes()
    return codes, N_pad, K_pad, G, groups_pad


def pack_codes_gpu(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[N_pad, K_pad] uint8 codes -> uint8 [n_tiles, K_pad // KT, 32, 16] (see module doc)."""
    N_pad, K_pad = codes.shape
    kt = tile_k(bits)
    k16 = kt // 16
    rows, cols = _fragment_index(codes.device)
    # [n_tiles, 16, K_pad/KT, k16, 16] -> gather each lane's 8 fragment elements per k16 block
    t = codes.reshape(N_pad // 16, 16, K_pad // kt, k16, 16).permute(0, 2, 3, 1, 4)  # [nt, kt, j, row, col]
    e = t[:, :, :, rows, cols]  # uint8 [nt, kt, j, 32 lanes, 8 elements]
    if bits == 4:  # 4 bytes per k16 block; byte b holds nibbles 2b (low) and 2b+1 (high)
        o = INT4_NIBBLE_ORDER
        per_block = torch.stack([e[..., o[2 * b]] | (e[..., o[2 * b + 1]] << 4) for b in range(4)], -1)
    else:  # 8 bytes per k16 block: word 2j then word 2j+1 (elements + 4)
        per_block = torch.stack([e[..., INT8_BYTE_ORDER[b] + 4 * h] for h in range(2) for b in range(4)], -1)
    # [nt, kt, j, lane, bytes] -> [nt, kt, lane, j, bytes]: a lane's 16 bytes are its k16 blocks in order
    words = per_block.permute(0, 1, 3, 2, 4)
    return words.reshape(N_pad // 16, K_pad // kt, 32, 16).contiguous()


def _tile_groups(t: torch.Tensor, N_pad: int, groups_pad: int, fill: float, dtype: torch.dtype) -> torch.Tensor:
    """[N, groups] -> [n_tiles, groups_pad, 16] in the pair-interleaved row order."""
    out = torch.full((N_pad, groups_pad), fill, dtype=dtype, device=t.device)
    out[: t.shape[0], : t.shape[1]] = t.to(dtype)
    order = torch.tensor(SCALE_ROW_ORDER, device=t.device)
    return out.reshape(N_pad // 16, 16, groups_pad)[:, order].permute(0, 2, 1).contiguous()


def pack_for_gpu(qw: QuantizedWeight, act_dtype: torch.dtype, gate_up: bool = False) -> GpuWeight:
    """Repack a logical weight into the GPU layout (on the weight's device); ``gate_up``: a
    fused ``[gate; up]`` SwiGLU weight, whose rows are interleaved (``swiglu_rows``)."""
    if act_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"the GPU kernels take float16 or bfloat16 activations, got {act_dtype}")
    if gate_up:
        qw = interleave_gate_up(qw)
    codes, N_pad, K_pad, G, groups_pad = padded_codes(qw)
    refusal = refusal_of(qw)
    if refusal is not None:
        raise ValueError(f"the GPU layout cannot hold this weight: {refusal}")
    scales = qw.scales if G == qw.group_size else qw.scales[:, :1]
    zeros = None
    if qw.zeros is not None:
        zeros = _tile_groups(qw.zeros if G == qw.group_size else qw.zeros[:, :1], N_pad, groups_pad,
                             midpoint(qw.bits), act_dtype)
    return GpuWeight(
        qweight=pack_codes_gpu(codes, qw.bits),
        scales=_tile_groups(scales, N_pad, groups_pad, 0.0, torch.float16),
        zeros=zeros,
        bits=qw.bits,
        N=qw.out_features,
        K=qw.in_features,
        K_pad=K_pad,
        group_size=G,
        dtype=act_dtype,
        swiglu_rows=gate_up,
    )
