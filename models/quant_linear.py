"""Linear layers that route every call through ``models.dispatch``.

``WeightOnlyLinear`` holds a weight in the logical quantized format (``kernels/format.py``)
and, on CUDA, the same weight repacked once into the GPU kernels' layout.
``DenseLinear`` is the unquantized twin (``--quant none``), so that metrics see every layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import reference
from ..kernels.format import QuantizedWeight, QuantSpec, quantize
from . import dispatch


def _forward(layer: dispatch.Dispatchable, x: torch.Tensor) -> torch.Tensor:
    y = dispatch.linear(x.reshape(-1, x.shape[-1]), layer)
    return y.reshape(*x.shape[:-1], y.shape[-1])


class DenseLinear(nn.Module):
    bits = 16

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, layer_kind: str):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.layer_kind = layer_kind
        self.out_features, self.in_features = weight.shape

    def has_gpu_kernels(self) -> bool:
        return False

    def gemv_max_rows(self) -> int:
        return 0

    def kernel_max_rows(self) -> int:
        return 0

    def run(self, path: str, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _forward(self, x)


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
        from ..kernels.layout import pack_for_gpu

        self.gpu = ops.prepare(pack_for_gpu(self.qweight, act_dtype), tune=tune)
        return True

    # -- paths -------------------------------------------------------------------------
    def _cpu_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if not self.cache_dequantized:
            return reference.dequantize(self.qweight, dtype)
        if self._dequantized is None or self._dequantized.dtype != dtype:
            self._dequantized = reference.dequantize(self.qweight, dtype)
        return self._dequantized

    def run(self, path: str, x: torch.Tensor) -> torch.Tensor:
        if path == dispatch.CPU_REFERENCE:
            return reference.linear(x, self.qweight, self.bias, weight=self._cpu_weight(x.dtype))
        from ..kernels import ops

        return ops.run_path(path, x, self.gpu, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_perm is not None:
            x = x.index_select(-1, self.in_perm)
        return _forward(self, x)
