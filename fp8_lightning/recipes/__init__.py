"""Scaling recipes, one module per recipe: the frozen dataclass and its behaviour behind the protocol of
:class:`~fp8_lightning.recipes.base.Recipe`.

* :class:`DelayedScaling`: per-tensor scale from the amax history of previous steps (TE semantics).
* :class:`TensorwiseScaling`: per-tensor scale from the tensor being cast ("current" / just-in-time scaling).
* :class:`MXFP8BlockScaling`: blocks of 32 along the reduction dimension share a power-of-two E8M0 scale.
* :class:`RowwiseScaling`: one scale per row of each GEMM operand, along its reduction dimension.
* :class:`BlockwiseScaling`: 1x128 tiles for inputs and output gradients, 128x128 blocks for weights.
* :class:`NVFP4BlockScaling`: E2M1 values in 1x16 blocks with E4M3 scales and a tensor scale (16x16 weight tiles).

Recipes build from a name or a plain dict so that YAML/Hydra configs carry them::

    DelayedScaling(margin=1)
    recipe_from("tensorwise")
    recipe_from({"name": "delayed", "amax_history_len": 32, "fp8_format": "hybrid"})

A new recipe subclasses :class:`Recipe` (or a family: :class:`PerTensorRecipe`, :class:`FineGrainedRecipe`) with a
``name``; it is then found by that name everywhere a built-in one is.
"""

from fp8_lightning.kernels.availability import MX_BLOCK_SIZES, SCALE_ROUNDINGS
from fp8_lightning.recipes.base import (
    ALIASES,
    AMAX_COMPUTE_ALGOS,
    RECIPES,
    Recipe,
    RecipeLike,
    recipe_from,
)
from fp8_lightning.recipes.blockwise import BlockwiseScaling
from fp8_lightning.recipes.delayed import DelayedScaling
from fp8_lightning.recipes.fine_grained import FineGrainedRecipe
from fp8_lightning.recipes.mxfp8 import MXFP8BlockScaling
from fp8_lightning.recipes.nvfp4 import NVFP4BlockScaling
from fp8_lightning.recipes.per_tensor import PerTensorRecipe
from fp8_lightning.recipes.rowwise import RowwiseScaling
from fp8_lightning.recipes.tensorwise import TensorwiseScaling

__all__ = [
    "ALIASES",
    "AMAX_COMPUTE_ALGOS",
    "MX_BLOCK_SIZES",
    "RECIPES",
    "SCALE_ROUNDINGS",
    "BlockwiseScaling",
    "DelayedScaling",
    "FineGrainedRecipe",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "PerTensorRecipe",
    "Recipe",
    "RecipeLike",
    "RowwiseScaling",
    "TensorwiseScaling",
    "recipe_from",
]
