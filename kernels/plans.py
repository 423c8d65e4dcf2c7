"""One kernel plan per linear layer, bound when the layer is loaded.

A plan holds what its layer needs to run: the weight in the form its kernels read, the
measured thresholds and launches, and the epilogue handling. ``plan.path(m)`` is the one
place where a call of M rows (batch x tokens) is given its implementation, and
``plan(x, epilogue)`` runs it:

=================  =========================================================================
path               when
=================  =========================================================================
``dense``          unquantized layer (``--quant none``, an unquantized LM head): ``F.linear``
                   (fp32 on the CPU: oneDNN's, ``cpu_linear.py``)
``dense_gemv``     unquantized layer, CUDA, M <= ``RuntimeOptions.dense_gemv_rows``
``cpu_reference``  quantized layer off CUDA, or without the compiled kernels: dequantize +
                   matmul (on the CPU, the weight dequantized once: ``cpu_linear.py``)
``gemv``           CUDA, M up to the measured reach (8, 16 or up to 32 rows)
``mixed_gemm``     CUDA, from there to the measured crossover: tensor-core GEMM with
                   fused dequantization
``dequant_cublas`` CUDA, larger M (prefill): dequantize to a scratch buffer + cuBLAS
=================  =========================================================================

Epilogues: ``SWIGLU`` (a SwiGLU MLP's fused gate/up layer) returns ``silu(gate) * up``:
in the GEMV's epilogue where it runs on a gate/up weight with interleaved rows, else
by the fused Triton kernel on CUDA, else (or with ``RuntimeOptions.fused_ops`` off) by
torch ops. ``LOGITS`` returns
``y.float()`` (the dense GEMV stores float32 itself).
"""
from __future__ import annotations

import enum

import torch
import torch.nn.functional as F

from . import reference
from .cpu_linear import CpuLinear
from .format import QuantizedWeight
from .layout import GpuWeight
from .limits import GEMV_RING, GEMV_STREAM
from .options import RuntimeOptions

DENSE = "dense"
DENSE_GEMV = "dense_gemv"
CPU_REFERENCE = "cpu_reference"
GEMV = "gemv"
MIXED_GEMM = "mixed_gemm"
DEQUANT_CUBLAS = "dequant_cublas"
# a CUDA batch-1 decode step with every decoder layer in one kernel (kernels/decode_step.py)
DECODE_STEP = "decode_step"
PATHS = (DENSE, DENSE_GEMV, CPU_REFERENCE, GEMV, MIXED_GEMM, DEQUANT_CUBLAS, DECODE_STEP)


class Epilogue(enum.Enum):
    NONE = 0
    SWIGLU = 1
    LOGITS = 2


def _silu_mul(y: torch.Tensor, interleaved: bool, options: RuntimeOptions) -> torch.Tensor:
    """SwiGLU of a gate/up output (``interleaved``: the GPU layout's row order)."""
    if y.is_cuda and options.fused_ops:
        from .fused import silu_mul

        return silu_mul(y, interleaved=interleaved, programmatic=options.programmatic_launch)
    gate, up = reference.gate_and_up(y, interleaved)
    return F.silu(gate) * up


def _finish(y: torch.Tensor, epilogue: Epilogue, interleaved: bool, options: RuntimeOptions) -> torch.Tensor:
    if epilogue is Epilogue.SWIGLU:
        return _silu_mul(y, interleaved, options)
    return y.float() if epilogue is Epilogue.LOGITS else y


class DensePlan:
    """An unquantized weight: the in-repo dense GEMV at decode rows on CUDA, else cuBLAS."""

    bits = 16
    swiglu_rows = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, options: RuntimeOptions, kernels: bool):
        self.weight, self.bias, self.options = weight, bias, options
        self.gemv_rows = 0
        if kernels and weight.is_cuda and options.dense_gemv_rows:  # (kernels: the library is loaded)
            from . import ops

            self.gemv_rows = min(options.dense_gemv_rows, ops.dense_gemv_max_rows(weight))
        # (the model's own weight, read where it is: no packed copy)
        self.linear = CpuLinear(weight, bias, packed=False, enabled=options.cpu_onednn)

    def path(self, m: int) -> str:
        return DENSE_GEMV if m <= self.gemv_rows else DENSE

    def __call__(self, x: torch.Tensor, epilogue: Epilogue = Epilogue.NONE) -> torch.Tensor:
        if self.path(x.shape[0]) == DENSE_GEMV:
            from . import ops

            if epilogue is not Epilogue.SWIGLU:  # (logits: the kernel stores float32 itself)
                return ops.dense_gemv(x, self.weight, self.bias, epilogue is Epilogue.LOGITS)
            y = ops.dense_gemv(x, self.weight, self.bias)
        else:
            y = self.linear(x)
        return _finish(y, epilogue, False, self.options)


class ReferencePlan:
    """A quantized weight off CUDA: torch's dequantize + matmul. With ``cache`` (CPU serving)
    the dequantized weight is kept, packed for oneDNN in fp32 (``cpu_linear.py``):
    dequantizing at every call would cost more than the matmul."""

    swiglu_rows = False

    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None, cache: bool, options: RuntimeOptions):
        self.qweight, self.bias, self.cache, self.options = qweight, bias, cache, options
        self.bits = qweight.bits
        self._linear: CpuLinear | None = None  # (the kept weight, in the dtype of the calls so far)

    def path(self, m: int) -> str:
        return CPU_REFERENCE

    def __call__(self, x: torch.Tensor, epilogue: Epilogue = Epilogue.NONE) -> torch.Tensor:
        if not self.cache:
            y = reference.linear(x, self.qweight, self.bias)
        else:
            if self._linear is None or self._linear.weight.dtype != x.dtype:
                self._linear = CpuLinear(reference.dequantize(self.qweight, x.dtype), self.bias, packed=True,
                                         enabled=self.options.cpu_onednn)
            y = self._linear(x)
        return _finish(y, epilogue, False, self.options)


def measured_gemv(grids: dict[int, tuple[int, int, int]], m: int, stream_max_m: int) -> tuple[int, int, int]:
    """The GEMV launch (k-warps, blocks, pipeline) for M rows from a table's ``grids`` (per
    measured M, each standing for the Ms up to it): the first measured M >= m whose pipeline
    takes m rows (the register stream takes at most ``stream_max_m``), else (0, 0, ring):
    the kernel's own choice."""
    for t in sorted(grids):
        if t >= m:
            k_warps, blocks, pipeline = grids[t]
            if pipeline == GEMV_STREAM and m > stream_max_m:
                continue
            return k_warps, blocks, pipeline
    return 0, 0, GEMV_RING


class KernelPlan:
    """A quantized weight in the GPU layout with its measured launches (``tuning.tuned``):
    the GEMV up to ``gemv_max_m`` rows, the mixed GEMM up to ``max_kernel_m``, dequantize +
    cuBLAS beyond."""

    def __init__(self, gw: GpuWeight, bias: torch.Tensor | None, entry: dict, options: RuntimeOptions):
        from . import ops

        self.gw, self.bias, self.options = gw, bias, options
        self.bits = gw.bits
        self.swiglu_rows = gw.swiglu_rows
        self.mixed_gemm = ops.supports_mixed_gemm(gw)
        self.gemv_max_m = entry["gemv_max_m"]
        self.max_kernel_m = entry["max_kernel_m"] if self.mixed_gemm else self.gemv_max_m
        # GEMV launch per measured M, each standing for the Ms up to it: (k-warps, blocks,
        # pipeline); mixed-GEMM launch per M bound: (tile config, split-K)
        self.grids = {int(m): tuple(v) for m, v in entry["grids"].items()}
        self.gemm_plan = {int(m): tuple(v) for m, v in entry["gemm"].items()}
        stream_max_m = ops.limits().stream_max_m
        self._gemv_launch = {m: measured_gemv(self.grids, m, stream_max_m) for m in range(1, ops.gemv_rows_limit(gw) + 1)}
        self._gemm_bounds = sorted(self.gemm_plan)
        ops.prepare(gw)  # (the scratch this layer needs, if not reserved already)

    def gemm_launch(self, m: int) -> tuple[int, int]:
        """(tile config, split-K) for M rows: the measured plan's smallest bound >= M (its
        largest beyond them), or the kernel's own choice (-1, 0) without one."""
        if not self._gemm_bounds:
            return -1, 0
        bound = next((b for b in self._gemm_bounds if b >= m), self._gemm_bounds[-1])
        return self.gemm_plan[bound]

    def path(self, m: int) -> str:
        if m <= self.gemv_max_m:
            return GEMV
        return MIXED_GEMM if m <= self.max_kernel_m else DEQUANT_CUBLAS

    def _gemv_swiglu(self, epilogue: Epilogue) -> bool:
        """Whether a GEMV call runs ``epilogue`` in its own epilogue: SwiGLU, on a gate/up
        weight with interleaved rows (one of the fused ops: their reference is torch's)."""
        return epilogue is Epilogue.SWIGLU and self.gw.swiglu_rows and self.options.fused_ops

    def epilogue_in_kernel(self, m: int, epilogue: Epilogue) -> bool:
        """Whether a call of M rows with ``epilogue`` is one kernel: no epilogue, or SwiGLU
        in the GEMV's own epilogue; else the epilogue is a kernel of its own after it."""
        return epilogue is Epilogue.NONE or (self.path(m) == GEMV and self._gemv_swiglu(epilogue))

    def __call__(self, x: torch.Tensor, epilogue: Epilogue = Epilogue.NONE,
                 stamps: torch.Tensor | None = None) -> torch.Tensor:
        """``stamps``: a timed call's block stamps (``ops.gemv``, ``ops.gemm``; dequantize +
        cuBLAS takes none)."""
        from . import ops

        m, gw = x.shape[0], self.gw
        path = self.path(m)
        if path == GEMV:
            k_warps, blocks, pipeline = self._gemv_launch[m]
            fused = self._gemv_swiglu(epilogue)
            y = ops.gemv(x, gw, self.bias, blocks, k_warps, pipeline, swiglu=fused, stamps=stamps)
            if fused:
                return y
        elif path == MIXED_GEMM:
            y = ops.gemm(x, gw, self.bias, *self.gemm_launch(m), stamps=stamps)
        else:
            if x.dtype != gw.dtype:
                raise TypeError(f"activations are {x.dtype}, the weight was packed for {gw.dtype}")
            y = F.linear(x, ops.dequantize(gw), self.bias)
        return _finish(y, epilogue, gw.swiglu_rows, self.options)


def kernel_plan(qweight: QuantizedWeight, bias: torch.Tensor | None, act_dtype: torch.dtype, gate_up: bool,
                options: RuntimeOptions) -> KernelPlan:
    """The GPU plan of a quantized weight on CUDA (the library loaded): the weight repacked
    into the kernels' layout -- a SwiGLU gate/up weight with its rows interleaved, so that the
    decode GEMV writes silu(gate) * up itself -- and its launches from the tuning table."""
    from . import ops, tuning
    from .format import gate_up_row_order
    from .layout import pack_for_gpu

    gw = ops.prepare(pack_for_gpu(qweight, act_dtype, gate_up=gate_up))  # (scratch first: tuning runs it)
    if gate_up and bias is not None:
        bias = bias[gate_up_row_order(qweight.out_features, bias.device)].contiguous()
    return KernelPlan(gw, bias, tuning.tuned(gw, options), options)
