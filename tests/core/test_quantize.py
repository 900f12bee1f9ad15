"""Per-tensor and MXFP8 quantization against the formulas, with float64 references."""

import math

import pytest
import torch

from fp8_lightning import dequantize_mxfp8, dequantize_tensorwise, quantize_mxfp8, quantize_tensorwise
from fp8_lightning.ops.dispatch import (
    amax_and_value,
    dequantize_operand,
    operand_f32,
    fast_quantize_mx_columns as quantize_mx_columns,
    fast_quantize_mx_operands as quantize_mx_operands,
)
from fp8_lightning.mx import e8m0_to_float
from fp8_lightning.quantize import pad_dim, tensorwise_scale, tensorwise_scale_value
from tests.core.fp8_reference import round_saturate
from tests.environment import set_env

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.fixture(autouse=True, params=["C codec", "pure torch"])
def cpu_path(request, monkeypatch):
    """Every test runs on both CPU paths: the C codec (where it is built) and the pure-torch code."""
    set_env(monkeypatch, FP8_LIGHTNING_DISABLE_CPU_CODEC="1" if request.param == "pure torch" else "0")
    return request.param


@pytest.mark.parametrize("fmt, dtype, top", [("E4M3", E4M3, 448.0), ("E5M2", E5M2, 57344.0), ("HYBRID", E4M3, 448.0)])
def test_tensorwise_scale_maps_amax_to_the_format_max(fmt, dtype, top):
    x = torch.randn(64, 48, dtype=torch.float64).float() * 3
    data, scale = quantize_tensorwise(x, fmt)
    assert data.dtype == dtype and data.shape == x.shape
    amax = x.double().abs().max().item()
    assert scale.item() == pytest.approx(top / amax, rel=1e-6)
    assert data.float().abs().max().item() == top
    # every element equals the float64 reference cast of x * scale
    want = [round_saturate(v, dtype) for v in (x.double() * scale.double()).flatten().tolist()]
    assert data.double().flatten().tolist() == want
    assert torch.allclose(dequantize_tensorwise(data, scale), data.float() / scale)


def test_quantize_rejects_integer_input():
    with pytest.raises(TypeError, match="floating-point"):
        quantize_tensorwise(torch.arange(4), "E4M3")
    with pytest.raises(TypeError, match="floating-point"):
        quantize_mxfp8(torch.arange(32))


def _ref_mx_exponent(block, rounding, top=448.0, emax=8):
    amax = max(abs(v) for v in block)
    if amax == 0:
        return -127
    floor_exp = math.floor(math.log2(amax)) - emax
    if rounding == "floor":
        return floor_exp
    return math.ceil(math.log2(amax / top)) if amax / top > 0 else floor_exp


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_mx_scales_are_powers_of_two_one_per_block(rounding):
    x = torch.randn(6, 128) * torch.logspace(-6, 6, 128)  # blocks spanning many binades
    data, scale = quantize_mxfp8(x, scale_rounding=rounding)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (6, 4) and data.shape == x.shape
    s = e8m0_to_float(scale).double()
    assert torch.equal(torch.log2(s), torch.round(torch.log2(s)))  # powers of two
    blocks = x.double().reshape(6, 4, 32)
    for i in range(6):
        for j in range(4):
            block = blocks[i, j].tolist()
            exp = _ref_mx_exponent(block, rounding)
            assert s[i, j].item() == 2.0**exp
            want = [round_saturate(v / 2.0**exp, E4M3) for v in block]
            assert data.reshape(6, 4, 32)[i, j].double().tolist() == want


def test_rceil_never_saturates_and_floor_may():
    x = torch.full((1, 32), 1.0)
    x[0, 0] = 480.0 / 256  # mantissa above 1.75: floor puts it at 480 > 448
    d_floor, s_floor = quantize_mxfp8(x, scale_rounding="floor")
    d_rceil, s_rceil = quantize_mxfp8(x, scale_rounding="rceil")
    assert e8m0_to_float(s_floor).item() == 2.0**-8 and d_floor.float()[0, 0].item() == 448.0
    assert e8m0_to_float(s_rceil).item() == 2.0**-7 and d_rceil.float()[0, 0].item() == 240.0


def test_rceil_at_an_exact_boundary_uses_the_lower_power():
    x = torch.full((1, 32), 0.5)
    x[0, 0] = 448.0 * 2.0**-5  # amax / 2**-5 == 448 exactly
    _, s = quantize_mxfp8(x)
    assert e8m0_to_float(s).item() == 2.0**-5


def test_mx_zero_block_nan_block_and_e5m2():
    x = torch.zeros(2, 32)
    x[1, 3] = float("nan")
    data, scale = quantize_mxfp8(x)
    assert scale.view(torch.uint8).tolist() == [[0], [255]]
    assert torch.isnan(dequantize_mxfp8(data, scale)[1]).all()
    y = torch.randn(4, 64) * 1000
    d, s = quantize_mxfp8(y, fp8_format="E5M2")
    assert d.dtype == E5M2
    rel = ((dequantize_mxfp8(d, s) - y).abs() / y.abs().clamp(min=1e-3)).max()
    assert rel <= 2**-3  # E5M2: 2 mantissa bits, relative rounding error <= 2**-3 for normals


def test_mx_round_trip_error_is_within_e4m3_precision():
    x = torch.randn(8, 256, dtype=torch.float64).float()
    d, s = quantize_mxfp8(x)
    back = dequantize_mxfp8(d, s).double()
    scale = e8m0_to_float(s).double().repeat_interleave(32, dim=-1)
    # |error| <= half an ulp: 2**-4 relative for normals, half the smallest subnormal (2**-10 * scale) absolute
    bound = torch.maximum(x.double().abs() * 2**-4, scale * 2**-10)
    assert ((back - x.double()).abs() <= bound).all()


def test_mx_shape_errors_say_what_to_do():
    with pytest.raises(ValueError, match="divisible by block_size=32; got shape \\(4, 40\\)"):
        quantize_mxfp8(torch.randn(4, 40))
    d, s = quantize_mxfp8(torch.randn(4, 64))
    with pytest.raises(ValueError, match="does not match"):
        dequantize_mxfp8(d, s[:2])


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_columnwise_mx_operand_equals_quantizing_the_padded_transpose(rounding, dtype):
    x = torch.randn(70, 96) * torch.logspace(-4, 4, 96)  # 70 rows: zero-padded to 96 along the blocks
    x[32:64, 7] = 0.0  # an all-zero block
    x[3, 9] = float("nan")  # a NaN block
    col = quantize_mx_columns(x, 32, rounding, dtype)
    padded_t = pad_dim(x.t().contiguous(), -1, 32)
    want_data, want_scale = quantize_mxfp8(padded_t, scale_rounding=rounding, fp8_format=dtype)
    assert col.data.shape == (96, 96) and col.scale.shape == (96, 3)
    assert torch.equal(col.data.contiguous().view(torch.uint8), want_data.view(torch.uint8))
    assert torch.equal(col.scale.contiguous().view(torch.uint8), want_scale.view(torch.uint8))
    want = dequantize_mxfp8(want_data, want_scale)
    torch.testing.assert_close(dequantize_operand(col), want, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(operand_f32(col), want, rtol=0, atol=0, equal_nan=True)  # what a CPU GEMM multiplies
    # both copies from one read of x: the same bytes as quantizing each layout on its own
    row, col_too = quantize_mx_operands(x, 32, rounding, dtype)
    want_row, want_row_scale = quantize_mxfp8(x, scale_rounding=rounding, fp8_format=dtype)
    assert torch.equal(row.data.view(torch.uint8), want_row.view(torch.uint8))
    assert torch.equal(row.scale.view(torch.uint8), want_row_scale.view(torch.uint8))
    assert torch.equal(col_too.data.contiguous().view(torch.uint8), want_data.view(torch.uint8))
    assert torch.equal(col_too.scale.contiguous().view(torch.uint8), want_scale.view(torch.uint8))
    assert quantize_mx_operands(x, 32, rounding, dtype, columnwise=False)[1] is None


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("eps,power_of_2", [(1e-12, False), (1e-12, True), (1e-3, False), (0.0, False)])
def test_host_tensorwise_scale_equals_the_tensor_formula_bit_for_bit(dtype, eps, power_of_2):
    """Two implementations of one formula: the tensor ops torch runs, and the host arithmetic with float32
    roundings that CPU casts use. They must agree on every bit, from subnormal to huge amaxes."""
    gen = torch.Generator().manual_seed(3)
    amaxes = torch.cat([
        torch.logspace(-44, 38, 2000, dtype=torch.float64).float(),  # every binade, subnormals included
        torch.rand(2000, generator=gen) * 1000,
        torch.tensor([1e-12, 1e-3, 448.0, 57344.0, 3.4e38, 1.401298464324817e-45, 7.0, 3.0]),
    ])
    for a in amaxes.tolist():
        want = tensorwise_scale(torch.tensor(a), dtype, eps, power_of_2)
        got = tensorwise_scale_value(a, dtype, eps, power_of_2)
        assert torch.tensor(got, dtype=torch.float32).view(torch.int32) == want.view(torch.int32), (a, got, want)


def test_amax_and_value_agree_and_handle_nan_and_one_sided_extremes():
    for x in [torch.tensor([1.0, -3.0]), torch.tensor([4.0, -3.0]), torch.tensor([-float("inf"), 2.0]),
              torch.tensor([1.0, float("nan")]), torch.zeros(0), torch.randn(7, 5, dtype=torch.float64)]:
        t, v = amax_and_value(x)
        want = x.double().abs().max().item() if x.numel() else 0.0
        assert t.dtype == torch.float32 and t.shape == ()
        if math.isnan(want):
            assert math.isnan(v) and torch.isnan(t)
        else:
            assert v == t.item() == pytest.approx(want, rel=1e-7)
