"""The FP8 precision strings (``Trainer(precision="fp8-hybrid")``) and the recipe each one stands for.

===================  ===========================================================================================
``"fp8-hybrid"``     HYBRID format (E4M3 forward, E5M2 gradients), ``DelayedScaling(amax_history_len=16,
                     amax_compute_algo="max")``: TransformerEngine's default and the usual choice
``"fp8-e4m3"``       E4M3 in forward and backward, delayed scaling (more precision, less range for gradients)
``"fp8-tensorwise"`` HYBRID with current (just-in-time) per-tensor scaling: no history, robust to spikes
``"fp8-mxfp8"``      MXFP8: E4M3 blocks of 32 along K with power-of-two (E8M0) scales
``"fp8-rowwise"``    E4M3, one power-of-two scale per row of each GEMM operand (torchao's ``rowwise``)
``"fp8-blockwise"``  E4M3, 1x128 tiles for activations and gradients, 128x128 blocks for weights (DeepSeek-V3)
===================  ===========================================================================================

Plain data and lookups only; registration with Lightning is in :mod:`fp8_lightning.lightning.registration`.
"""

from __future__ import annotations

from typing import Any

from fp8_lightning.formats import Format
from fp8_lightning.recipes import (
    BlockwiseScaling,
    DelayedScaling,
    MXFP8BlockScaling,
    Recipe,
    RowwiseScaling,
    TensorwiseScaling,
)

PRECISION_RECIPES: dict[str, Recipe] = {
    "fp8-hybrid": DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max"),
    "fp8-e4m3": DelayedScaling(fp8_format=Format.E4M3),
    "fp8-tensorwise": TensorwiseScaling(fp8_format=Format.HYBRID),
    "fp8-mxfp8": MXFP8BlockScaling(),
    "fp8-rowwise": RowwiseScaling(),
    "fp8-blockwise": BlockwiseScaling(),
}
PRECISION_STRINGS = tuple(PRECISION_RECIPES)


def is_fp8_precision(value: Any) -> bool:
    """True for any string that claims to be an FP8 precision (``"fp8..."``, any case), valid or not."""
    return isinstance(value, str) and value.strip().lower().startswith("fp8")


def recipe_for_precision(name: str) -> Recipe:
    """The recipe of a precision string; an unknown ``"fp8-..."`` string gets an error listing the valid ones."""
    key = name.strip().lower()
    if key not in PRECISION_RECIPES:
        raise ValueError(
            f"precision={name!r} is not a known FP8 precision; allowed: {', '.join(PRECISION_STRINGS)}. "
            "For another recipe pass plugins=[FP8Precision(recipe=...)]."
        )
    return PRECISION_RECIPES[key]


def precision_for_recipe(recipe: Recipe) -> str:
    """The string ``trainer.precision`` reports for a plugin built on ``recipe``: the registered string when the
    recipe is one of them, else ``"fp8-<recipe name>"`` (for example ``"fp8-delayed"``)."""
    for name, registered in PRECISION_RECIPES.items():
        if registered == recipe:
            return name
    return f"fp8-{recipe.name}"
