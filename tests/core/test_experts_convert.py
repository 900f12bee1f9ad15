"""convert_to_fp8 on fused expert modules: transformers' experts of every family the installed transformers has, and
GroupedExperts; in place, state_dict unchanged, routers in high precision, the report naming what it left alone."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from fp8_lightning import (
    DelayedScaling,
    GroupedExperts,
    convert_to_fp8,
    fp8_autocast,
    fp8_state_dict,
    load_fp8_state_dict,
    sync_scales,
)
from fp8_lightning.grouped.experts import FP8ExpertsMixin
from tests.helpers.moe import EXPERTS, FAMILIES, HIDDEN, tiny_moe

pytest.importorskip("transformers")


def _experts(model) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if name.endswith("mlp.experts")}


def _routing(tokens: int = 40, seed: int = 0):
    torch.manual_seed(seed)
    x = torch.randn(tokens, HIDDEN)
    scores = torch.randn(tokens, EXPERTS)
    scores[:, 0] = -1e9  # expert 0 gets no token
    weights, index = torch.topk(scores.softmax(-1), 2, dim=-1)
    return x, index, weights


def _rel(x, ref):
    return ((x - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_converts_its_experts_in_place(family):
    model = tiny_moe(family)
    before = {k: (v.data_ptr(), v.shape, v.dtype) for k, v in model.state_dict().items()}
    experts = _experts(model)
    x, index, weights = _routing()
    plain = {name: m(x, index, weights) for name, m in experts.items()}

    report = convert_to_fp8(model, "tensorwise")

    assert sorted(report.experts) == sorted(experts) and report.experts_skipped == {}
    assert len(report.routers) == 2 and all(name.endswith(("mlp.gate", "mlp.router")) for name in report.routers)
    assert report.skipped == {}, report.skipped  # nothing else stays in high precision
    assert {k: (v.data_ptr(), v.shape, v.dtype) for k, v in model.state_dict().items()} == before
    assert "2 expert module(s) converted" in str(report)
    for name, module in experts.items():
        assert _experts(model)[name] is module and isinstance(module, FP8ExpertsMixin)
        assert torch.equal(module(x, index, weights), plain[name])  # outside fp8_autocast: the original forward
        xg = x.clone().requires_grad_()
        with fp8_autocast():
            out = module(xg, index, weights)
        out.sum().backward()
        assert 0 < _rel(out, plain[name]) < 0.08
        assert module.fp8_gemm_counts == {"fprop": 2, "dgrad": 2, "wgrad": 2}
        grads = [p.grad for n, p in module.named_parameters() if p.dim() == 3]
        assert len(grads) == 2 and all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
        for g in grads:  # expert 0 saw no token
            assert torch.equal(g[0], torch.zeros_like(g[0]))


def test_grouped_experts_convert_and_match_high_precision():
    torch.manual_seed(0)
    experts = GroupedExperts(dim=64, hidden_dim=96, num_experts=4)
    keys = {k: v.data_ptr() for k, v in experts.state_dict().items()}
    x = torch.randn(50, 64)
    offs = torch.tensor([10, 10, 31, 50], dtype=torch.int32)
    reference = experts(x, offs)
    report = convert_to_fp8(experts, "mxfp8")
    assert report.experts == ["<root>"] and {k: v.data_ptr() for k, v in experts.state_dict().items()} == keys
    assert torch.equal(experts(x, offs), reference)
    with fp8_autocast():
        out = experts(x, offs)
    assert 0 < _rel(out, reference) < 0.08
    out.sum().backward()
    assert experts.fp8_gemm_counts["wgrad"] == 3 and torch.equal(experts.w1.grad[1], torch.zeros(96, 64))
    again = convert_to_fp8(experts, "mxfp8")  # idempotent
    assert again.experts == ["<root>"]


def test_an_autocast_recipe_the_experts_cannot_take_runs_them_in_high_precision_with_one_warning():
    """Experts converted as delayed with K=48 under fp8_autocast(recipe="mxfp8") (blocks of 32): the module says so
    once, naming its recipe and the override, and runs in high precision, as a linear layer does."""
    torch.manual_seed(0)
    experts = GroupedExperts(dim=48, hidden_dim=64, num_experts=2)
    x, offs = torch.randn(20, 48), torch.tensor([8, 20], dtype=torch.int32)
    reference = experts(x, offs)
    convert_to_fp8(experts, "delayed")
    with warnings.catch_warnings(record=True) as caught, fp8_autocast(recipe="mxfp8"):
        warnings.simplefilter("always")
        out, again = experts(x, offs), experts(x, offs)
    said = [str(w.message) for w in caught if "fp8_autocast(recipe='mxfp8')" in str(w.message)]
    assert len(said) == 1 and "GroupedExperts converted as delayed runs in high precision" in said[0]
    assert "divisible by 32" in said[0]
    assert torch.equal(out, reference) and torch.equal(again, reference)
    assert not experts.fp8_gemm_counts


def test_the_report_names_what_stays_in_high_precision():
    class Custom3D(nn.Module):
        def __init__(self):
            super().__init__()
            self.bank = nn.Parameter(torch.zeros(4, 32, 32))

    model = nn.ModuleDict({
        "odd": GroupedExperts(dim=64, hidden_dim=48, num_experts=2),  # 48: not a multiple of MXFP8's 32
        "kept": GroupedExperts(dim=64, hidden_dim=64, num_experts=2),
        "custom": Custom3D(),
    })
    report = convert_to_fp8(model, "mxfp8", module_filter_fn=lambda m, name: name != "kept")
    assert report.experts == []
    assert "divisible by 32" in report.experts_skipped["odd"]
    assert report.experts_skipped["kept"] == "excluded by module_filter_fn"
    assert "Custom3D holds a 3-D weight" in report.experts_skipped["custom"]
    assert "experts skipped custom" in str(report)


def test_scaling_state_checkpoints_and_loads_strictly():
    model = tiny_moe("qwen3_moe")
    convert_to_fp8(model, DelayedScaling(amax_history_len=4))
    ids = torch.randint(0, 128, (2, 16))
    with fp8_autocast():
        model(ids, labels=ids).loss.backward()
    assert sync_scales(model) == 0  # one process: nothing to reduce, histories advanced
    state = fp8_state_dict(model)
    experts = [name for name in state if name.endswith("mlp.experts")]
    assert len(experts) == 2
    operands = state[experts[0]]["scalings"][0]["operands"]
    assert {"gate_up_proj/input", "gate_up_proj/grad_output", "down_proj/weight.7"} <= set(operands)

    fresh = tiny_moe("qwen3_moe", seed=1)
    convert_to_fp8(fresh, DelayedScaling(amax_history_len=4))
    load_fp8_state_dict(fresh, state)
    assert fp8_state_dict(fresh).keys() == state.keys()
    loaded = fp8_state_dict(fresh)[experts[0]]["scalings"][0]["operands"]["down_proj/weight.7"]
    for key, value in operands["down_proj/weight.7"].items():
        if torch.is_tensor(value):
            assert torch.equal(loaded[key], value), key

    plain = tiny_moe("qwen3_moe", seed=2)  # the model's weights load strictly into the plain model
    plain.load_state_dict(model.state_dict(), strict=True)


def test_evaluation_changes_no_scaling_state():
    model = tiny_moe("mixtral")
    convert_to_fp8(model, DelayedScaling())
    ids = torch.randint(0, 128, (2, 16))
    with fp8_autocast():
        model(ids, labels=ids).loss.backward()
    before = fp8_state_dict(model)
    model.eval()
    with torch.no_grad(), fp8_autocast():
        model(ids)
    after = fp8_state_dict(model)
    for name in before:
        for entry_before, entry_after in zip(before[name]["scalings"], after[name]["scalings"]):
            for role, values in entry_before["operands"].items():
                for key, value in values.items():
                    if torch.is_tensor(value):
                        assert torch.equal(entry_after["operands"][role][key], value), (name, role, key)


def test_torch_compile_traces_the_fp8_experts_and_counts_eager_gemms_only():
    """Under torch.compile the FP8 grouped GEMMs trace into the graph (``tests/perf/test_compile_experts.py`` checks
    fullgraph=True for every recipe) with the bits of an eager call; the GEMM counters count eager calls only
    (a compiled step has no Python side effects)."""
    torch.manual_seed(0)
    experts = GroupedExperts(dim=32, hidden_dim=32, num_experts=4)
    convert_to_fp8(experts, "tensorwise")
    x, offs = torch.randn(20, 32), torch.tensor([3, 3, 12, 20], dtype=torch.int32)
    with fp8_autocast():
        eager = experts(x, offs)
        compiled = torch.compile(experts)(x, offs)
    assert torch.equal(compiled, eager)
    compiled.sum().backward()
    assert experts.fp8_gemm_counts == {"fprop": 3}


def test_statistics_and_the_guard_see_each_expert():
    """The stats collector observes each projection's input and output gradient and every expert's weight; a
    non-finite expert weight makes the divergence guard name that expert and move the module back."""
    from fp8_lightning.guard import DivergenceGuard, GuardState
    from fp8_lightning.stats import attach_collector

    model = tiny_moe("qwen3_moe")
    convert_to_fp8(model, "tensorwise")
    module = model.model.layers[1].mlp.experts
    with torch.no_grad():
        module.down_proj[5, 3, 7] = float("inf")
    collector = attach_collector(model)
    collector.always = True
    ids = torch.randint(0, 128, (2, 16))
    with fp8_autocast():
        model(ids, labels=ids).loss.backward()
    stats = collector.finish_step()
    name = "model.layers.1.mlp.experts"
    roles = {role for layer, role in stats if layer == name}
    assert {"gate_up_proj.input", "gate_up_proj.grad_output", "down_proj.weight[0]", "down_proj.weight[7]"} <= roles
    assert stats[(name, "down_proj.weight[5]")].nonfinite and not stats[(name, "down_proj.weight[4]")].nonfinite
    assert stats[("model.layers.0.mlp.experts", "gate_up_proj.input")].amax > 0
    events = GuardState(DivergenceGuard()).step(0, stats)
    assert [(e.layer, e.role) for e in events] == [(name, "down_proj.weight[5]")]


def test_fp8_optimizer_states_train_fp8_experts_like_adamw():
    from fp8_lightning import FP8Optimizer

    losses = {}
    for mode in ("adamw", "fp8 states"):
        model = tiny_moe("qwen3_moe")
        convert_to_fp8(model, "mxfp8")
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        if mode == "fp8 states":
            optimizer = FP8Optimizer(optimizer, "max_savings")
        ids = torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(1))
        losses[mode] = []
        for _ in range(5):
            with fp8_autocast():
                loss = model(ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[mode].append(loss.item())
    assert losses["fp8 states"][-1] < losses["fp8 states"][0] - 0.5
    assert losses["fp8 states"] == pytest.approx(losses["adamw"], rel=5e-3)


def test_the_gate_keeps_experts_in_bf16_where_their_gemms_would_be_emulated_on_a_gpu():
    """Where no FP8 grouped kernel serves the recipe (blockwise and MX everywhere; any recipe when the CUDA device
    cannot be asked, as here) the grouped GEMMs would be emulated in float32, slower than bf16, so the profitability gate keeps
    experts in high precision on CUDA (with the reason) and lets them convert on a CPU or when it is off. The native
    route's side: tests/core/test_grouped_native.py."""
    from fp8_lightning import ProfitabilityGate
    from fp8_lightning.profitability import profitability_setting

    def experts():
        return GroupedExperts(dim=64, hidden_dim=64, num_experts=2)

    report = convert_to_fp8(experts(), "tensorwise", profitability=ProfitabilityGate(device="cuda"))
    assert report.experts == [] and "emulated in float32 on cuda" in report.experts_skipped["<root>"]
    assert "profitability=False" in report.experts_skipped["<root>"]
    with profitability_setting("auto"):
        assert convert_to_fp8(experts(), "tensorwise").experts == ["<root>"]  # the weights are on the CPU
    assert convert_to_fp8(experts(), "tensorwise", profitability=False).experts == ["<root>"]
