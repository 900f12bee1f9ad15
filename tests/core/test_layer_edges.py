"""What a layer does with inputs and settings at the edges: empty batches, inputs of the wrong shape, delayed
scaling fields that would crash or crawl, and a second conversion that excludes a layer converted before."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fp8_lightning import (
    DelayedScaling,
    FP8Linear,
    MXFP8BlockScaling,
    RowwiseScaling,
    TensorwiseScaling,
    fp8_autocast,
)
from tests.helpers.layers import EVERY_RECIPE, fp8_layer


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("recipe", EVERY_RECIPE + [RowwiseScaling(high_precision_wgrad=True)], ids=lambda r: r.name)
def test_an_empty_batch_gives_an_empty_output_and_zero_gradients(recipe, compiled):
    """M = 0 (an empty last micro-batch, an expert no token chose): no cast runs, nothing is booked."""
    layer = fp8_layer(recipe)
    x = torch.randn(0, 5, 64, requires_grad=True)
    forward = torch.compile(layer, backend="aot_eager", fullgraph=True) if compiled else layer
    with fp8_autocast():
        y = forward(x)
    assert y.shape == (0, 5, 32)
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(layer.weight.grad, torch.zeros_like(layer.weight))
    assert torch.equal(layer.bias.grad, torch.zeros_like(layer.bias))
    with torch.no_grad(), fp8_autocast():
        assert layer(torch.randn(0, 64)).shape == (0, 32)


@pytest.mark.parametrize("shape", [(), (4, 48)], ids=["0-d", "wrong-K"])
@pytest.mark.parametrize("recipe", [MXFP8BlockScaling(), TensorwiseScaling()], ids=lambda r: r.name)
def test_an_input_of_the_wrong_shape_is_refused_naming_in_features(recipe, shape):
    layer = fp8_layer(recipe)
    with fp8_autocast(), pytest.raises(ValueError, match=r"last dimension must be in_features=64"):
        layer(torch.randn(shape))


@pytest.mark.parametrize("field, value", [("margin", 200), ("margin", 1100), ("amax_history_len", 10**8)])
def test_delayed_fields_that_would_crash_or_crawl_are_refused(field, value):
    with pytest.raises(ValueError, match=rf"DelayedScaling.{field}={value} is invalid; allowed: an integer from"):
        DelayedScaling(**{field: value})


def test_a_second_conversion_that_excludes_an_fp8_layer_says_it_stays_fp8():
    from fp8_lightning import convert_to_fp8

    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 32))
    convert_to_fp8(model, TensorwiseScaling())
    report = convert_to_fp8(model, TensorwiseScaling(), module_filter_fn=lambda module, name: name != "1")
    assert report.converted == ["0"]
    assert report.skipped["1"].startswith("left in FP8 as an earlier conversion made it (tensorwise)")
    assert isinstance(model[1], FP8Linear) and model[1].fp8_recipe == TensorwiseScaling()
