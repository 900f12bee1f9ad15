"""convert_to_fp8: in-place swap, shared parameters, unchanged state_dict, idempotence, skip reasons, and the
scaling state that travels outside the state_dict."""

import pytest
import torch
import torch.nn as nn

from fp8_lightning import (
    DelayedScaling,
    FP8Linear,
    MXFP8BlockScaling,
    convert_to_fp8,
    fp8_autocast,
    fp8_state_dict,
    load_fp8_state_dict,
    sync_scales,
)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64)
        self.head = nn.Linear(64, 10)
        self.norm = nn.LayerNorm(64)
        self.attn = nn.MultiheadAttention(64, 4, batch_first=True)

    def forward(self, x):
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return self.head(self.norm(x + self.down(torch.relu(self.up(x)))))


def test_conversion_is_in_place_and_keeps_the_state_dict():
    model = Block()
    before = {k: (v.shape, v.dtype, v.data_ptr()) for k, v in model.state_dict().items()}
    up, weight = model.up, model.up.weight
    report = convert_to_fp8(model)
    assert model.up is up and isinstance(up, FP8Linear) and model.up.weight is weight
    assert {k: (v.shape, v.dtype, v.data_ptr()) for k, v in model.state_dict().items()} == before
    assert report.converted == ["up", "down"]
    assert report.skipped["head"].startswith("out_features=10 not divisible by 16")
    assert "NonDynamicallyQuantizableLinear" in report.skipped["attn.out_proj"]
    assert "2 layer(s) converted, 2 skipped" in str(report)


def test_filter_root_module_and_idempotence():
    model = Block()
    report = convert_to_fp8(model, module_filter_fn=lambda m, name: name != "down")
    assert report.skipped["down"] == "excluded by module_filter_fn"
    again = convert_to_fp8(model, recipe="tensorwise", module_filter_fn=lambda m, name: name != "down")
    assert again.converted == report.converted and model.up.fp8_recipe.name == "tensorwise"
    root = nn.Linear(32, 32)
    assert convert_to_fp8(root).converted == ["<root>"] and isinstance(root, FP8Linear)
    assert type(root.to_linear()) is nn.Linear


def test_mx_recipe_uses_its_block_size_for_eligibility():
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 64))
    report = convert_to_fp8(model, MXFP8BlockScaling())
    assert report.converted == [] and "not divisible by 32" in report.skipped["0"]


def test_fp8_state_round_trips_and_reproduces_the_next_step_exactly():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    convert_to_fp8(model, DelayedScaling(amax_history_len=4))
    for _ in range(3):
        with fp8_autocast():
            model(torch.randn(8, 32)).square().mean().backward()
        sync_scales(model)
    twin = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    twin.load_state_dict(model.state_dict())
    convert_to_fp8(twin, DelayedScaling(amax_history_len=4))
    load_fp8_state_dict(twin, fp8_state_dict(model))
    x = torch.randn(8, 32)
    with fp8_autocast():
        assert torch.equal(model(x), twin(x))
    with pytest.raises(KeyError, match="missing"):
        load_fp8_state_dict(nn.Sequential(nn.Linear(32, 32)), fp8_state_dict(model))


def test_sync_scales_advances_every_delayed_layer_once():
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    convert_to_fp8(model, DelayedScaling(amax_history_len=3))
    with fp8_autocast():
        model(torch.randn(4, 32)).sum().backward()
    assert sync_scales(model) == 0  # single process: no collective
    for layer in model:
        for state in layer.fp8_scaling().operands.values():
            assert (state.amax_history > 0).sum() == 1 and not state.dirty
