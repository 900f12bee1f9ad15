"""Per-layer recipe selection (fp8_lightning.policy): name patterns, first/last blocks, callables, NVFP4's default
bf16 tail, the conversion report, errors, and a model of mixed recipes that trains and checkpoints."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fp8_lightning import (
    FP8Linear,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    RecipePolicy,
    TensorwiseScaling,
    convert_to_fp8,
    first_last_high_precision,
    fp8_autocast,
    fp8_modules,
    fp8_state_dict,
    load_fp8_state_dict,
)
from fp8_lightning.policy import DEFAULT


class Stack(nn.Module):
    """An embedding-free stack of ``n`` blocks of two linear layers, and a head."""

    def __init__(self, n=8, dim=32):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict(dict(up=nn.Linear(dim, 2 * dim), down=nn.Linear(2 * dim, dim))) for _ in range(n)
        )
        self.lm_head = nn.Linear(dim, 16)

    def forward(self, x):
        for blk in self.blocks:
            x = x + blk["down"](torch.relu(blk["up"](x)))
        return self.lm_head(x)


def _recipes(model):
    return {name: layer.fp8_recipe.name for name, layer in fp8_modules(model)}


def test_the_issue_example_maps_patterns_and_the_tail():
    model = Stack()
    report = convert_to_fp8(model, "nvfp4", layers={"last": 0.15, "lm_head": None, "blocks.0": "mxfp8"})
    recipes = _recipes(model)
    assert recipes["blocks.0.up"] == recipes["blocks.0.down"] == "mxfp8"
    assert all(recipes[f"blocks.{i}.up"] == "nvfp4" for i in range(1, 6))
    assert "lm_head" not in recipes and "blocks.6.up" not in recipes and "blocks.7.down" not in recipes
    assert "last 2 of 8 blocks of 'blocks'" in report.skipped["blocks.7.up"]
    assert "matches 'lm_head'" in report.skipped["lm_head"]
    assert report.recipes["blocks.0.up"] == "mxfp8 (matches 'blocks.0')"
    assert report.recipes["blocks.3.down"] == "nvfp4 (the default recipe)"
    text = str(report)
    assert "blocks.0.up: mxfp8 (matches 'blocks.0')" in text and "skipped lm_head" in text


def test_nvfp4_keeps_the_last_15_percent_by_default_and_the_user_overrides_it():
    model = Stack()
    convert_to_fp8(model, "nvfp4")
    assert sorted({n.split(".")[1] for n in _recipes(model) if n.startswith("blocks")}) == list("012345")
    assert "lm_head" in _recipes(model)  # the default touches the repeated blocks only
    model = Stack()
    convert_to_fp8(model, NVFP4BlockScaling(), layers={"last": 0})
    assert len(_recipes(model)) == 17
    model = Stack()
    convert_to_fp8(model, "tensorwise")  # other recipes have no default policy
    assert len(_recipes(model)) == 17


def test_first_last_counts_fractions_globs_and_regexes():
    model = Stack()
    convert_to_fp8(model, "tensorwise", layers=first_last_high_precision(1, 2))
    assert sorted({n.split(".")[1] for n in _recipes(model) if n.startswith("blocks")}) == list("12345")
    model = Stack()
    convert_to_fp8(model, "tensorwise", layers={"blocks.*.up": "mxfp8", "re:blocks\\.[0-3]\\.down": None})
    recipes = _recipes(model)
    assert all(recipes[f"blocks.{i}.up"] == "mxfp8" for i in range(8))
    assert all(f"blocks.{i}.down" not in recipes for i in range(4))
    assert all(recipes[f"blocks.{i}.down"] == "tensorwise" for i in range(4, 8))
    model = Stack(n=3)
    convert_to_fp8(model, "tensorwise", layers={"first": 0.01})  # any positive fraction keeps one block
    assert "blocks.0.up" not in _recipes(model)


def test_patterns_win_over_positions_in_the_order_given():
    model = Stack()
    convert_to_fp8(model, "tensorwise", layers={"last": 1, "blocks.7.up": "mxfp8", "blocks.7*": "delayed"})
    recipes = _recipes(model)
    assert recipes["blocks.7.up"] == "mxfp8" and recipes["blocks.7.down"] == "delayed"


def test_a_callable_and_a_recipe_policy():
    def choose(name, module):
        if name.endswith("down"):
            return MXFP8BlockScaling()
        return "bf16" if name == "lm_head" else DEFAULT

    model = Stack(n=2)
    report = convert_to_fp8(model, "tensorwise", layers=choose)
    recipes = _recipes(model)
    assert recipes == {"blocks.0.up": "tensorwise", "blocks.0.down": "mxfp8", "blocks.1.up": "tensorwise",
                       "blocks.1.down": "mxfp8"}
    assert "chosen by the layers callable" in report.skipped["lm_head"]
    model = Stack(n=4)
    convert_to_fp8(model, "tensorwise", layers=RecipePolicy(patterns={"lm_head": None}, first=1))
    assert "lm_head" not in _recipes(model) and "blocks.0.up" not in _recipes(model)


def test_bad_policies_get_clear_errors():
    with pytest.raises(ValueError, match=r"pattern\(s\) \['blocks.9'\] match no linear layer.*blocks.0.up"):
        convert_to_fp8(Stack(), "tensorwise", layers={"blocks.9": None})
    with pytest.raises(ValueError, match="recipe name 'mxfp9' is unknown"):
        convert_to_fp8(Stack(), "tensorwise", layers={"lm_head": "mxfp9"})
    with pytest.raises(ValueError, match=r"layers\['last'\]=-1 is invalid"):
        convert_to_fp8(Stack(), "tensorwise", layers={"last": -1})
    with pytest.raises(ValueError, match=r"layers\['last'\]=1.0 is invalid; a fraction .* below 1 .* an int \(1, not"):
        convert_to_fp8(Stack(), "tensorwise", layers={"last": 1.0})  # read as "all" it would be one block
    with pytest.raises(ValueError, match="names no module"):
        convert_to_fp8(Stack(), "tensorwise", layers={"stack": "layers", "last": 1})
    with pytest.raises(TypeError, match="is not a layer policy"):
        convert_to_fp8(Stack(), "tensorwise", layers=["lm_head"])


def _train(model, steps=4):
    torch.manual_seed(3)
    x, y = torch.randn(32, 32), torch.randint(0, 16, (32,))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        with fp8_autocast():
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_mixed_recipes_train_and_their_state_round_trips():
    torch.manual_seed(0)
    model = Stack(n=4)
    layers = {"blocks.0": "mxfp8", "blocks.1": "delayed", "lm_head": "rowwise"}
    convert_to_fp8(model, "nvfp4", layers=layers)
    assert set(_recipes(model).values()) == {"mxfp8", "delayed", "nvfp4", "rowwise"}
    losses = _train(model, 6)
    assert losses[-1] < losses[0]
    state = fp8_state_dict(model)
    names = {name: [e["recipe"]["name"] for e in entry["scalings"]] for name, entry in state.items()}
    assert names["blocks.0.up"] == ["mxfp8"] and names["blocks.2.up"] == ["nvfp4"]
    torch.manual_seed(0)
    other = Stack(n=4)
    convert_to_fp8(other, "nvfp4", layers=layers)
    load_fp8_state_dict(other, state)
    assert other.blocks[1]["up"].fp8_scaling().operands["input"].scale == model.blocks[1]["up"].fp8_scaling().operands[
        "input"].scale


def test_recipes_of_one_model_are_independent_layers():
    model = Stack(n=2)
    convert_to_fp8(model, TensorwiseScaling(), layers={"blocks.1": "nvfp4"})
    assert isinstance(model.blocks[1]["up"], FP8Linear)
    assert model.blocks[1]["up"].fp8_recipe == NVFP4BlockScaling()
    assert model.blocks[0]["up"].fp8_recipe == TensorwiseScaling()


def test_the_stats_collector_reads_a_model_of_mixed_recipes():
    from fp8_lightning.stats import attach_collector

    model = Stack(n=2)
    convert_to_fp8(model, "nvfp4", layers={"last": 0, "blocks.0": "tensorwise"})
    collector = attach_collector(model)
    collector.always = True
    x = torch.randn(8, 32)
    x[0, 0] = 1e-6  # a value the 4-bit cast flushes to zero
    with fp8_autocast():
        model(x).sum().backward()
    stats = collector.finish_step()
    nvfp4, fp8 = stats[("blocks.1.up", "input")], stats[("blocks.0.up", "input")]
    assert nvfp4.fp8_max == 6.0 and fp8.fp8_max == 448.0
    assert nvfp4.overflow == 0 and not nvfp4.nonfinite and nvfp4.underflow > 0
    assert stats[("lm_head", "grad_output")].fp8_max == 6.0
