"""The per-layer recipe policy on fused experts modules, as on linear layers: name patterns, first/last blocks,
callables, NVFP4's default bf16 tail, a recipe per experts module or high precision, the shape rules of the recipe
an experts module got, the report's lines, and a model of mixed recipes whose experts run, checkpoint and report
statistics under their own recipe."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from fp8_lightning import (
    DelayedScaling,
    GroupedExperts,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    TensorwiseScaling,
    convert_to_fp8,
    first_last_high_precision,
    fp8_autocast,
    fp8_modules,
    fp8_state_dict,
    load_fp8_state_dict,
    sync_scales,
)
from fp8_lightning.grouped.experts import FP8ExpertsMixin, convert_experts
from fp8_lightning.policy import DEFAULT, POLICY_SKIP

DIM, HIDDEN, EXPERTS = 64, 64, 4


class MoEBlock(nn.Module):
    def __init__(self, hidden: int = HIDDEN):
        super().__init__()
        self.attn = nn.Linear(DIM, DIM)
        self.experts = GroupedExperts(DIM, hidden, EXPERTS)

    def forward(self, x, offs):
        x = x + self.attn(x)
        return x + self.experts(x, offs)


class MoEStack(nn.Module):
    """``n`` blocks of a linear layer and GroupedExperts (tokens sorted by expert), and a head."""

    def __init__(self, n: int = 4, hidden: int = HIDDEN):
        super().__init__()
        self.blocks = nn.ModuleList(MoEBlock(hidden) for _ in range(n))
        self.head = nn.Linear(DIM, 32)

    def forward(self, x, offs):
        for block in self.blocks:
            x = block(x, offs)
        return self.head(x)


def _stack(n: int = 4, hidden: int = HIDDEN) -> MoEStack:
    torch.manual_seed(0)
    return MoEStack(n, hidden)


def _expert_recipes(model) -> dict[str, str | None]:
    """Each experts module's recipe name, None where it stays in high precision."""
    return {name: (m.fp8_recipe.name if isinstance(m, FP8ExpertsMixin) else None)
            for name, m in model.named_modules() if isinstance(m, GroupedExperts)}


def _batch():
    torch.manual_seed(1)
    return torch.randn(40, DIM), torch.tensor([10, 10, 25, 40], dtype=torch.int32)


def test_globs_regexes_and_a_pattern_that_matches_only_experts():
    model = _stack()
    report = convert_to_fp8(model, "tensorwise", layers={
        "blocks.0.experts": "mxfp8", "re:blocks\\.[12]\\.experts": None, "blocks.3": "delayed"})
    assert _expert_recipes(model) == {"blocks.0.experts": "mxfp8", "blocks.1.experts": None,
                                      "blocks.2.experts": None, "blocks.3.experts": "delayed"}
    assert {name: layer.fp8_recipe.name for name, layer in fp8_modules(model)} == {
        "blocks.0.attn": "tensorwise", "blocks.1.attn": "tensorwise", "blocks.2.attn": "tensorwise",
        "blocks.3.attn": "delayed", "head": "tensorwise"}
    assert report.recipes["blocks.0.experts"] == "mxfp8 (matches 'blocks.0.experts')"
    assert report.recipes["blocks.3.experts"] == "delayed (matches 'blocks.3')"
    assert report.experts_skipped["blocks.1.experts"] == f"{POLICY_SKIP} (matches 're:blocks\\\\.[12]\\\\.experts')"
    text = str(report)
    assert "experts converted: blocks.0.experts: mxfp8 (matches 'blocks.0.experts')" in text
    assert "experts skipped blocks.2.experts: kept in high precision by the layer policy" in text
    model = _stack()
    report = convert_to_fp8(model, "mxfp8", layers={"*experts*": None})  # matches experts only: valid
    assert report.experts == [] and set(_expert_recipes(model).values()) == {None}
    assert len(report.converted) == 5


def test_first_and_last_blocks_cover_their_experts():
    model = _stack()
    report = convert_to_fp8(model, "tensorwise", layers=first_last_high_precision(1, 1))
    assert _expert_recipes(model) == {"blocks.0.experts": None, "blocks.1.experts": "tensorwise",
                                      "blocks.2.experts": "tensorwise", "blocks.3.experts": None}
    assert "in the first 1 of 4 blocks of 'blocks'" in report.experts_skipped["blocks.0.experts"]
    assert "in the last 1 of 4 blocks of 'blocks'" in report.experts_skipped["blocks.3.experts"]
    assert report.recipes["blocks.1.experts"] == "tensorwise (the default recipe)"


def test_nvfp4_default_tail_keeps_the_tail_blocks_experts_in_high_precision():
    model = _stack(n=8)
    report = convert_to_fp8(model, "nvfp4")  # the last 15% of 8 blocks: 2
    recipes = _expert_recipes(model)
    assert [recipes[f"blocks.{i}.experts"] for i in range(8)] == ["nvfp4"] * 6 + [None, None]
    assert "in the last 2 of 8 blocks of 'blocks'" in report.experts_skipped["blocks.7.experts"]
    model = _stack(n=8)
    convert_to_fp8(model, NVFP4BlockScaling(), layers={"last": 0})
    assert set(_expert_recipes(model).values()) == {"nvfp4"}


def test_a_callable_is_asked_for_experts_modules():
    asked = []

    def choose(name, module):
        asked.append((name, type(module).__name__))
        if isinstance(module, GroupedExperts):
            return None if name.startswith("blocks.1") else MXFP8BlockScaling()
        return DEFAULT

    model = _stack(n=2)
    report = convert_to_fp8(model, "tensorwise", layers=choose)
    assert ("blocks.0.experts", "GroupedExperts") in asked and ("blocks.0.attn", "Linear") in asked
    assert _expert_recipes(model) == {"blocks.0.experts": "mxfp8", "blocks.1.experts": None}
    assert report.recipes["blocks.0.experts"] == "mxfp8 (chosen by the layers callable)"
    assert "chosen by the layers callable" in report.experts_skipped["blocks.1.experts"]
    assert model.blocks[1].attn.fp8_recipe == TensorwiseScaling()


def test_star_patterns_reach_the_experts():
    model = _stack(n=2)
    report = convert_to_fp8(model, "mxfp8", layers={"*": None})
    assert report.converted == [] and report.experts == []
    assert all(reason.startswith(POLICY_SKIP) for reason in report.experts_skipped.values())
    model = _stack(n=2)
    convert_to_fp8(model, "delayed", layers={"*": "nvfp4"})
    assert set(_expert_recipes(model).values()) == {"nvfp4"}
    assert {layer.fp8_recipe.name for _, layer in fp8_modules(model)} == {"nvfp4"}


def test_the_recipe_the_policy_gives_sets_the_shape_rules():
    """Hidden 48 is a multiple of 16 (tensorwise) but not of 32 (MXFP8): the experts the policy gives MXFP8 stay
    in high precision with the reason; the ones left to the default recipe convert."""
    model = _stack(n=2, hidden=48)
    report = convert_to_fp8(model, "tensorwise", layers={"blocks.1.experts": "mxfp8"})
    assert _expert_recipes(model) == {"blocks.0.experts": "tensorwise", "blocks.1.experts": None}
    assert "divisible by 32" in report.experts_skipped["blocks.1.experts"]


def test_bad_patterns_name_the_experts_among_the_layers():
    with pytest.raises(ValueError, match=r"match no linear layer or experts module.*blocks\.0\.experts"):
        convert_to_fp8(_stack(n=2), "tensorwise", layers={"blocks.9": None})


def test_a_later_policy_reports_experts_an_earlier_conversion_left_in_fp8():
    model = _stack(n=2)
    convert_to_fp8(model, "mxfp8")
    report = convert_to_fp8(model, "mxfp8", layers={"*experts": None})
    assert report.experts_skipped["blocks.0.experts"].startswith(
        "left in FP8 as an earlier conversion made it (mxfp8); kept in high precision by the layer policy")


def test_experts_run_the_recipe_the_policy_gave_them():
    """Each experts module's output equals that of a copy converted on its own with its recipe (and differs from
    the copy under the default recipe); its grouped GEMMs count under that recipe only; high-precision experts
    equal the plain module."""
    plain = _stack(n=3)
    model = copy.deepcopy(plain)
    convert_to_fp8(model, "tensorwise", layers={"blocks.0.experts": "mxfp8", "blocks.2.experts": None})
    x, offs = _batch()
    with fp8_autocast():
        model(x, offs).sum().backward()
    experts = model.blocks[0].experts
    assert [r.name for r, _ in experts.fp8_scalings()] == ["mxfp8"]
    assert experts.fp8_scaling(MXFP8BlockScaling()).gemms == {"fprop": 3, "dgrad": 3, "wgrad": 3}
    assert model.blocks[1].experts.fp8_scaling(TensorwiseScaling()).gemms == {"fprop": 3, "dgrad": 3, "wgrad": 3}
    assert type(model.blocks[2].experts) is GroupedExperts
    xe = torch.randn(40, DIM)
    mx, tw = (convert_experts(copy.deepcopy(plain.blocks[0].experts), r) for r in (MXFP8BlockScaling(),
                                                                                     TensorwiseScaling()))
    with fp8_autocast():
        out, want_mx, want_tw = experts(xe, offs), mx(xe, offs), tw(xe, offs)
    assert torch.equal(out, want_mx) and not torch.equal(out, want_tw)
    with fp8_autocast():
        assert torch.equal(model.blocks[2].experts(xe, offs), plain.blocks[2].experts(xe, offs))


def test_mixed_recipes_checkpoint_and_statistics():
    """Linear layers in MXFP8, experts in delayed scaling and NVFP4: the scaling state names each module's recipe
    and loads into a fresh model; the statistics measure each experts module against its own format's max."""
    from fp8_lightning.stats import attach_collector

    layers = {"blocks.0.experts": "delayed", "blocks.1.experts": "nvfp4"}
    model = _stack(n=2)
    convert_to_fp8(model, "mxfp8", layers=layers)
    collector = attach_collector(model)
    collector.always = True
    x, offs = _batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        with fp8_autocast():
            model(x, offs).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        stats = collector.finish_step()
        sync_scales(model)
    assert stats[("blocks.1.experts", "w1.input")].fp8_max == 6.0
    assert stats[("blocks.0.experts", "w1.input")].fp8_max == 448.0
    state = fp8_state_dict(model)
    saved = {name: [e["recipe"]["name"] for e in entry["scalings"]] for name, entry in state.items()}
    assert saved["blocks.0.experts"] == ["delayed"] and saved["blocks.1.experts"] == ["nvfp4"]
    assert saved["blocks.0.attn"] == ["mxfp8"]
    other = _stack(n=2)
    convert_to_fp8(other, "mxfp8", layers=layers)
    load_fp8_state_dict(other, state)
    ours, theirs = (m.blocks[0].experts.fp8_scaling(DelayedScaling()).parts["w1"] for m in (model, other))
    assert torch.equal(ours.operands["input"].scale, theirs.operands["input"].scale)
    assert ours.operands["input"].initialized


def test_a_transformers_mixture_of_experts_follows_the_policy():
    """Tiny random-init Qwen3-MoE (2 blocks): NVFP4's default tail keeps block 1's experts in high precision with its
    attention; a pattern gives block 0's experts MXFP8 under a delayed default; ``{"*": None}`` converts nothing."""
    pytest.importorskip("transformers")
    from tests.helpers.moe import tiny_moe

    def experts(model):
        return {name: (m.fp8_recipe.name if isinstance(m, FP8ExpertsMixin) else None)
                for name, m in model.named_modules() if name.endswith("mlp.experts")}

    model = tiny_moe("qwen3_moe")
    report = convert_to_fp8(model, "nvfp4")
    assert experts(model) == {"model.layers.0.mlp.experts": "nvfp4", "model.layers.1.mlp.experts": None}
    tail = "in the last 1 of 2 blocks of 'model.layers'"
    assert tail in report.experts_skipped["model.layers.1.mlp.experts"]
    assert tail in report.skipped["model.layers.1.self_attn.q_proj"]
    assert "experts converted: model.layers.0.mlp.experts: nvfp4 (the default recipe)" in str(report)
    model = tiny_moe("qwen3_moe")
    convert_to_fp8(model, "delayed", layers={"model.layers.0.mlp.experts": "mxfp8"})
    assert experts(model) == {"model.layers.0.mlp.experts": "mxfp8", "model.layers.1.mlp.experts": "delayed"}
    model = tiny_moe("qwen3_moe")
    report = convert_to_fp8(model, "mxfp8", layers={"*": None})
    assert report.converted == [] and report.experts == [] and set(experts(model).values()) == {None}
