"""Fused experts at their edges: routers of hand-written mixtures of experts stay in high precision, transformers'
experts under fp8_autocast take what the plain module takes (no token, int32 ids, expert parallelism's sentinel
ids), GroupedExperts in high precision differentiates y.sum() and runs float64, and a saved scaling state is refused
by a module holding another number of experts. References: the plain modules and float64 products."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fp8_lightning import GroupedExperts, convert_to_fp8, fp8_autocast, fp8_state_dict, load_fp8_state_dict
from fp8_lightning.saved_state import fp8_state_checksum
from fp8_lightning.linear import FP8Linear
from fp8_lightning.recipes import recipe_from
from tests.helpers.moe import EXPERTS, FAMILIES, HIDDEN, tiny_moe

EXPERTS_NAME = "model.layers.0.mlp.experts"


class HandMoE(nn.Module):
    """A router beside GroupedExperts, and an ordinary layer of the same block."""

    def __init__(self, experts: int = 16, dim: int = 64, router_in: int | None = None):
        super().__init__()
        self.router = nn.Linear(router_in or dim, experts, bias=False)
        self.experts = GroupedExperts(dim, 64, experts)
        self.out = nn.Linear(dim, dim)


class Block(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.moe = HandMoE(**kwargs)


# -- routers ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("experts", [16, 4])
def test_a_linear_router_beside_grouped_experts_stays_in_high_precision(experts):
    model = HandMoE(experts)
    report = convert_to_fp8(model, "tensorwise")
    assert report.routers == ["router"] and "router" not in report.skipped
    assert report.converted == ["out"] and report.experts == ["experts"]
    assert type(model.router) is nn.Linear and "router kept in high precision: router" in str(report)
    x = torch.randn(8, 64)
    with fp8_autocast():
        scores = model.router(x)
    assert torch.equal(scores, F.linear(x, model.router.weight))  # float32, no FP8 rounding


@pytest.mark.parametrize("kwargs", [dict(experts=16, router_in=32), dict(experts=16, dim=64)])
def test_only_layers_that_score_the_experts_are_routers(kwargs):
    model = HandMoE(**kwargs)
    model.other = nn.Linear(64, 32)  # a layer beside the experts that does not output one score per expert
    report = convert_to_fp8(model, "tensorwise")
    routers = [] if kwargs.get("router_in") else ["router"]
    assert report.routers == routers and "other" in report.converted
    assert ("router" in report.converted) == (not routers)


def test_the_layer_policy_converts_a_router_it_names_and_no_other():
    named = Block()
    report = convert_to_fp8(named, "tensorwise", layers={"moe.router": "tensorwise"})
    assert "moe.router" in report.converted and isinstance(named.moe.router, FP8Linear)
    parent = Block()
    report = convert_to_fp8(parent, "tensorwise", layers={"moe": "tensorwise"})
    assert report.routers == ["moe.router"] and type(parent.moe.router) is nn.Linear
    called = Block()
    report = convert_to_fp8(called, "tensorwise", layers=lambda name, module: "tensorwise")
    assert "moe.router" in report.converted


class TitanMoE(nn.Module):
    """torchtitan's layout: the router's linear layer one module down (``router.gate``), beside the experts."""

    def __init__(self, experts: int = 16, dim: int = 64):
        super().__init__()
        self.router = nn.Module()
        self.router.gate = nn.Linear(dim, experts, bias=False)
        self.experts = GroupedExperts(dim, 32, experts)


def test_a_router_inside_a_router_module_stays_in_high_precision():
    model = nn.ModuleDict({"moe": TitanMoE()})
    report = convert_to_fp8(model, "tensorwise")
    assert report.routers == ["moe.router.gate"] and type(model["moe"].router.gate) is nn.Linear


@pytest.mark.parametrize("pattern", ["blocks.*", "*", "*.moe.*", "re:blocks\\..*", "blocks.0"])
def test_catch_all_patterns_leave_the_router_in_high_precision(pattern):
    model = nn.ModuleDict({"blocks": nn.ModuleList([Block()])})
    report = convert_to_fp8(model, "tensorwise", layers={pattern: "tensorwise"})
    assert "blocks.0.moe.router" in report.routers and type(model["blocks"][0].moe.router) is nn.Linear
    assert "blocks.0.moe.out" in report.converted


@pytest.mark.parametrize("pattern", ["*.router", "blocks.0.moe.router", "re:.*\\.router"])
def test_a_pattern_that_spells_the_router_converts_it(pattern):
    model = nn.ModuleDict({"blocks": nn.ModuleList([Block()])})
    report = convert_to_fp8(model, "tensorwise", layers={pattern: "tensorwise"})
    assert "blocks.0.moe.router" in report.converted and isinstance(model["blocks"][0].moe.router, FP8Linear)


def test_two_layers_that_could_route_stay_in_high_precision_until_the_policy_names_one():
    model = HandMoE(experts=16)
    model.second = nn.Linear(64, 16)  # also maps the experts' input to one score per expert
    with pytest.warns(UserWarning, match=r"\['router', 'second'\].*router is unknown.*all stay in high precision"):
        report = convert_to_fp8(model, "tensorwise")
    assert report.routers == ["router", "second"] and type(model.router) is type(model.second) is nn.Linear
    model = HandMoE(experts=16)
    model.second = nn.Linear(64, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the policy named one: nothing left to say
        report = convert_to_fp8(model, "tensorwise", layers={"second": "tensorwise"})
    assert report.routers == ["router"] and isinstance(model.second, FP8Linear)


def test_a_checkpoint_that_holds_a_converted_routers_state_still_loads():
    torch.manual_seed(0)
    saved = HandMoE(experts=16)  # a run whose policy converted the router (as versions before the router rule did)
    convert_to_fp8(saved, "delayed", layers={"router": "delayed"})
    offs = torch.arange(1, 17, dtype=torch.int32)
    with fp8_autocast():
        x = torch.randn(16, 64)
        (saved.experts(x, offs).sum() + saved.router(x).sum() + saved.out(x).sum()).backward()
    state = fp8_state_dict(saved)
    assert "router" in state
    model = HandMoE(experts=16)
    assert convert_to_fp8(model, "delayed").routers == ["router"]
    with pytest.warns(UserWarning, match=r"router\(s\) \['router'\].*high precision.*not used"):
        load_fp8_state_dict(model, state)  # strict: the other layers must match
    assert fp8_state_checksum(fp8_state_dict(model)) == fp8_state_checksum(
        {name: value for name, value in state.items() if name != "router"})
    named = HandMoE(experts=16)
    assert convert_to_fp8(named, "delayed", layers={"router": None}).routers == ["router"]  # the policy's word
    with pytest.warns(UserWarning, match="router"):
        load_fp8_state_dict(named, state)
    other = HandMoE(experts=16)
    convert_to_fp8(other, "delayed", layers={"router": "delayed", "out": None})  # not a router: still refused
    with pytest.raises(KeyError, match=r"unexpected \['out'\]"):
        load_fp8_state_dict(other, state)


# -- transformers' experts under fp8_autocast --------------------------------------------------------------------------


def _pair(family: str):
    """(plain experts, converted experts) of two copies of the same tiny model."""
    plain = tiny_moe(family).get_submodule(EXPERTS_NAME)
    model = tiny_moe(family)
    convert_to_fp8(model, "tensorwise")
    return plain, model.get_submodule(EXPERTS_NAME)


def _rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_no_token_runs_and_differentiates_like_the_plain_module(family):
    pytest.importorskip("transformers")
    plain, fp8 = _pair(family)
    x = torch.randn(0, HIDDEN, requires_grad=True)
    index, weights = torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2)
    with fp8_autocast():
        out = fp8(x, index, weights)
    assert out.shape == plain(x, index, weights).shape == (0, HIDDEN)
    out.sum().backward()
    assert x.grad.shape == (0, HIDDEN)


@pytest.mark.parametrize("family", FAMILIES)
def test_int32_expert_ids_give_the_plain_result(family):
    pytest.importorskip("transformers")
    plain, fp8 = _pair(family)
    torch.manual_seed(0)
    x, index, weights = torch.randn(24, HIDDEN), torch.randint(0, EXPERTS, (24, 2)), torch.rand(24, 2)
    with fp8_autocast():
        out = fp8(x, index.to(torch.int32), weights)
    assert _rel(out, plain(x, index, weights)) < 0.1


@pytest.mark.parametrize("family", FAMILIES)
def test_sentinel_ids_add_nothing_as_transformers_masks_them(family):
    """Id == num_experts (a token another rank's experts take) contributes nothing whatever its weight; tokens routed
    only there are large, so that counting them in any scale would spoil the other tokens'."""
    pytest.importorskip("transformers")
    plain, fp8 = _pair(family)
    torch.manual_seed(0)
    x, index, weights = torch.randn(24, HIDDEN), torch.randint(0, EXPERTS, (24, 2)), torch.rand(24, 2)
    sentinel = index.clone()
    sentinel[::3, 1] = EXPERTS
    sentinel[:4] = EXPERTS  # tokens 0-3 go elsewhere entirely
    x[:4] *= 1e4
    kept = torch.where(sentinel == EXPERTS, torch.zeros_like(weights), weights)
    reference = plain(x, sentinel.clamp(max=EXPERTS - 1), kept)  # the same sum over the routed pairs only
    xg = x.clone().requires_grad_()
    with fp8_autocast():
        out = fp8(xg, sentinel, weights)
    out.sum().backward()
    assert torch.equal(out[:4], torch.zeros_like(out[:4])) and torch.equal(xg.grad[:4], torch.zeros_like(x[:4]))
    assert _rel(out[4:], reference[4:]) < 0.1 and torch.isfinite(xg.grad).all()


# -- GroupedExperts in high precision -----------------------------------------------------------------------------------


def _reference(experts: GroupedExperts, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The SwiGLU experts in float64, one expert at a time."""
    out, start = [], 0
    w1, w2, w3 = (w.detach().double() for w in (experts.w1, experts.w2, experts.w3))
    for e, end in enumerate(offs.tolist()):
        rows = x[start:end].double()
        out.append((F.silu(rows @ w1[e].T) * (rows @ w3[e].T)) @ w2[e].T)
        start = end
    return torch.cat(out)


OFFS = torch.tensor([5, 5, 12, 20], dtype=torch.int32)


@pytest.mark.parametrize("compiled", [False, True])
def test_sum_backward_of_high_precision_grouped_experts(compiled):
    torch.manual_seed(0)
    experts = GroupedExperts(64, 32, 4)
    x = torch.randn(20, 64, requires_grad=True)
    run = torch.compile(experts, backend="aot_eager") if compiled else experts
    run(x, OFFS).sum().backward()
    x64 = x.detach().double().requires_grad_()
    _reference(experts, x64, OFFS).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-5)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in experts.parameters())


def test_float64_grouped_experts_run_per_group_on_cpu():
    torch.manual_seed(0)
    experts = GroupedExperts(64, 32, 4).double()
    x = torch.randn(20, 64, dtype=torch.float64, requires_grad=True)
    out = experts(x, OFFS)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, _reference(experts, x.detach(), OFFS), rtol=1e-12, atol=1e-12)
    out.sum().backward()
    assert x.grad.dtype == torch.float64 and torch.isfinite(x.grad).all()


# -- saved scaling state and the number of experts --------------------------------------------------------------------


def _trained(experts: int, recipe: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.ModuleDict({"moe": GroupedExperts(64, 32, experts)})
    convert_to_fp8(model, recipe)
    offs = torch.linspace(4, 16, experts).round().to(torch.int32)
    offs[-1] = 16
    with fp8_autocast():
        model["moe"](torch.randn(16, 64), offs).square().mean().backward()
    return model


@pytest.mark.parametrize("recipe", ["delayed", "rowwise"])
@pytest.mark.parametrize("saved, here", [(8, 4), (4, 8)])
def test_a_state_saved_for_other_experts_is_refused(recipe, saved, here):
    state = fp8_state_dict(_trained(saved, recipe))
    target = _trained(here, recipe)
    before = fp8_state_checksum(fp8_state_dict(target))
    with pytest.raises(ValueError, match=rf"layer 'moe'.*saved for {saved} experts.*holds {here}"):
        load_fp8_state_dict(target, state)
    assert fp8_state_checksum(fp8_state_dict(target)) == before  # nothing restored


def test_an_older_state_tells_its_experts_by_its_weight_entries():
    state = fp8_state_dict(_trained(8, "delayed"))
    del state["moe"]["scalings"][0]["experts"]  # saved before the counts were
    with pytest.raises(ValueError, match="saved for 8 experts"):
        load_fp8_state_dict(_trained(4, "delayed"), state)
    load_fp8_state_dict(_trained(8, "delayed"), state)  # the same count loads


# -- wording ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe, k, n, said", [
    ("tensorwise", 64, 40, "N=40 not divisible by 16"), ("mxfp8", 48, 64, "K=48 not divisible by 32"),
    ("nvfp4", 64, 40, "N=40 not divisible by 16"),
])
def test_shape_reasons_name_the_dimensions_the_caller_names(recipe, k, n, said):
    recipe = recipe_from(recipe)
    assert said in recipe.shape_unsupported_reason(k, n, names=("K", "N"))
    assert "_features=" in recipe.shape_unsupported_reason(k, n)  # a linear layer's words by default
