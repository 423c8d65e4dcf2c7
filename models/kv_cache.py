"""Per-slot KV cache: one fixed region of ``max_seq_len`` positions per sequence slot.

Layout ``[layers, slots, kv_heads, max_seq_len, head_dim]``: a decode step gathers the
rows of the batch's slots and reads positions ``[0, L)`` only, L being the longest live
sequence of the batch, so attention cost follows the live tokens rather than the cache
size. Memory is fixed at allocation (slots × max_seq_len), which is what bounds
admission: a request waits until a slot frees. The cache is zero-filled so that
positions a shorter sequence has not written are finite (they are masked out, but a
masked NaN would still poison ``softmax @ V``).
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (num_layers, num_slots, num_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store token rows ``k``/``v`` ``[N, kv_heads, D]`` at ``positions`` ``[N]`` of ``slots`` ``[N]``."""
        self.k[layer][slots, :, positions] = k
        self.v[layer][slots, :, positions] = v

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Copy slot ``src``'s first ``length`` positions (every layer) into slot ``dst``: a
        prompt prefilled once, shared by the sequences of one request's choices."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def read(self, layer: int, slots: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, kv_heads, length, D]`` of ``slots``."""
        return self.k[layer, slots, :, :length], self.v[layer, slots, :, :length]
