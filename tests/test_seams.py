"""Modules use each other through public names: no module of the package reads another module's private state
(the names a review found read across modules are checked here, so they do not come back)."""

import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fp8_lightning"
# private name -> the one file allowed to use it
OWNED = {
    r"\._fp8_scalings\b": "linear.py",
    r"\._to\(": "scaling.py",
    r"\bsync\._layers\b": "distributed/amax.py",
    r"\bimport _local\b|optimizer\._local\b": "optim/optimizer.py",
}


@pytest.mark.parametrize("pattern", list(OWNED))
def test_private_state_is_used_only_by_its_owner(pattern):
    users = sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if re.search(pattern, path.read_text()) and str(path.relative_to(PACKAGE)) != OWNED[pattern]
    )
    assert users == [], f"{pattern} is read outside {OWNED[pattern]}: {users}"


def test_a_layer_lists_its_scaling_states_in_the_same_order_everywhere():
    import torch
    import torch.nn as nn

    from fp8_lightning import DelayedScaling, FP8Linear, TensorwiseScaling, fp8_autocast

    layer = FP8Linear.from_linear(nn.Linear(32, 32), TensorwiseScaling())
    with fp8_autocast(recipe=DelayedScaling()):
        layer(torch.randn(2, 32))
    recipes = [recipe for recipe, _ in layer.fp8_scalings()]
    assert recipes == sorted([TensorwiseScaling(), DelayedScaling()], key=repr)
    assert all(scaling is layer.fp8_scaling(recipe) for recipe, scaling in layer.fp8_scalings())


def test_constants_that_must_agree_do():
    """Values defined in more than one place (the kernels package imports nothing from the core) stay equal."""
    import inspect

    from fp8_lightning import quantize
    from fp8_lightning.kernels import availability
    from fp8_lightning.gemm import LAYOUT_MULTIPLE
    from fp8_lightning.linear import shape_unsupported_reason
    from fp8_lightning.recipes import MX_BLOCK_SIZES, DelayedScaling, TensorwiseScaling

    assert tuple(availability.MX_BLOCK_SIZES) == MX_BLOCK_SIZES
    for fn in (quantize.tensorwise_scale, quantize.tensorwise_scale_value, quantize.quantize_tensorwise):
        assert inspect.signature(fn).parameters["eps"].default == TensorwiseScaling().eps, fn.__name__
    # the shapes a layer refuses are exactly those the GEMM layout cannot take
    assert shape_unsupported_reason(LAYOUT_MULTIPLE, 2 * LAYOUT_MULTIPLE, DelayedScaling()) is None
    assert f"not divisible by {LAYOUT_MULTIPLE}" in shape_unsupported_reason(LAYOUT_MULTIPLE + 8, 32, DelayedScaling())


def test_fp8_optimizer_is_set_up_by_torch_and_its_hooks_fire(monkeypatch):
    import torch

    from fp8_lightning import FP8Optimizer

    calls = []
    original = torch.optim.Optimizer.__init__
    monkeypatch.setattr(torch.optim.Optimizer, "__init__", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    layer = torch.nn.Linear(64, 64)
    inner = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    calls.clear()
    optimizer = FP8Optimizer(inner)
    assert calls == [1]  # torch's own set-up ran (not a copy of its private fields)
    assert optimizer.param_groups is inner.param_groups and len(optimizer.param_groups) == 1
    seen = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append("pre"))
    optimizer.register_step_post_hook(lambda opt, args, kwargs: seen.append("post"))
    optimizer.register_state_dict_pre_hook(lambda opt: seen.append("state_dict"))
    layer(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    optimizer.state_dict()
    assert seen == ["pre", "post", "state_dict"]
    extra = torch.nn.Parameter(torch.zeros(64))
    optimizer.add_param_group({"params": [extra]})
    assert len(inner.param_groups) == 2 and optimizer.param_groups[1]["params"] == [extra]
