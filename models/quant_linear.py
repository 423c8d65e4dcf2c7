"""Linear layers that route every call through ``models.dispatch``.

``WeightOnlyLinear`` holds a weight in the logical quantized format (``kernels/format.py``)
and, on CUDA, the same weight repacked once into the GPU kernels' layout.
``DenseLinear`` is the unquantized twin (``--quant none``, and an LM head left unquantized),
so that metrics see every layer; on CUDA its decode rows go through the in-repo dense GEMV.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import reference
from ..kernels.format import GATE_UP_BLOCK, QuantizedWeight, QuantSpec, quantize
from . import dispatch


def _forward(layer: dispatch.Dispatchable, x: torch.Tensor, swiglu: bool, float_out: bool = False) -> torch.Tensor:
    y = dispatch.linear(x.reshape(-1, x.shape[-1]), layer, swiglu, float_out)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU of a layer's plain ``[gate, up]`` output: the fused Triton kernel on CUDA, else
    the torch ops."""
    if gate_up.is_cuda:
        try:
            from ..kernels import fused
        except ImportError:  # no Triton
            pass
        else:
            return fused.silu_mul(gate_up)
    return reference.silu_mul(gate_up)


class DenseLinear(nn.Module):
    bits = 16
    # Rows of x the dense GEMV serves (path dense_gemv) where it takes the weight, at most
    # ops.DENSE_GEMV_MAX_M; more go to cuBLAS (F.linear). 0 turns it off. 2: at 4 rows it was
    # slower than cuBLAS for some shapes (0.70-0.84x at SmolLM2's LM head and Llama-3-8B's
    # qkv and o; H100, docs/bench/dense_gemv.md), at 1 and 2 faster for all (1.06-1.23x).
    dense_gemv_rows = 2

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, layer_kind: str):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.layer_kind = layer_kind
        self.out_features, self.in_features = weight.shape
        self._gemv_rows: tuple[int, int] | None = None  # (the weight's address, its rows): see gemv_max_rows

    def has_gpu_kernels(self) -> bool:
        return False

    def gemv_max_rows(self) -> int:
        """Rows the dense GEMV takes for this weight: 0 off CUDA or without the kernels."""
        w = self.weight
        if not w.is_cuda:
            return 0
        if self._gemv_rows is None or self._gemv_rows[0] != w.data_ptr():  # (found once per placement)
            from ..kernels import ops

            self._gemv_rows = (w.data_ptr(), ops.dense_gemv_max_rows(w) if ops.available() else 0)
        return min(self._gemv_rows[1], self.dense_gemv_rows)

    def kernel_max_rows(self) -> int:
        return 0

    def run(self, path: str, x: torch.Tensor, swiglu: bool = False, float_out: bool = False) -> torch.Tensor:
        if path == dispatch.DENSE_GEMV:
            from ..kernels import ops

            if not swiglu:  # (logits: the kernel stores float32, no conversion kernel after it)
                return ops.dense_gemv(x, self.weight, self.bias, float_out)
            y = ops.dense_gemv(x, self.weight, self.bias)
        else:
            y = F.linear(x, self.weight, self.bias)
        y = _silu_mul(y) if swiglu else y
        return y.float() if float_out else y

    def gate_and_up(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A SwiGLU layer's output split into its gate and up projections."""
        return reference.gate_and_up(y)

    def forward(self, x: torch.Tensor, swiglu: bool = False) -> torch.Tensor:
        """``x @ W.T + b``, or with ``swiglu`` (the fused gate/up layer of a SwiGLU MLP)
        ``silu(gate) * up`` of it."""
        return _forward(self, x, swiglu)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``forward(x).float()``, an LM head's logits (the dense GEMV writes them as float32)."""
        return _forward(self, x, False, float_out=True)


class WeightOnlyLinear(nn.Module):
    def __init__(
        self,
        qweight: QuantizedWeight,
        bias: torch.Tensor | None,
        layer_kind: str,
        cache_dequantized: bool = True,
        in_perm: torch.Tensor | None = None,
    ):
        super().__init__()
        self.layer_kind = layer_kind
        self.bits = qweight.bits
        self.group_size = qweight.group_size
        self.in_features = qweight.in_features
        self.out_features = qweight.out_features
        self.register_buffer("packed", qweight.packed)
        self.register_buffer("scales", qweight.scales)
        self.register_buffer("zeros", qweight.zeros)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # Act-order imports keep contiguous groups over permuted input columns: the layer
        # gathers its input columns in that order first (models/importers.py).
        self.register_buffer("in_perm", None if in_perm is None else in_perm.to(torch.long))
        self.cache_dequantized = cache_dequantized
        self._dequantized: torch.Tensor | None = None
        self.gpu = None  # kernels.layout.GpuWeight once prepared for CUDA
        self.gpu_bias = None  # the bias in the GPU weight's row order

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, spec: QuantSpec, layer_kind: str, **kw):
        return cls(quantize(weight, spec), bias, layer_kind, **kw)

    @property
    def qweight(self) -> QuantizedWeight:
        return QuantizedWeight(
            self.packed, self.scales, self.zeros, self.bits, self.group_size, self.in_features, self.out_features
        )

    def extra_repr(self) -> str:
        g = "channel" if self.group_size >= self.in_features else f"g{self.group_size}"
        sym = "sym" if self.zeros is None else "asym"
        return f"{self.layer_kind}: {self.in_features}->{self.out_features}, int{self.bits} {g} {sym}"

    # -- GPU layout --------------------------------------------------------------------
    def has_gpu_kernels(self) -> bool:
        return self.gpu is not None

    def gemv_max_rows(self) -> int:
        return self.gpu.gemv_max_m

    def kernel_max_rows(self) -> int:
        from ..kernels import ops

        return self.gpu.max_kernel_m if ops.supports_mixed_gemm(self.gpu) else self.gpu.gemv_max_m

    def prepare_gpu(self, act_dtype: torch.dtype, tune: bool = True) -> bool:
        """Repack the weight into the GPU kernels' layout (once, at load) and measure its
        launch choices (once per shape and GPU, cached). False if the kernels are
        unavailable here, in which case the layer keeps the reference path."""
        from ..kernels import ops  # lazy: CPU machines never import the CUDA binding

        if not (self.packed.is_cuda and ops.available()):
            return False
        from ..kernels.format import gate_up_row_order
        from ..kernels.layout import pack_for_gpu

        # A SwiGLU gate/up weight gets its rows interleaved (kernels/format.py), so that the
        # decode GEMV writes silu(gate) * up itself: one kernel less per layer and step.
        gate_up = self.layer_kind == "gate_up" and self.out_features % (2 * GATE_UP_BLOCK) == 0
        self.gpu = ops.prepare(pack_for_gpu(self.qweight, act_dtype, gate_up=gate_up), tune=tune)
        self.gpu_bias = self.bias
        if gate_up and self.bias is not None:
            self.gpu_bias = self.bias[gate_up_row_order(self.out_features, self.bias.device)].contiguous()
        return True

    # -- paths -------------------------------------------------------------------------
    def _cpu_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if not self.cache_dequantized:
            return reference.dequantize(self.qweight, dtype)
        if self._dequantized is None or self._dequantized.dtype != dtype:
            self._dequantized = reference.dequantize(self.qweight, dtype)
        return self._dequantized

    def run(self, path: str, x: torch.Tensor, swiglu: bool = False, float_out: bool = False) -> torch.Tensor:
        if path == dispatch.CPU_REFERENCE:
            y = reference.linear(x, self.qweight, self.bias, weight=self._cpu_weight(x.dtype))
            y = _silu_mul(y) if swiglu else y
        else:
            from ..kernels import ops

            y = ops.run_path(path, x, self.gpu, self.gpu_bias, swiglu)
        return y.float() if float_out else y

    def attends(self, batch: int, heads: int, kv_heads: int, head_dim: int) -> bool:
        """Whether, as a decode step's o projection, this layer's GEMV can do the step's
        attention too (``attend_and_project``) at this batch."""
        if self.gpu is None or self.in_perm is not None:
            return False
        from ..kernels import ops

        return ops.attention_gemv_supported(self.gpu, batch, heads, kv_heads, head_dim)

    def attend_and_project(self, qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                           lengths: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
        """The decode step's attention from ``qkv`` ``[B, (H + 2 Hkv) D]`` (RoPE, the cache
        write, live tokens only) and this o projection of it, in one kernel: ``[B, N]``
        (``kernels.ops.attention_gemv``; where ``attends``)."""
        from ..kernels import ops

        def compute() -> torch.Tensor:
            return ops.attention_gemv(qkv, positions, slots, lengths, cos, sin, k_cache, v_cache, heads, head_dim,
                                      self.gpu, self.gpu_bias)

        return dispatch.attention_linear(self, qkv.shape[0], compute)

    def gate_and_up(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A SwiGLU layer's output split into its gate and up projections (a CUDA output of
        the GPU kernels comes in their interleaved row order)."""
        return reference.gate_and_up(y, interleaved=y.is_cuda and self.gpu is not None and self.gpu.swiglu_rows)

    def forward(self, x: torch.Tensor, swiglu: bool = False) -> torch.Tensor:
        """``x @ W.T + b``, or with ``swiglu`` (the fused gate/up layer of a SwiGLU MLP)
        ``silu(gate) * up`` of it."""
        if self.in_perm is not None:
            x = x.index_select(-1, self.in_perm)
        return _forward(self, x, swiglu)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``forward(x).float()``, an LM head's logits."""
        return self(x).float()
