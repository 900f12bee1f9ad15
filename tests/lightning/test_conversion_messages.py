"""What the plugin says about a conversion: the recipe on the headline (never glued to a skipped layer's
reason), and a warning when nothing was converted."""

import logging

import lightning as L
import pytest
import torch.nn as nn

from fp8_lightning import FP8Precision


class Model(L.LightningModule):
    def __init__(self, width: int):
        super().__init__()
        self.small, self.big = nn.Linear(width, 8), nn.Linear(64, 64)


def test_conversion_line_puts_the_recipe_on_the_headline(caplog):
    with caplog.at_level(logging.INFO):
        FP8Precision(recipe="tensorwise").convert_module(Model(64))
    lines = "\n".join(r.getMessage() for r in caplog.records).splitlines()
    headline = next(line for line in lines if line.startswith("FP8 conversion:"))
    assert headline.endswith("1 layer(s) converted, 1 skipped (recipe TensorwiseScaling, precision 'fp8-tensorwise')")
    skipped = next(line for line in lines if "skipped small" in line)
    assert skipped.endswith("(TensorwiseScaling)")  # the reason alone


def test_a_conversion_that_converts_nothing_warns():
    model = nn.Sequential(nn.Linear(10, 6), nn.ReLU())
    with pytest.warns(UserWarning, match=r"converted no layer of Sequential: it trains entirely in high precision"):
        FP8Precision().convert_module(model)
