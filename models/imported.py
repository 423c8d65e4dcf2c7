"""A quantized linear as read from a checkpoint (GPTQ/AWQ imports, woq checkpoints, a
tensor-parallel rank's share of either), and the error a checkpoint that cannot be read
raises. Kept apart from the readers so that the sharding math, which they use to cut a
share, does not import them."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.format import QuantizedWeight


class CheckpointError(ValueError):
    pass


@dataclass
class ImportedLinear:
    weight: QuantizedWeight
    in_perm: torch.Tensor | None = None  # input columns to gather before the matmul
