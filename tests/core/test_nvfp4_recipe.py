"""The NVFP4 recipe in a layer: its GEMMs are float64 math on the dequantized operands, the RHT leaves wgrad
unchanged up to quantization, stochastic rounding is seeded per cast and saved, a tiny model trains close to float32,
and a checkpoint resumes exactly."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from fp8_lightning import (
    FP8Linear,
    NVFP4BlockScaling,
    convert_to_fp8,
    fp8_autocast,
    fp8_state_dict,
    load_fp8_state_dict,
    recipe_from,
)
from fp8_lightning.formats import Format
from fp8_lightning.nvfp4 import apply_rht, dequantize_nvfp4, quantize_nvfp4, rht_matrix, rht_signs


def test_the_recipe_is_found_by_name_and_round_trips():
    assert recipe_from("nvfp4") == NVFP4BlockScaling()
    r = NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True, fp4_2d_weights=False, seed=3)
    assert recipe_from(r.to_dict()) == r
    with pytest.raises(ValueError, match="disable_rht"):
        NVFP4BlockScaling(disable_rht="yes")
    with pytest.raises(ValueError, match="seed"):
        NVFP4BlockScaling(seed=-1)


def test_k_not_a_multiple_of_16_is_refused_with_the_reason():
    report = convert_to_fp8(nn.Sequential(nn.Linear(24, 32), nn.Linear(32, 32)), "nvfp4")
    assert report.converted == ["1"]
    assert "in_features=24 not divisible by 16" in report.skipped["0"] and "NVFP4" in report.skipped["0"]


def _layer(recipe, seed=0):
    torch.manual_seed(seed)
    return FP8Linear.from_linear(nn.Linear(64, 32), recipe)


def test_forward_and_dgrad_are_float64_math_on_the_dequantized_operands():
    """With RTN everywhere, y = Q(x) Q(W)^T + b and dx = Q(g) Q(W) (16x16 weight tiles: the same W either way)."""
    recipe = NVFP4BlockScaling(disable_stochastic_rounding=True)
    layer = _layer(recipe)
    x = torch.randn(20, 64, requires_grad=True)
    g = torch.randn(20, 32)
    with fp8_autocast():
        y = layer(x)
    y.backward(g)
    xq = dequantize_nvfp4(quantize_nvfp4(x.detach())).double()
    wq = dequantize_nvfp4(quantize_nvfp4(layer.weight.detach(), tile_rows=16)).double()
    wq_t = dequantize_nvfp4(quantize_nvfp4(layer.weight.detach().t(), tile_rows=16)).double()
    assert torch.equal(wq.t(), wq_t)
    gq = dequantize_nvfp4(quantize_nvfp4(g)).double()
    torch.testing.assert_close(y.double(), xq @ wq.T + layer.bias.detach().double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), gq @ wq_t.T, rtol=1e-5, atol=1e-5)


def test_wgrad_multiplies_the_rht_copies_of_both_operands():
    recipe = NVFP4BlockScaling(disable_stochastic_rounding=True)
    layer = _layer(recipe)
    x = torch.randn(20, 64)  # M = 20: the columnwise copies pad M to 32
    g = torch.randn(20, 32)
    with fp8_autocast():
        layer(x).backward(g)
    r = rht_matrix(rht_signs(recipe.seed), torch.float32)
    pad = lambda t: torch.nn.functional.pad(t, (0, 12))  # noqa: E731
    x_t = dequantize_nvfp4(quantize_nvfp4(apply_rht(pad(x.t()), r))).double()
    g_t = dequantize_nvfp4(quantize_nvfp4(apply_rht(pad(g.t()), r))).double()
    torch.testing.assert_close(layer.weight.grad.double(), g_t @ x_t.T, rtol=1e-5, atol=1e-5)
    # the RHT itself changes nothing: without quantization the transformed product is the plain one
    torch.testing.assert_close(apply_rht(pad(g.t()), r) @ apply_rht(pad(x.t()), r).T, g.t() @ x, rtol=1e-5,
                               atol=1e-5)


def test_a_format_other_than_e4m3_is_refused_not_ignored():
    """The values are E2M1 and the block scales E4M3 whatever fp8_format says: HYBRID and E5M2 are refused with
    what NVFP4 takes, instead of being accepted and ignored (or refused for a reason about two E5M2 operands)."""
    for fmt in ("HYBRID", "e5m2", Format.HYBRID):
        with pytest.raises(ValueError, match="allowed: E4M3, the format of NVFP4's block scales"):
            NVFP4BlockScaling(fp8_format=fmt)
    assert NVFP4BlockScaling(fp8_format="e4m3") == NVFP4BlockScaling()


def _twin_grads(recipe, names=("a", "b")):
    """Weight gradients of two layers with equal weights, inputs and output gradients, converted in one model."""
    torch.manual_seed(0)
    first = nn.Linear(64, 64)
    model = nn.ModuleDict({name: copy.deepcopy(first) for name in names})
    convert_to_fp8(model, recipe, layers={"last": 0})
    x, g = torch.randn(32, 64), torch.randn(32, 64)
    with fp8_autocast():
        outs = [model[name](x) for name in names]
    for out in outs:
        out.backward(g)
    return model, [model[name].weight.grad for name in names]


def test_each_layer_draws_its_own_rounding_noise_alike_in_every_run():
    """Two layers casting the same gradient round it with different noise (each layer's seed mixes in its name);
    rounding to nearest makes them equal; a second conversion of the same model draws the same noise; the seed
    travels in the layer's state."""
    model, (a, b) = _twin_grads(NVFP4BlockScaling())
    assert not torch.equal(a, b)
    _, (again, _) = _twin_grads(NVFP4BlockScaling())
    assert torch.equal(a, again)
    _, (a_rtn, b_rtn) = _twin_grads(NVFP4BlockScaling(disable_stochastic_rounding=True))
    assert torch.equal(a_rtn, b_rtn)
    seeds = [layer.fp8_scaling().operands["input"].state_dict()["sr_seed"] for layer in model.values()]
    assert seeds[0] != seeds[1]
    # states an fp8_autocast(recipe=...) override makes later are named too
    other = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    convert_to_fp8(other, "tensorwise")
    with fp8_autocast(recipe=NVFP4BlockScaling()):
        other(torch.randn(16, 64)).sum().backward()
    late = [layer.fp8_scaling(NVFP4BlockScaling()).operands["input"].sr_seed for layer in other]
    assert late[0] != late[1]
    # a state saved before per-layer seeds loads with the recipe's seed, the one it was drawing with
    state = model["a"].fp8_scaling().operands["input"]
    old = {key: value for key, value in state.state_dict().items() if key != "sr_seed"}
    state.load_state_dict(old)
    assert state.sr_seed == 0


def test_stochastic_rounding_is_seeded_per_cast_and_counted():
    recipe = NVFP4BlockScaling()
    x, g = torch.randn(16, 64), torch.randn(16, 32)

    def grads(layer):
        out = []
        for _ in range(2):
            layer.weight.grad = None
            with fp8_autocast():
                layer(x).backward(g)
            out.append(layer.weight.grad.clone())
        return out

    a, b = _layer(recipe), _layer(recipe)
    first, second = grads(a), grads(b)
    assert all(torch.equal(p, q) for p, q in zip(first, second))  # the same seed: the same bits
    assert not torch.equal(first[0], first[1])  # the second cast draws new numbers
    state = a.fp8_scaling().operands["grad_output"]
    assert state.sr_casts.item() == 2
    c = _layer(NVFP4BlockScaling(seed=1))
    assert not torch.equal(grads(c)[0], first[0])


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))


def _data():
    torch.manual_seed(1)
    x = torch.randn(256, 32)
    teacher = torch.randn(32, 16) / 32**0.5
    return x, (x @ teacher).argmax(-1)


def _train(model, steps, fp4: bool, start=0):
    x, y = _data()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        batch = slice((step * 64) % 256, (step * 64) % 256 + 64)
        with fp8_autocast(enabled=fp4):
            loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, optimizer


def test_a_tiny_model_trains():
    """The loss of a small classifier halves in 60 steps (the transformer of test_convergence is the accuracy
    check: within 5% of float32)."""
    model = _model()
    report = convert_to_fp8(model, "nvfp4")
    assert len(report.converted) == 3
    losses, _ = _train(model, 60, fp4=True)
    assert losses[-1] < 0.5 * losses[0]


ABLATION = {  # README's NVFP4 ablation rows: each part of the recipe added to the one before
    "RTN only": (NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True), {"last": 0}),
    "+RHT": (NVFP4BlockScaling(disable_stochastic_rounding=True), {"last": 0}),
    "+SR": (NVFP4BlockScaling(), {"last": 0}),
    "+bf16 tail (default)": (NVFP4BlockScaling(), None),
}


def ablation_row(row: str) -> float:
    """Held-out loss of tests/core/test_convergence.py's 2-block transformer on its Markov-chain task (200 steps)
    under one ABLATION row."""
    import tests.core.test_convergence as convergence

    recipe, layers = ABLATION[row]
    convert = convergence.convert_to_fp8
    convergence.convert_to_fp8 = lambda model, r: convert_to_fp8(model, r, layers=layers)
    try:
        return convergence.train(recipe)
    finally:
        convergence.convert_to_fp8 = convert


@pytest.mark.slow
def test_a_transformer_trains_within_5_percent_of_float32():
    """The default recipe and policy (the last block, ceil(15% of 2), in bf16); ``python -m
    tests.core.test_nvfp4_recipe`` prints every ablation row (README)."""
    from tests.core.test_convergence import train

    fp32, fp4 = train(None), ablation_row("+bf16 tail (default)")
    assert abs(fp4 - fp32) / fp32 < 0.05, (fp4, fp32)


def test_the_sign_vector_and_the_rounding_counter_are_saved_and_a_resumed_run_is_exact():
    model = _model()
    convert_to_fp8(model, NVFP4BlockScaling(seed=5))
    x, y = _data()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def step(m, opt, i):
        with fp8_autocast():
            loss = nn.functional.cross_entropy(m(x[i * 32 : i * 32 + 32]), y[i * 32 : i * 32 + 32])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    for i in range(3):
        step(model, optimizer, i)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": optimizer.state_dict(), "fp8": fp8_state_dict(model)})
    entry = saved["fp8"]["0"]["scalings"][0]
    assert torch.equal(entry["operands"]["grad_output"]["rht_signs"], rht_signs(5))
    assert entry["operands"]["grad_output"]["sr_casts"].item() == 3
    straight = [step(model, optimizer, i) for i in range(3, 6)]

    resumed = _model()
    convert_to_fp8(resumed, NVFP4BlockScaling(seed=5))
    resumed.load_state_dict(saved["model"])
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=3e-3)
    opt2.load_state_dict(saved["opt"])
    load_fp8_state_dict(resumed, saved["fp8"])
    assert [step(resumed, opt2, i) for i in range(3, 6)] == straight
    # a plain model loads the weights
    plain = _model()
    plain.load_state_dict(resumed.state_dict())


def test_torch_compile_gives_the_eager_bits():
    """torch.compile (aot_eager, graphs may break) computes what eager mode does (one graph with fullgraph=True:
    tests/perf/test_compile.py)."""
    x = torch.randn(16, 64)
    out = {}
    for compiled in (False, True):
        layer = _layer(NVFP4BlockScaling())
        run = torch.compile(layer, backend="aot_eager") if compiled else layer
        with fp8_autocast():
            y = run(x)
        y.sum().backward()
        out[compiled] = (y.detach(), layer.weight.grad.clone())
    torch._dynamo.reset()
    assert torch.equal(out[False][0], out[True][0]) and torch.equal(out[False][1], out[True][1])


if __name__ == "__main__":  # the README's NVFP4 ablation table
    from tests.core.test_convergence import train as _train_fp32

    torch.set_num_threads(1)
    reference = _train_fp32(None)
    print(f"| float32 | {reference:.4f} | |")
    for name in ABLATION:
        value = ablation_row(name)
        print(f"| {name} | {value:.4f} | {100 * (value - reference) / reference:+.2f}% |", flush=True)
