"""One FP8 layer per recipe, for the tests that probe a layer's edges."""

from __future__ import annotations

import torch
import torch.nn as nn

from fp8_lightning import (
    BlockwiseScaling,
    DelayedScaling,
    FP8Linear,
    MXFP8BlockScaling,
    RowwiseScaling,
    TensorwiseScaling,
)

EVERY_RECIPE = [DelayedScaling(), TensorwiseScaling(), MXFP8BlockScaling(), RowwiseScaling(), BlockwiseScaling()]


def fp8_layer(recipe, seed: int = 0) -> FP8Linear:
    """A seeded ``nn.Linear(64, 32)`` converted to FP8 under ``recipe``."""
    torch.manual_seed(seed)
    return FP8Linear.from_linear(nn.Linear(64, 32), recipe)
