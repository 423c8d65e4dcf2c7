"""Linear layers whose every call goes through the kernel plan bound at load
(``kernels/plans.py``).

``WeightOnlyLinear`` holds a weight in the logical quantized format (``kernels/format.py``);
on CUDA ``bind`` repacks it once into the GPU kernels' layout inside a ``KernelPlan``.
``DenseLinear`` is the unquantized twin (``--quant none``, and an LM head left unquantized),
so that metrics see every layer.
"""
from __future__ import annotations

import torch
from torch import nn

from ..kernels import reference
from ..kernels.format import GATE_UP_BLOCK, QuantizedWeight, QuantSpec, quantize
from ..kernels.layout import refusal_of
from ..kernels.observe import KernelTiming, ObservedPlan
from ..kernels.options import RuntimeOptions
from ..kernels.plans import DensePlan, Epilogue, KernelPlan, ReferencePlan, kernel_plan


class _PlannedLinear(nn.Module):
    """What both layers share: the plan, its observation, the forward over any leading dims."""

    layer_kind: str
    in_features: int
    out_features: int

    def _set_plan(self, plan) -> None:
        self.plan = self._plan = plan  # (_plan: unobserved, kept when observation changes)

    def observe(self, timing: KernelTiming | None) -> None:
        """Count and sample this layer's calls with ``timing`` (None: stop)."""
        self.plan = self._plan if timing is None else ObservedPlan(
            self._plan, timing, self.layer_kind, self.out_features, self.in_features, self._group_size(),
            getattr(self, "zeros", None) is not None)

    def _group_size(self) -> int:
        """The call's scale group for the metrics' byte counts (0: per channel or unquantized)."""
        g = getattr(self, "group_size", 0) or 0
        return 0 if g >= self.in_features else g

    def forward(self, x: torch.Tensor, epilogue: Epilogue = Epilogue.NONE) -> torch.Tensor:
        """``x @ W.T + b``; with ``Epilogue.SWIGLU`` (a SwiGLU MLP's fused gate/up layer)
        ``silu(gate) * up`` of it, with ``Epilogue.LOGITS`` as float32."""
        y = self.plan(x.reshape(-1, x.shape[-1]), epilogue)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``forward(x).float()``, an LM head's logits."""
        return self(x, Epilogue.LOGITS)

    def gate_and_up(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A SwiGLU layer's plain output split into its gate and up projections (the GPU
        kernels' output comes in their interleaved row order)."""
        return reference.gate_and_up(y, interleaved=y.is_cuda and self._plan.swiglu_rows)


class DenseLinear(_PlannedLinear):
    bits = 16

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, layer_kind: str,
                 options: RuntimeOptions | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.layer_kind = layer_kind
        self.out_features, self.in_features = weight.shape
        self.bind(options or RuntimeOptions(), kernels=False)

    def bind(self, options: RuntimeOptions, kernels: bool) -> None:
        """Choose the layer's kernels for where its weight is now (after a move, bind again);
        ``kernels``: the CUDA library is loaded."""
        self._set_plan(DensePlan(self.weight, self.bias, options, kernels))


class WeightOnlyLinear(_PlannedLinear):
    def __init__(
        self,
        qweight: QuantizedWeight,
        bias: torch.Tensor | None,
        layer_kind: str,
        cache_dequantized: bool = True,
        in_perm: torch.Tensor | None = None,
        options: RuntimeOptions | None = None,
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
        self._set_plan(ReferencePlan(self.qweight, self.bias, cache_dequantized, options or RuntimeOptions()))

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

    @property
    def gpu(self):
        """The weight in the GPU layout (``kernels.layout.GpuWeight``) where the layer runs the
        CUDA kernels, else None."""
        return self._plan.gw if isinstance(self._plan, KernelPlan) else None

    def bind(self, act_dtype: torch.dtype, options: RuntimeOptions, gpu: bool) -> None:
        """Choose the layer's kernels: with ``gpu`` (a CUDA weight, the library loaded) the
        weight is repacked once into the kernels' layout and its launches come from the tuning
        table (measured once per shape and GPU if new); otherwise, or where the GPU layout cannot
        hold the weight (``kernels.layout.refusal_of``), the torch reference."""
        if gpu and refusal_of(self.qweight) is None:
            gate_up = self.layer_kind == "gate_up" and self.out_features % (2 * GATE_UP_BLOCK) == 0
            self._set_plan(kernel_plan(self.qweight, self.bias, act_dtype, gate_up, options))
        else:
            self._set_plan(ReferencePlan(self.qweight, self.bias, self.cache_dequantized, options))

    def forward(self, x: torch.Tensor, epilogue: Epilogue = Epilogue.NONE) -> torch.Tensor:
        if self.in_perm is not None:
            x = x.index_select(-1, self.in_perm)
        return super().forward(x, epilogue)
