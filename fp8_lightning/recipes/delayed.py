"""Delayed scaling (TransformerEngine's semantics): per-tensor scales from a rolling history of past amaxes.

The history advances once per optimizer step (:func:`fp8_lightning.scaling.update_scales`, which also agrees the
step's amaxes across data-parallel ranks); the first use of a tensor scales it just in time from its own amax.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from fp8_lightning.ops import dispatch
from fp8_lightning.formats import fp8_max
from fp8_lightning.recipes.base import AMAX_COMPUTE_ALGOS, invalid
from fp8_lightning.recipes.per_tensor import PerTensorRecipe
from fp8_lightning.scaling import delayed_scale

MAX_MARGIN = 32  # 2**-32 of the format's range: below it no value survives the cast
MAX_AMAX_HISTORY_LEN = 4096


@dataclasses.dataclass(frozen=True)
class DelayedScaling(PerTensorRecipe):
    """Per-tensor scaling from a rolling history of amaxes of previous steps.

    ``scale = (fp8_max / amax) / 2**margin`` with ``amax`` the maximum (``"max"``) or the newest
    (``"most_recent"``) entry of the last ``amax_history_len`` per-step amaxes. The first use of a tensor
    scales it just in time from its own amax. ``reduce_amax`` agrees amaxes across data-parallel ranks.

    Args:
        fp8_format: the FP8 formats (``Format.HYBRID``: E4M3 forward, E5M2 gradients; ``Format.E4M3``: E4M3
            everywhere), as an enum or its name.
        fprop_fast_accum: cuBLAS's fast accumulation for the forward GEMM on CUDA.
        grad_fast_accum: cuBLAS's fast accumulation for the two backward GEMMs on CUDA.
        margin: the scale is divided by ``2**margin`` (headroom above the amax).
        amax_history_len: how many steps' amaxes the scale is taken from.
        amax_compute_algo: ``"max"`` (the largest amax of the history) or ``"most_recent"``.
        power_of_2_scales: round scales down to a power of two.
        reduce_amax: agree the amaxes across ranks once per step (``sync_scales``).
    """

    name: ClassVar[str] = "delayed"
    keeps_history: ClassVar[bool] = True

    margin: int = 0
    amax_history_len: int = 16
    amax_compute_algo: str = "max"
    power_of_2_scales: bool = False
    reduce_amax: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        cls = type(self).__name__
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or not 0 <= self.margin <= MAX_MARGIN:
            raise invalid(
                cls, "margin", self.margin,
                f"an integer from 0 to {MAX_MARGIN} (each step of margin halves the scale: beyond {MAX_MARGIN} every "
                "value would flush to zero; TransformerEngine's default is 0)",
            )
        if (
            isinstance(self.amax_history_len, bool)
            or not isinstance(self.amax_history_len, int)
            or not 1 <= self.amax_history_len <= MAX_AMAX_HISTORY_LEN
        ):
            raise invalid(
                cls, "amax_history_len", self.amax_history_len,
                f"an integer from 1 to {MAX_AMAX_HISTORY_LEN} (TransformerEngine's default is 1024; each FP8 operand "
                "keeps a history this long and the step update reads all of them)",
            )
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise invalid(cls, "amax_compute_algo", self.amax_compute_algo, " or ".join(AMAX_COMPUTE_ALGOS))
        for flag in ("power_of_2_scales", "reduce_amax"):
            if not isinstance(getattr(self, flag), bool):
                raise invalid(cls, flag, getattr(self, flag), "True or False")

    @property
    def history_len(self) -> int:
        return self.amax_history_len

    def just_in_time_scale(self, state, clean_amax, host_amax):
        return delayed_scale(
            clean_amax.reshape(1), state.scale, fp8_max(state.dtype), self.margin, "max", self.power_of_2_scales
        )

    def stacked_just_in_time_scales(self, clean, prev, dtype):
        return delayed_scale(clean.unsqueeze(-1), prev, fp8_max(dtype), self.margin, "max", self.power_of_2_scales)

    def traced_scale(self, clean, scale, flags, dtype):
        """The stored scale; the first use scales just in time."""
        fresh = delayed_scale(clean.reshape(1), scale, fp8_max(dtype), self.margin, "max", self.power_of_2_scales)
        return torch.where(flags[0] > 0, scale, fresh)

    def state_cast(self, state, x, record, transpose):
        return dispatch.delayed_state_cast(state, x, record, transpose)

    def cast_bytes_per_element(self) -> float:
        """The amax comes out of the cast kernel itself: read (2) + write (1) + transposed copy (1 + 1)."""
        return 5.0
