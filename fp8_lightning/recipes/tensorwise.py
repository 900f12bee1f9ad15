"""Tensorwise ("current", just-in-time) scaling: ``scale = fp8_max / max(amax, eps)`` from the tensor being cast.

An all-zero or non-finite tensor keeps the previous scale. Nothing carries over between steps but that scale.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from fp8_lightning.ops import dispatch
from fp8_lightning.quantize import tensorwise_scale, tensorwise_scale_value
from fp8_lightning.recipes.base import invalid
from fp8_lightning.recipes.per_tensor import PerTensorRecipe


@dataclasses.dataclass(frozen=True)
class TensorwiseScaling(PerTensorRecipe):
    """Per-tensor "current" scaling: ``scale = fp8_max / max(amax, eps)`` from the tensor being cast.

    Args:
        fp8_format: the FP8 formats (``Format.HYBRID``: E4M3 forward, E5M2 gradients; ``Format.E4M3``: E4M3
            everywhere), as an enum or its name.
        fprop_fast_accum: cuBLAS's fast accumulation for the forward GEMM on CUDA.
        grad_fast_accum: cuBLAS's fast accumulation for the two backward GEMMs on CUDA.
        power_of_2_scales: round scales down to a power of two.
        eps: the smallest amax a scale is made from (an all-zero tensor gets ``fp8_max / eps``).
    """

    name: ClassVar[str] = "tensorwise"

    power_of_2_scales: bool = False
    eps: float = 1e-12

    def __post_init__(self) -> None:
        super().__post_init__()
        cls = type(self).__name__
        if not isinstance(self.power_of_2_scales, bool):
            raise invalid(cls, "power_of_2_scales", self.power_of_2_scales, "True or False")
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or not 0 < self.eps < 1:
            raise invalid(cls, "eps", self.eps, "a number in (0, 1)")
        object.__setattr__(self, "eps", float(self.eps))

    def just_in_time_scale(self, state, clean_amax, host_amax):
        if host_amax is None:
            fresh = tensorwise_scale(clean_amax, state.dtype, self.eps, self.power_of_2_scales)
            return torch.where(clean_amax > 0, fresh, state.scale)
        if host_amax == 0.0:
            return state.scale  # an all-zero tensor keeps the previous scale
        value = tensorwise_scale_value(host_amax, state.dtype, self.eps, self.power_of_2_scales)
        return torch.scalar_tensor(value, dtype=torch.float32, device=clean_amax.device)

    def stacked_just_in_time_scales(self, clean, prev, dtype):
        return torch.where(clean > 0, tensorwise_scale(clean, dtype, self.eps, self.power_of_2_scales), prev)

    def traced_scale(self, clean, scale, flags, dtype):
        """The current scale; an all-zero or non-finite tensor keeps the previous one."""
        return torch.where(clean > 0, tensorwise_scale(clean, dtype, self.eps, self.power_of_2_scales), scale)

    def state_cast(self, state, x, record, transpose):
        return dispatch.tensorwise_state_cast(state, x, transpose, self.eps, self.power_of_2_scales)

    def cast_bytes_per_element(self) -> float:
        """Amax read (2) + cast read (2) + write (1) + transposed copy (1 + 1)."""
        return 7.0
