"""A user's LightningModule trains in FP8 with one changed argument, through the Trainer and through Fabric,
and ends within 3% of the float32 run from the same seed."""

import pytest
import torch.nn as nn

import fp8_lightning
from fp8_lightning import FP8Linear, FP8Precision
from fp8_lightning.lightning.strings import PRECISION_RECIPES
from fp8_lightning.policy import POLICY_SKIP

from .user_model import TinyTransformerLM, final_loss, fit_fabric, fit_trainer

STEPS = 25
LINEARS = ["blocks.0.qkv", "blocks.0.proj", "blocks.0.fc1", "blocks.0.fc2",
           "blocks.1.qkv", "blocks.1.proj", "blocks.1.fc1", "blocks.1.fc2", "head"]  # fmt: skip


@pytest.fixture(scope="module")
def fp32_trainer_loss():
    return final_loss(fit_trainer(STEPS, precision="32-true").losses)


@pytest.fixture(scope="module")
def fp32_fabric_loss():
    return final_loss(fit_fabric(STEPS, precision="32-true")[1])


@pytest.mark.parametrize("precision", list(PRECISION_RECIPES))
def test_trainer_fits_each_string_close_to_fp32(precision, fp32_trainer_loss):
    model = fit_trainer(STEPS, precision=precision)
    trainer = model.trainer_ref
    assert trainer.precision == precision
    plugin = trainer.precision_plugin
    assert isinstance(plugin, FP8Precision) and plugin.recipe == PRECISION_RECIPES[precision]
    assert sorted(plugin.conversion_report.converted + policy_kept(plugin)) == sorted(LINEARS)
    assert all(isinstance(model.get_submodule(n), FP8Linear) for n in plugin.conversion_report.converted)
    assert isinstance(model.ln_f, nn.LayerNorm) and type(model.embed) is nn.Embedding
    assert model.losses[-1] < 0.7 * model.losses[0]  # it learned
    assert final_loss(model.losses) == pytest.approx(fp32_trainer_loss, rel=0.03)
    # FP8 really ran: the delayed recipes kept amax histories, every recipe cast the weights once per step
    assert model.blocks[0].fc1.fp8_weight_casts == STEPS
    assert plugin.optimizer_steps == STEPS


def policy_kept(plugin) -> list[str]:
    """Layers the recipe's default layer policy keeps in high precision (NVFP4: the last 15% of the blocks)."""
    return [name for name, why in plugin.conversion_report.skipped.items() if why.startswith(POLICY_SKIP)]


@pytest.mark.parametrize("precision", list(PRECISION_RECIPES))
def test_fabric_fits_each_string_close_to_fp32(precision, fp32_fabric_loss):
    model, losses, fabric = fit_fabric(STEPS, precision=precision)
    plugin = fabric.strategy.precision
    assert isinstance(plugin, fp8_lightning.FP8FabricPrecision) and plugin.precision == precision
    assert sorted(plugin.conversion_report.converted + policy_kept(plugin)) == sorted(LINEARS)
    assert final_loss(losses) == pytest.approx(fp32_fabric_loss, rel=0.03)
    assert model.module.blocks[0].fc1.fp8_weight_casts == STEPS


def test_plugin_route_with_recipe_dict_and_filter():
    plugin = FP8Precision(recipe={"name": "delayed", "margin": 1, "amax_history_len": 4},
                          module_filter_fn=lambda module, name: name != "head")  # fmt: skip
    model = fit_trainer(3, plugins=[plugin])
    assert model.trainer_ref.precision == "fp8-delayed"
    assert "head" not in plugin.conversion_report.converted and type(model.head) is nn.Linear
    assert plugin.conversion_report.skipped == {"head": "excluded by module_filter_fn"}
    assert model.blocks[0].qkv.fp8_recipe.margin == 1
    assert model.blocks[0].qkv.fp8_scaling().operands["input"].amax_history.shape == (4,)


def test_unconvertible_layers_are_listed_in_one_warning():
    class Odd(TinyTransformerLM):
        def __init__(self):
            super().__init__()
            self.extra = nn.Linear(64, 10)  # 10 outputs: not a multiple of 16

    plugin = FP8Precision()
    with pytest.warns(UserWarning, match=r"kept 1 linear layer\(s\) in high precision: extra \(out_features=10"):
        plugin.convert_module(Odd())
    assert plugin.conversion_report.skipped["extra"].startswith("out_features=10")


def test_convert_module_is_idempotent_and_keeps_user_recipes():
    model = TinyTransformerLM()
    fp8_lightning.convert_to_fp8(model.head, "tensorwise")  # the user converted one layer themselves
    plugin = FP8Precision(recipe="delayed")
    assert plugin.convert_module(model) is model
    first = list(plugin.conversion_report.converted)
    plugin.convert_module(model)
    assert plugin.conversion_report.converted == first and sorted(first) == sorted(LINEARS)
    assert model.head.fp8_recipe == fp8_lightning.TensorwiseScaling()
    assert len(plugin.fp8_tracked_modules()) == 1


def test_replace_layers_false_leaves_the_model_alone():
    model = TinyTransformerLM()
    plugin = FP8Precision(replace_layers=False)
    plugin.convert_module(model)
    assert plugin.conversion_report.converted == [] and not any(isinstance(m, FP8Linear) for m in model.modules())


def test_dtype_argument_is_validated():
    with pytest.raises(ValueError, match=r"dtype='int8' is invalid.*torch.bfloat16"):
        FP8Precision(dtype="int8")
    assert FP8Precision(dtype="bf16").dtype is not None
