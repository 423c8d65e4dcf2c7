"""fp32 linear layers on the CPU through oneDNN's matmul instead of torch's ``F.linear``.

torch's ``F.linear`` on the CPU calls MKL's sgemm on the row-major weight. oneDNN's linear
(``torch.ops.mkldnn._linear_pointwise``, the op torch's own compiler emits for the linears
of a frozen CPU model) runs the same product faster at decode batches and on an LM head's
wide weight (docs/design/cpu_linear.md has the measurements).

* ``packed`` (a weight the layer owns, such as a quantized layer's dequantized copy): the
  weight is reordered once into oneDNN's blocked layout, and the copy is what the layer
  keeps. Each output row then gets the same bits whatever the number of rows beside it
  (its sums over K run in the order the blocked layout fixes), so a request's tokens do
  not depend on the batch it shares; MKL's sgemm rounds small batches' rows differently.
  One exception is found at packing: with AVX-512, oneDNN's matmul may take a sum order
  of its own for a single row (seen for K > 1024). A layer whose single row does not get
  the bits it gets beside another runs one row as two, the row twice (its cost:
  cpu_linear.md).
* plain (a weight the model holds, such as an unquantized LM head): oneDNN reads it where
  it is, without a copy (one row takes oneDNN's matrix-vector path: bits of its own).

Other dtypes, or a torch without oneDNN, keep ``F.linear``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# oneDNN's reorder picks the blocked layout for a typical number of rows; every row count
# runs on it (16: a decode batch, measured against 1 and 64 in cpu_linear.md).
ROWS_HINT = 16


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class CpuLinear:
    """``x @ weight.T + bias`` for 2-D ``x`` of the weight's dtype (see the module's docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool, enabled: bool = True):
        self.bias = bias
        self.onednn = enabled and onednn_available() and weight.dtype == torch.float32 and weight.device.type == "cpu"
        self.weight = weight
        self.one_row_as_two = False
        if self.onednn and packed:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ROWS_HINT)
            self.one_row_as_two = not self._one_row_agrees()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn:
            if self.one_row_as_two and x.shape[0] == 1:
                return self._onednn(x.expand(2, -1))[:1]
            return self._onednn(x)
        return F.linear(x, self.weight, self.bias)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")

    def _one_row_agrees(self) -> bool:
        """Whether a row alone gets the bits it gets beside another, on fixed random rows (a
        different order of a long sum changes some of the outputs' bits all but surely)."""
        x = torch.randn(2, self.weight.shape[1], generator=torch.Generator().manual_seed(0), dtype=self.weight.dtype)
        return torch.equal(self._onednn(x[:1]), self._onednn(x)[:1])
