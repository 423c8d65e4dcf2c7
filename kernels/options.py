"""The runtime options of the whole stack: one frozen value, built once from the settings
(``service/config.py``) and passed explicitly to the model builder, the model, the engine
and the kernels. Nothing reads a switch from a class attribute, a module global or the
environment; a test or a benchmark that wants another behaviour builds other options."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


def default_cache_dir() -> Path:
    """``$WOQ_CACHE``, default ``~/.cache/woq``: fetched models, compiled kernels, tuning tables."""
    return Path(os.environ.get("WOQ_CACHE", Path.home() / ".cache" / "woq")).expanduser()


@dataclass(frozen=True)
class DecodeStepOptions:
    """The persistent batch-1 decode step (``kernels/decode_step.py``)."""

    # None: used for models at least ``min_hidden`` wide (where it was measured faster than
    # a kernel per op); True/False: always/never where the model qualifies.
    enabled: bool | None = None
    min_hidden: int = 4096
    # L2 use, a mask of csrc/decode_step.cuh's kHint*: 1 the weight stream marked
    # evict_first, 2 the step's small critical-path data prefetched into L2.
    cache_hints: int = 3
    # Depth of the shared-memory weight ring at most (0: as many slots as fit).
    ring_slots: int = 0
    # Shares of a KV head's live tokens at most (one attention block each).
    max_shares: int = 16


@dataclass(frozen=True)
class DecodeAttentionOptions:
    """The decode-attention kernel's tiles (``kernels/decode_attention.py``) at batches where
    it is bound by bandwidth: (sequence, KV head) pairs at least a quarter of the SMs.
    Smaller batches take 128-token tiles without pipelining (``decode_attention.tiles``)."""

    tile_tokens: int = 32  # keys a program loads per step of its walk (a power of two >= 16)
    stages: int = 3  # software-pipeline stages of that walk


@dataclass(frozen=True)
class ChunkAttentionOptions:
    """The chunk-attention kernel's walk over the keys (``kernels/chunk_attention.py``) in
    launches that do not split keys: the mixed steps and prefills of more than
    ``chunk_attention.SPLIT_TOKENS`` packed rows. Split launches keep 64 keys a step and 2
    stages (measured: docs/design/attention.md)."""

    keys_per_step: int = 64  # keys a program loads per step (head_dim <= 128; half beyond)
    stages: int = 3  # software-pipeline stages of that walk


@dataclass(frozen=True)
class RuntimeOptions:
    cache_dir: Path = field(default_factory=default_cache_dir)
    # Measure the kernels' launches for a weight shape new to this GPU (once, cached in
    # cache_dir/tuning); off: the shipped table, else the kernels' own defaults.
    tune: bool = True
    # Read the tables shipped in kernels/tuned/ (off: only what is measured here).
    shipped_tables: bool = True
    # Programmatic dependent launches (sm_90+): a kernel's blocks start while its
    # predecessor drains and wait only before reading its outputs.
    programmatic_launch: bool = True
    # The fused Triton kernels on CUDA (add + RMSNorm, RoPE + cache write, SwiGLU, decode
    # attention); off: the torch ops, which are their reference.
    fused_ops: bool = True
    # Rows of x the dense GEMV takes for an unquantized layer on CUDA (0: cuBLAS only).
    dense_gemv_rows: int = 2
    # fp32 linears on the CPU through oneDNN (kernels/cpu_linear.py); off: F.linear (MKL).
    cpu_onednn: bool = True
    decode_step: DecodeStepOptions = field(default_factory=DecodeStepOptions)
    decode_attention: DecodeAttentionOptions = field(default_factory=DecodeAttentionOptions)
    chunk_attention: ChunkAttentionOptions = field(default_factory=ChunkAttentionOptions)

    def tuning_dir(self) -> Path:
        return self.cache_dir / "tuning"

    def extensions_dir(self) -> Path:
        return self.cache_dir / "torch_extensions"
