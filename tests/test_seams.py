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

    from fp8_lightning import kernels, quantize
    from fp8_lightning.gemm import LAYOUT_MULTIPLE
    from fp8_lightning.linear import shape_unsupported_reason
    from fp8_lightning.recipes import MX_BLOCK_SIZES, DelayedScaling, TensorwiseScaling

    assert tuple(kernels.MX_BLOCK_SIZES) == MX_BLOCK_SIZES
    for fn in (quantize.tensorwise_scale, quantize.tensorwise_scale_value, quantize.quantize_tensorwise):
        assert inspect.signature(fn).parameters["eps"].default == TensorwiseScaling().eps, fn.__name__
    # the shapes a layer refuses are exactly those the GEMM layout cannot take
    assert shape_unsupported_reason(LAYOUT_MULTIPLE, 2 * LAYOUT_MULTIPLE, DelayedScaling()) is None
    assert f"not divisible by {LAYOUT_MULTIPLE}" in shape_unsupported_reason(LAYOUT_MULTIPLE + 8, 32, DelayedScaling())
