"""Evaluation forwards leave the scaling state that training reads exactly as it was, on the eager path and on the
traced path (the code torch.compile traces, run here eagerly), for every recipe; and they cast with the scale a
training forward would use at that point."""

import copy

import pytest
import torch
import torch.nn as nn

from fp8_lightning import DelayedScaling, FP8Linear, MXFP8BlockScaling, TensorwiseScaling, fp8_autocast

RECIPES = [DelayedScaling(), TensorwiseScaling(), MXFP8BlockScaling()]


def _snapshot(layer: FP8Linear) -> dict:
    """Every piece of per-layer state a training step reads: operand tensors, flags, counters, weight cache."""
    scaling = layer.fp8_scaling()
    out = {"weight_key": scaling._weight_key, "weight_cache": id(scaling._weight_cache),
           "weight_casts": scaling.weight_casts}  # fmt: skip
    for role, s in scaling.operands.items():
        for name in (*s._TENSORS, "flags"):
            out[f"{role}.{name}"] = getattr(s, name).clone()
        out[f"{role}.host"] = (s._initialized, s._dirty, s.casts, s.generation)
    return out


def _assert_same(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key, value in before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, after[key]), key
        else:
            assert value == after[key], key


def _forward(layer: FP8Linear, x: torch.Tensor, traced: bool) -> torch.Tensor:
    with fp8_autocast():
        if traced:  # the compiled path's code, called directly
            return layer._traced_forward(x, layer.fp8_recipe, x.dtype, False)
        return layer(x)


def _train_step(layer: FP8Linear, x: torch.Tensor, traced: bool) -> None:
    layer.train()
    _forward(layer, x, traced).square().mean().backward()
    with torch.no_grad():
        layer.weight.sub_(0.01 * layer.weight.grad)  # an in-place update, as an optimizer makes
    layer.weight.grad = None
    layer.fp8_scaling().update()


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("trained", [False, True], ids=["fresh", "after-a-step"])
def test_evaluation_forward_changes_no_state(recipe, traced, trained):
    layer = FP8Linear.from_linear(nn.Linear(64, 32), recipe)
    if trained:
        _train_step(layer, torch.randn(8, 64), traced)
    before = _snapshot(layer)
    layer.eval()
    with torch.no_grad():
        _forward(layer, 50 * torch.randn(8, 64), traced)  # other data, another range: a first use would see it
    _assert_same(before, _snapshot(layer))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_evaluation_casts_with_the_scale_training_would_use(recipe):
    layer = FP8Linear.from_linear(nn.Linear(64, 32), recipe)
    _train_step(layer, torch.randn(8, 64), traced=False)
    twin = copy.deepcopy(layer)
    x = 3 * torch.randn(8, 64)
    layer.eval()
    with torch.no_grad():
        eager, traced = _forward(layer, x, False), _forward(layer, x, True)
    with torch.no_grad():
        trained = _forward(twin.train(), x, False)  # a training forward from the same state
    assert torch.equal(eager, trained) and torch.equal(traced, trained)


def test_training_after_evaluation_equals_training_without_it():
    """Delayed scaling, first use included: the eager path's weight cache and the histories come out the same."""
    x1, x2, x_eval = torch.randn(8, 64), torch.randn(8, 64), 100 * torch.randn(8, 64)
    runs = []
    for evaluate in (False, True):
        torch.manual_seed(0)
        layer = FP8Linear.from_linear(nn.Linear(64, 32), DelayedScaling())
        for x in (x1, x2):
            if evaluate:
                layer.eval()
                with torch.no_grad():
                    _forward(layer, x_eval, False)
            _train_step(layer, x, traced=False)
        runs.append((_snapshot(layer), layer.weight.detach().clone()))
    assert torch.equal(runs[0][1], runs[1][1])
    without, with_eval = runs[0][0], runs[1][0]
    for snap in (without, with_eval):
        snap.pop("weight_cache"), snap.pop("weight_key")  # object ids and addresses differ between the layers
    _assert_same(without, with_eval)
