"""The FP8 precision strings (``Trainer(precision="fp8-hybrid")``) and the recipe each one stands for.

===================  ===========================================================================================
``"fp8-hybrid"``     HYBRID format (E4M3 forward, E5M2 gradients), ``DelayedScaling(amax_history_len=16,
                     amax_compute_algo="max")``: TransformerEngine's default and the usual choice
``"fp8-e4m3"``       E4M3 in forward and backward, delayed scaling (more precision, less range for gradients)
``"fp8-tensorwise"`` HYBRID with current (just-in-time) per-tensor scaling: no history, robust to spikes
``"fp8-mxfp8"``      MXFP8: E4M3 blocks of 32 along K with power-of-two (E8M0) scales
``"fp8-rowwise"``    E4M3, one power-of-two scale per row of each GEMM operand (torchao's ``rowwise``)
``"fp8-blockwise"``  E4M3, 1x128 tiles for activations and gradients, 128x128 blocks for weights (DeepSeek-V3)
``"fp4-nvfp4"``      NVFP4: E2M1 in 1x16 blocks with E4M3 scales and a tensor scale, 16x16 weight tiles, RHT on the
                     wgrad operands, stochastic rounding of gradients (``NVFP4BlockScaling()``; emulated)
===================  ===========================================================================================

``"fp8-<recipe name>"`` for every other recipe (``"fp8-delayed"``: ``DelayedScaling()`` with its defaults) is accepted
too: it is what ``trainer.precision`` reports for a plugin whose recipe is not one of the rows above, so the string
a run reports can always be passed back to ``Trainer(precision=...)``.

The design in full: ``docs/design/notes.md``, section ``fp8_lightning.lightning.strings``.
"""

from __future__ import annotations

import typing
from typing import Any, Iterable, Literal

from fp8_lightning.formats import Format
from fp8_lightning.recipes import (
    BlockwiseScaling,
    DelayedScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    RECIPES,
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
    "fp4-nvfp4": NVFP4BlockScaling(),
}
PRECISION_STRINGS = tuple(PRECISION_RECIPES)
# "fp8-<recipe name>" for the recipes without a row above: the recipe with its defaults (what precision_for_recipe
# reports for a plugin built on a recipe that is not in PRECISION_RECIPES).
RECIPE_PRECISIONS: dict[str, Recipe] = {
    f"fp8-{name}": cls() for name, cls in RECIPES.items() if f"fp8-{name}" not in PRECISION_RECIPES
}
ACCEPTED_PRECISION_STRINGS = PRECISION_STRINGS + tuple(RECIPE_PRECISIONS)


def is_fp8_precision(value: Any) -> bool:
    """True for any string that claims to be one of this package's precisions (``"fp8..."`` or ``"fp4..."``, any
    case), valid or not."""
    return isinstance(value, str) and value.strip().lower().startswith(("fp8", "fp4"))


def recipe_for_precision(name: str) -> Recipe:
    """The recipe of a precision string; an unknown ``"fp8-..."`` string gets an error listing the valid ones."""
    key = name.strip().lower()
    recipe = PRECISION_RECIPES.get(key) or RECIPE_PRECISIONS.get(key)
    if recipe is None:
        raise ValueError(
            f"precision={name!r} is not a known FP8 precision; allowed: {', '.join(ACCEPTED_PRECISION_STRINGS)}. "
            "For another recipe pass plugins=[FP8Precision(recipe=...)]."
        )
    return recipe


def precision_for_recipe(recipe: Recipe) -> str:
    """The string ``trainer.precision`` reports for a plugin built on ``recipe``: the registered string when the
    recipe is one of them, else ``"fp8-<recipe name>"`` (for example ``"fp8-delayed"``), which ``Trainer(precision=)``
    also accepts (the recipe with its defaults: a customised recipe is reported by its family's name)."""
    for name, registered in PRECISION_RECIPES.items():
        if registered == recipe:
            return name
    return f"fp8-{recipe.name}"


def precision_choices(existing: Iterable[str] | Any = ()) -> Any:
    """``existing`` precision choices plus the FP8 strings, for a program that checks ``precision`` against its own
    list (litgpt's ``--precision``): a tuple for a list or tuple of strings, a ``typing.Literal`` for a Literal.
    The strings work where the Lightning connector sees them (``Trainer(precision=...)``/``Fabric(precision=...)``
    after ``import fp8_lightning``)."""
    if typing.get_origin(existing) is Literal:
        values = typing.get_args(existing)
        return Literal[tuple(dict.fromkeys((*values, *ACCEPTED_PRECISION_STRINGS)))]  # type: ignore[valid-type]
    if isinstance(existing, str):
        raise TypeError(
            "precision_choices takes a list, tuple or typing.Literal of precision strings; "
            f"got the string {existing!r}. "
            f"Wrap it in a list: precision_choices([{existing!r}])."
        )
    return tuple(dict.fromkeys((*existing, *ACCEPTED_PRECISION_STRINGS)))
