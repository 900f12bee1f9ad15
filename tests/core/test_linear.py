"""FP8Linear: the three GEMMs against float64 math on the same quantized operands, and against the
unquantized result within the error FP8 implies."""

import pytest
import torch
import torch.nn as nn

from fp8_lightning import (
    DelayedScaling,
    FP8Linear,
    Format,
    MXFP8BlockScaling,
    TensorwiseScaling,
    dequantize_mxfp8,
    fp8_autocast,
    quantize_mxfp8,
)
from fp8_lightning.quantize import quantize_with_scale

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
PER_TENSOR = [TensorwiseScaling(), DelayedScaling(), DelayedScaling(fp8_format=Format.E4M3)]


def _layer(recipe, k=64, n=48, bias=True):
    return FP8Linear.from_linear(nn.Linear(k, n, bias=bias), recipe)


def _tensorwise_ref(t: torch.Tensor, dtype) -> torch.Tensor:
    """float64 dequantized operand with the scale from the formula fp8_max / amax."""
    top = 448.0 if dtype == E4M3 else 57344.0
    scale = torch.tensor(top / t.double().abs().max().item(), dtype=torch.float32)
    return quantize_with_scale(t, scale, dtype).double() / scale.double()


def _run(layer, x, g):
    x = x.clone().requires_grad_()
    with fp8_autocast():
        y = layer(x)
    y.backward(g)
    return y.detach().double(), x.grad.double(), layer.weight.grad.double()


@pytest.mark.parametrize("recipe", PER_TENSOR, ids=lambda r: f"{type(r).__name__}-{r.fp8_format.value}")
def test_per_tensor_gemms_equal_float64_on_the_quantized_operands(recipe):
    layer = _layer(recipe)
    x, g = torch.randn(2, 10, 64), torch.randn(2, 10, 48) * 1e-3
    y, dx, dw = _run(layer, x, g)
    w = layer.weight.detach()
    xq, wq = _tensorwise_ref(x.reshape(-1, 64), E4M3), _tensorwise_ref(w, E4M3)
    gq = _tensorwise_ref(g.reshape(-1, 48), recipe.fp8_format.backward_dtype)
    want_y = (xq @ wq.T + layer.bias.double()).reshape(2, 10, 48)
    want_dx = (gq @ wq).reshape(2, 10, 64)
    want_dw = gq.T @ xq
    for got, want in ((y, want_y), (dx, want_dx), (dw, want_dw)):
        # fp32 accumulation over at most 64 terms of exactly representable products
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_mxfp8_gemms_equal_float64_on_the_quantized_operands(rounding):
    recipe = MXFP8BlockScaling(scale_rounding=rounding, fp8_format=Format.HYBRID)
    layer = _layer(recipe, k=64, n=96)
    x, g = torch.randn(40, 64), torch.randn(40, 96)  # M=40 is not a block multiple: wgrad pads M
    y, dx, dw = _run(layer, x, g)
    w = layer.weight.detach()

    def mx(t, dtype=E4M3):  # float64 value of t quantized along its last dim
        t_pad = torch.nn.functional.pad(t, (0, (-t.shape[-1]) % 32))
        d, s = quantize_mxfp8(t_pad, scale_rounding=rounding, fp8_format=dtype)
        return dequantize_mxfp8(d, s, torch.float64)[..., : t.shape[-1]]

    want_y = mx(x) @ mx(w).T + layer.bias.double()
    want_dx = mx(g, E5M2) @ mx(w.T).T
    want_dw = mx(g.T, E5M2) @ mx(x.T).T
    for got, want in ((y, want_y), (dx, want_dx), (dw, want_dw)):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


def _fp8_error_bound(a, b, u_a, u_b, sub_a, sub_b):
    """Rigorous bound on |Q(a) @ Q(b).T - a @ b.T| from per-element errors |Q(t)-t| <= max(u|t|, sub)."""
    ea = torch.maximum(a.abs() * u_a, torch.full_like(a, sub_a))
    eb = torch.maximum(b.abs() * u_b, torch.full_like(b, sub_b))
    return a.abs() @ eb.T + ea @ b.abs().T + ea @ eb.T


@pytest.mark.parametrize("recipe", [TensorwiseScaling(), DelayedScaling()], ids=["tensorwise", "delayed"])
def test_forward_and_gradients_are_within_the_error_fp8_implies(recipe):
    layer = _layer(recipe, bias=False)
    x, g = torch.randn(32, 64, dtype=torch.float64).float(), torch.randn(32, 48)
    y, dx, dw = _run(layer, x, g)
    xd, wd, gd = x.double(), layer.weight.detach().double(), g.double()

    def sub(t, top):  # half the smallest subnormal, in t's units
        return t.abs().max().item() / top * 2**-10

    u4, u5 = 2.0**-4, 2.0**-3  # unit roundoff of 3 and 2 mantissa bits
    assert ((y - xd @ wd.T).abs() <= _fp8_error_bound(xd, wd, u4, u4, sub(xd, 448), sub(wd, 448)) + 1e-6).all()
    assert ((dx - gd @ wd).abs() <= _fp8_error_bound(gd, wd.T, u5, u4, sub(gd, 57344) * 4, sub(wd, 448)) + 1e-6).all()
    assert ((dw - gd.T @ xd).abs() <= _fp8_error_bound(gd.T, xd.T, u5, u4, sub(gd, 57344) * 4, sub(xd, 448)) + 1e-6).all()
    # and the error is a real FP8 error, not zero: the layer did quantize
    assert (y - xd @ wd.T).abs().max() > 1e-4


def test_outside_fp8_autocast_the_layer_is_an_ordinary_linear():
    ref = nn.Linear(64, 48)
    layer = FP8Linear.from_linear(nn.Linear(64, 48), TensorwiseScaling())
    layer.load_state_dict(ref.state_dict())
    x = torch.randn(5, 64)
    assert torch.equal(layer(x), ref(x))
    with fp8_autocast(enabled=False):
        assert torch.equal(layer(x), ref(x))
    with fp8_autocast():
        assert not torch.equal(layer(x), ref(x))


def test_autocast_dtype_sets_the_output_dtype_and_bias_stays_high_precision():
    layer = _layer(TensorwiseScaling())
    x = torch.randn(4, 64)
    with fp8_autocast(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    assert layer.bias.dtype == torch.float32


def test_recipe_override_in_autocast_keeps_separate_state():
    layer = _layer(DelayedScaling(), k=64, n=64)
    x = torch.randn(4, 64)
    with fp8_autocast():
        layer(x)
    with fp8_autocast(recipe="mxfp8"):
        layer(x)
    assert set(layer._fp8_scalings) == {DelayedScaling(), MXFP8BlockScaling()}


def test_integer_input_gets_a_clear_error():
    layer = _layer(TensorwiseScaling())
    with fp8_autocast(), pytest.raises(TypeError, match="nn.Embedding"):
        layer(torch.ones(2, 64, dtype=torch.long))


def test_a_recipe_that_does_not_fit_the_shape_falls_back_with_one_warning():
    layer = _layer(TensorwiseScaling(), k=48, n=48)  # 48 is not a multiple of the MX block (32)
    x = torch.randn(3, 48)
    with fp8_autocast(recipe=MXFP8BlockScaling()):
        with pytest.warns(UserWarning, match="not divisible by 32"):
            y = layer(x)
        assert torch.equal(y, nn.functional.linear(x, layer.weight, layer.bias))


def test_odd_token_counts_are_fine():
    for recipe in (TensorwiseScaling(), MXFP8BlockScaling()):
        layer = _layer(recipe, k=64, n=64)
        x = torch.randn(7, 64, requires_grad=True)
        with fp8_autocast():
            layer(x).sum().backward()
        assert x.grad.shape == x.shape and torch.isfinite(layer.weight.grad).all()


def test_weight_is_cast_once_per_optimizer_step_across_micro_batches():
    layer = _layer(DelayedScaling())
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    for step in range(3):
        for _ in range(4):  # gradient accumulation
            with fp8_autocast():
                layer(torch.randn(8, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
        assert layer.fp8_weight_casts == step + 2  # + 1: the first reuse casts again (no checksum taken yet)
    # the delayed history advanced once per step (the auto-update runs at the first forward after a step)
    with fp8_autocast():
        layer(torch.randn(8, 64))
    weight_state = layer.fp8_scaling().operands["weight"]
    assert int((weight_state.amax_history > 0).sum()) == 3


def test_nan_gradient_is_counted_and_the_history_stays_clean():
    layer = _layer(DelayedScaling())
    x = torch.randn(8, 64)
    with fp8_autocast():
        y = layer(x)
    g = torch.randn_like(y)
    g[0, 0] = float("nan")
    y.backward(g)
    state = layer.fp8_scaling().operands["grad_output"]
    assert state.nonfinite_count.item() == 1
    state.update()
    assert torch.isfinite(state.amax_history).all() and torch.isfinite(state.scale)


@pytest.mark.parametrize("recipe", [DelayedScaling(), TensorwiseScaling(), MXFP8BlockScaling()],
                         ids=lambda r: type(r).__name__)  # fmt: skip
def test_a_layer_that_has_run_pickles_and_computes_the_same_after(recipe):
    import pickle

    layer = _layer(recipe, k=64, n=32)
    x = torch.randn(4, 64)
    _run(layer, x, torch.randn(4, 32))  # fills the FP8 weight cache (float8 tensors)
    clone = pickle.loads(pickle.dumps(layer))
    with fp8_autocast():
        assert torch.equal(clone(x), layer(x))
    assert clone.fp8_scaling().state_dict().keys() == layer.fp8_scaling().state_dict().keys()


def test_from_linear_takes_a_recipe_name_and_names_a_bad_one():
    layer = FP8Linear.from_linear(nn.Linear(64, 32), "tensorwise")
    assert type(layer.fp8_recipe) is TensorwiseScaling
    assert type(FP8Linear.from_linear(nn.Linear(64, 32)).fp8_recipe).__name__ == "DelayedScaling"
    with pytest.raises(ValueError, match="no-such-recipe"):
        FP8Linear.from_linear(nn.Linear(64, 32), "no-such-recipe")
