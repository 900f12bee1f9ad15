"""A module trained under one FP8 recipe and then given to a Trainer with another trains under the new recipe
(with a warning naming the layers), and a checkpoint resumed under another recipe says that its scaling state
is not used."""

import lightning as L
import pytest

from fp8_lightning import FP8Precision, MXFP8BlockScaling, fp8_modules
from fp8_lightning.lightning.strings import PRECISION_RECIPES

from .user_model import TinyTransformerLM, loader, trainer_kwargs

STEPS = 3


def _fit(model, precision=None, steps=STEPS, ckpt_path=None, **kwargs):
    if precision is not None:
        kwargs["precision"] = precision
    trainer = L.Trainer(max_steps=steps, **trainer_kwargs(**kwargs))
    trainer.fit(model, loader(n=128), ckpt_path=ckpt_path)
    return trainer


def test_a_new_recipe_replaces_the_one_layers_were_converted_with():
    model = TinyTransformerLM()
    _fit(model, "fp8-hybrid")
    hybrid = PRECISION_RECIPES["fp8-hybrid"]
    layers = dict(fp8_modules(model))
    with pytest.warns(UserWarning, match=r"9 layer\(s\) converted earlier under DelayedScaling now train under "
                                          r"MXFP8BlockScaling.*blocks\.0\.qkv"):  # fmt: skip
        _fit(model, "fp8-mxfp8")
    mx = PRECISION_RECIPES["fp8-mxfp8"]
    for name, layer in layers.items():
        assert layer.fp8_recipe == mx, name
        assert layer.fp8_scaling(mx).weight_casts == STEPS  # the MX casts really ran, once per step
        assert layer.fp8_scaling(hybrid).weight_casts == STEPS  # the first run's, untouched since


def test_replace_layers_false_keeps_the_recipes_the_layers_were_converted_with(recwarn):
    model = TinyTransformerLM()
    _fit(model, "fp8-hybrid")
    _fit(model, plugins=[FP8Precision(recipe=MXFP8BlockScaling(), replace_layers=False)])
    assert all(layer.fp8_recipe == PRECISION_RECIPES["fp8-hybrid"] for _, layer in fp8_modules(model))
    assert not [w for w in recwarn if "now train under" in str(w.message)]


def test_resuming_under_another_recipe_says_the_saved_scaling_state_is_not_used(tmp_path):
    model = TinyTransformerLM()
    trainer = _fit(model, "fp8-hybrid")
    path = tmp_path / "hybrid.ckpt"
    trainer.save_checkpoint(path)
    with pytest.warns(UserWarning, match=r"saved under DelayedScaling.*trains under TensorwiseScaling.*not used"):
        _fit(TinyTransformerLM(), "fp8-tensorwise", steps=STEPS + 1, ckpt_path=path)
