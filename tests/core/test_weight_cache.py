"""The FP8 weight cache never serves a stale weight: evaluation and inference cast afresh, so an edit through
``weight.data`` (which keeps the version counter and the data pointer) is seen, and models built or run under
``torch.inference_mode`` work and leave training unharmed. Each result is compared with a layer that held the new
weight from the start."""

from __future__ import annotations

import copy

import pytest
import torch

from fp8_lightning import FP8Linear, fp8_autocast
from tests.helpers.layers import EVERY_RECIPE, fp8_layer


def _eval(layer: FP8Linear, x: torch.Tensor) -> torch.Tensor:
    layer.eval()
    with fp8_autocast(), torch.no_grad():
        return layer(x)


@pytest.mark.parametrize("edit", ["copy_", "mul_"])
@pytest.mark.parametrize("recipe", EVERY_RECIPE, ids=lambda r: r.name)
def test_an_evaluation_after_a_data_edit_sees_the_new_weight(recipe, edit):
    layer, x = fp8_layer(recipe), torch.randn(8, 64)
    before = _eval(layer, x)
    new = torch.randn(32, 64) if edit == "copy_" else layer.weight.detach() * 3
    version = layer.weight._version
    getattr(layer.weight.data, edit)(new if edit == "copy_" else 3.0)
    assert layer.weight._version == version  # the edit is invisible to the version counter
    fresh = fp8_layer(recipe)
    with torch.no_grad():
        fresh.weight.copy_(new)
    after = _eval(layer, x)
    assert not torch.equal(after, before)
    assert torch.equal(after, _eval(fresh, x))


@pytest.mark.parametrize("recipe", EVERY_RECIPE, ids=lambda r: r.name)
def test_a_model_built_under_inference_mode_runs_in_fp8(recipe):
    with torch.inference_mode():
        layer = fp8_layer(recipe)
        x = torch.randn(8, 64)
        with fp8_autocast():
            y = layer(x)  # a training-mode forward under inference mode: evaluation
    reference = fp8_layer(recipe)
    assert torch.equal(y, _eval(reference, x.clone()))


@pytest.mark.parametrize("recipe", EVERY_RECIPE, ids=lambda r: r.name)
def test_an_inference_mode_forward_leaves_training_unharmed(recipe):
    layer, x = fp8_layer(recipe), torch.randn(8, 64)
    twin = copy.deepcopy(layer)
    with torch.inference_mode(), fp8_autocast():
        layer(x)  # train mode, but no cast may be kept for the training step that follows
    for module in (layer, twin):
        with fp8_autocast():
            module(x).square().sum().backward()
    assert torch.equal(layer.weight.grad, twin.weight.grad)


def test_lightning_validation_after_an_ema_swap_reports_the_swapped_weights():
    """Validate, swap other weights in through ``p.data.copy_`` (what EMA callbacks do), validate again: the second
    loss is the swapped model's, as in fp32."""
    L = pytest.importorskip("lightning")
    from fp8_lightning import FP8Precision
    from tests.lightning.user_model import TinyTransformerLM, loader, trainer_kwargs

    def validate(model) -> float:
        trainer = L.Trainer(plugins=[FP8Precision()], **trainer_kwargs(limit_val_batches=2))
        return trainer.validate(model, loader(64), verbose=False)[0]["val_loss"]

    L.seed_everything(0, verbose=False)
    model = TinyTransformerLM()
    L.seed_everything(1, verbose=False)
    other = TinyTransformerLM()
    first = validate(model)
    with torch.no_grad():
        for p, q in zip(model.parameters(), other.parameters()):
            p.data.copy_(q)
    swapped = validate(model)
    assert swapped != first
    assert swapped == validate(other)


@pytest.mark.parametrize("recipe", [r for r in EVERY_RECIPE if r.per_tensor], ids=lambda r: r.name)
def test_an_fsdp_weight_pack_under_inference_mode_keeps_the_scaling_state(recipe):
    """FSDP2 packs a per-tensor weight for the all-gather with the layer's scale; under inference mode a
    training-mode layer is evaluated, so the pack must not move the state (nor keep an inference tensor in it)."""
    layer = fp8_layer(recipe)
    twin = copy.deepcopy(layer)
    layer.train()
    weight = layer.weight.detach()
    with torch.inference_mode():
        data, (scale, _) = recipe.fsdp_pack(weight, layer, lambda: weight.abs().amax())
    state, untouched = layer.fp8_scaling(recipe).operands["weight"], twin.fp8_scaling(recipe).operands["weight"]
    assert state.initialized == untouched.initialized
    assert torch.equal(state.scale, untouched.scale) and not state.scale.is_inference()
    assert torch.equal(scale, untouched.evaluation_scale(weight.abs().amax()))
