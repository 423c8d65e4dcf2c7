"""What a model's linear layers are quantized to, as ``--quant`` / ``--group-size`` / ``--sym``
ask: checked when the flags are parsed, so that this module imports no torch (a bad flag
is answered before the seconds torch takes to import)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from ..kernels.format import QuantSpec

QuantMode = Literal["int8", "int4", "none"]


@dataclass(frozen=True)
class QuantConfig:
    """What ``--quant`` / ``--group-size`` / ``--sym`` ask for.

    Defaults follow the seeds: int8 symmetric per-channel absmax; int4 group-wise (g128)
    asymmetric min-max with zero points, as GPTQ checkpoints are.
    """

    mode: QuantMode = "int8"
    group_size: int | None = None  # None: the mode's default; 0: per-channel
    symmetric: bool | None = None  # None: the mode's default
    quantize_lm_head: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ("int8", "int4", "none"):
            raise ValueError(f"quant must be int8, int4 or none, got {self.mode!r}")
        if self.group_size not in (None, 0) and self.group_size not in (32, 64, 128, 256):
            raise ValueError(f"group size must be 0 (per-channel), 32, 64, 128 or 256, got {self.group_size}")

    def spec(self) -> QuantSpec | None:
        from ..kernels.format import QuantSpec  # (torch: not needed to check flags)

        if self.mode == "none":
            return None
        bits = 8 if self.mode == "int8" else 4
        g = self.group_size if self.group_size is not None else (0 if bits == 8 else 128)
        sym = self.symmetric if self.symmetric is not None else bits == 8
        return QuantSpec(bits=bits, group_size=g or None, symmetric=sym)

    def describe(self) -> str:
        spec = self.spec()
        return "none (dense)" if spec is None else spec.describe()
