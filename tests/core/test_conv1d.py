"""transformers' Conv1D (y = x @ W + b, W stored (in, out)) converts to FP8 in place: state_dict unchanged, and the
same bits as an nn.Linear holding W.T, forward and backward, on the eager and the traced path, for every recipe.
Modules of other types that hold a 2-D weight are named in the report."""

import pytest
import torch
import torch.nn as nn

from fp8_lightning import DelayedScaling, MXFP8BlockScaling, TensorwiseScaling, convert_to_fp8, fp8_autocast
from fp8_lightning.conv1d import FP8Conv1D

Conv1D = pytest.importorskip("transformers.pytorch_utils", reason="needs transformers (dev extras)").Conv1D
RECIPES = [DelayedScaling(), TensorwiseScaling(), MXFP8BlockScaling()]


def _pair(recipe):
    conv = Conv1D(64, 96)  # nf (out) = 64, nx (in) = 96
    with torch.no_grad():
        conv.bias.normal_()
    linear = nn.Linear(96, 64)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    before = {k: v.clone() for k, v in conv.state_dict().items()}
    report = convert_to_fp8(conv, recipe)
    convert_to_fp8(linear, recipe)
    assert report.converted == ["<root>"] and isinstance(conv, FP8Conv1D)
    return conv, linear, before


def _step(layer, x, g, traced):
    x = x.clone().requires_grad_()
    with fp8_autocast():
        y = layer._traced_forward(x, layer.fp8_recipe, x.dtype, False) if traced else layer(x)
    y.backward(g)
    return y, x.grad


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_conv1d_computes_the_bits_of_the_equivalent_linear(recipe, traced):
    conv, linear, before = _pair(recipe)
    for _ in range(2):  # the second step runs from a delayed scale and a cached weight
        x, g = torch.randn(4, 5, 96), torch.randn(4, 5, 64)
        (y_conv, dx_conv), (y_lin, dx_lin) = _step(conv, x, g, traced), _step(linear, x, g, traced)
        assert torch.equal(y_conv, y_lin) and torch.equal(dx_conv, dx_lin)
        assert torch.equal(conv.weight.grad, linear.weight.grad.t()) and torch.equal(conv.bias.grad, linear.bias.grad)
        for layer in (conv, linear):
            layer.fp8_scaling().update()
            layer.zero_grad()
    state = conv.state_dict()
    assert state.keys() == before.keys()
    assert all(torch.equal(state[k], before[k]) and state[k].shape == before[k].shape for k in before)
    assert state["weight"].shape == (96, 64)


def test_conv1d_without_fp8_autocast_and_undo_are_the_original_layer():
    conv, _, _ = _pair(DelayedScaling())
    x = torch.randn(3, 96)
    want = torch.addmm(conv.bias, x, conv.weight)  # Conv1D's own formula
    assert torch.equal(conv(x), want)
    assert "nf=64, nx=96" in repr(conv)
    conv.to_linear()
    assert type(conv) is Conv1D and torch.equal(conv(x), want)
    assert not hasattr(conv, "fp8_recipe")


def test_other_modules_with_a_2d_weight_are_named_in_the_report():
    class MyProjection(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(32, 32))

        def forward(self, x):
            return x @ self.weight

    model = nn.Sequential(nn.Embedding(10, 32), MyProjection(), nn.Linear(32, 32), Conv1D(32, 32))
    report = convert_to_fp8(model)
    assert report.converted == ["2", "3"]
    assert list(report.skipped) == ["1"] and "MyProjection holds a 2-D weight" in report.skipped["1"]
