"""Property-based tests (hypothesis) of the casts, the scales and the layer's shape handling.

Every property is checked against float64 math written here, never against the library's own output: random
shapes (0 included), random magnitudes over many binades, and NaN, infinities and float32 subnormals planted at
random places. The references:

* a saturated cast is torch's own cast of the float64 clamp of ``x * scale`` (the product of a float32 value and
  a float32 scale is exact in float64);
* a scale ``fp8_max / amax`` is divided in float64 and rounded once to float32 (capped at float32's max), and a
  power-of-two scale is the largest power of two not above it;
* an MX block's exponent is the smallest (``rceil``) or the OCP ``floor`` exponent found by plain float64 search;
* the layer's forward is the float64 product of the operands dequantized by those references, within the error
  of a float32 accumulation over K terms.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fp8_lightning
from fp8_lightning import (
    BlockwiseScaling,
    DelayedScaling,
    FP8Linear,
    MXFP8BlockScaling,
    RowwiseScaling,
    TensorwiseScaling,
    fp8_autocast,
)
from fp8_lightning import blockwise, mx, quantize, rowwise

PROPERTY = settings(
    max_examples=30, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_DTYPES = [E4M3, E5M2]
FMAX = {E4M3: 448.0, E5M2: 57344.0}
EMAX = {E4M3: 8, E5M2: 15}  # exponent of the largest binade
MANTISSA = {E4M3: 3, E5M2: 2}
MIN_NORMAL_EXP = {E4M3: -6, E5M2: -14}
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
NAN, INF = float("nan"), float("inf")
SPECIALS = [NAN, INF, -INF, 0.0, -0.0, 2.0**-149, -(2.0**-140), 2.0**-126, 1e-30, 448.0, -480.0, 57344.0, 6.5e4, 3e38]
FINITE_SPECIALS = [v for v in SPECIALS if math.isfinite(v)]
RECIPES = [
    DelayedScaling(),
    TensorwiseScaling(),
    MXFP8BlockScaling(),
    RowwiseScaling(),
    RowwiseScaling(high_precision_wgrad=True),
    BlockwiseScaling(),
]
RECIPE_IDS = ["delayed", "tensorwise", "mxfp8", "rowwise", "rowwise_hp_wgrad", "blockwise"]


# ------------------------------------------------------------------------------------------------------------
# Strategies and float64 references
# ------------------------------------------------------------------------------------------------------------


@st.composite
def tensors(draw, shape, specials=SPECIALS, dtype=torch.float32, max_exp=30):
    """float32 values ``randn * 2**e`` over a drawn range of binades, with a few special values planted."""
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    base = draw(st.integers(-max_exp, max_exp))
    spread = draw(st.integers(0, 12))  # binades between the elements
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    x = x * torch.pow(2.0, base + torch.randint(-spread, spread + 1, shape, generator=gen).double())
    x = x.float()
    flat = x.view(-1)
    if flat.numel() and specials:
        for index, value in draw(st.lists(st.tuples(st.integers(0, flat.numel() - 1), st.sampled_from(specials)),
                                          max_size=4)):
            flat[index] = value
    return x.to(dtype)


def f32(value: float) -> float:
    """``value`` rounded once to float32 (a float64 that overflows float32 becomes inf)."""
    return torch.tensor(value, dtype=torch.float64).float().item()


def capped_scale(fp8_max: float, amax: float) -> float:
    """``fp8_max / amax`` in float64, rounded once to float32, capped at float32's max."""
    quotient = fp8_max / amax if amax > 0 else INF
    return min(f32(quotient), FLOAT32_MAX)


def power_of_2_below(scale: float) -> float:
    """The largest power of two not above a positive finite ``scale``."""
    return 2.0 ** (math.frexp(scale)[1] - 1)


def saturated_cast(y64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Torch's own cast of the float64 clamp to the format's range (NaN stays NaN)."""
    return y64.clamp(-FMAX[dtype], FMAX[dtype]).to(dtype)


def assert_same_codes(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same NaN places; every other code equal bit for bit."""
    assert got.shape == want.shape and got.dtype == want.dtype
    got_nan, want_nan = torch.isnan(got.float()), torch.isnan(want.float())
    assert torch.equal(got_nan, want_nan), f"NaN at {got_nan.nonzero().tolist()}, expected {want_nan.nonzero().tolist()}"
    got_bits, want_bits = got.view(torch.uint8)[~got_nan], want.view(torch.uint8)[~want_nan]
    bad = (got_bits != want_bits).nonzero().reshape(-1)
    assert bad.numel() == 0, (
        f"{bad.numel()} codes differ, first: got {got.float()[~got_nan][bad[0]].item()}, "
        f"want {want.float()[~want_nan][bad[0]].item()}"
    )


def half_step(y64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half the spacing of the FP8 grid at each |y| (y already scaled into the format's range)."""
    exp = torch.floor(torch.log2(y64.abs().clamp(min=2.0 ** MIN_NORMAL_EXP[dtype])))
    return torch.pow(2.0, exp - MANTISSA[dtype] - 1)


def ref_tensorwise(x: torch.Tensor, dtype=E4M3, eps: float | None = None) -> torch.Tensor:
    """float64 dequantized operand with one scale ``fp8_max / max(amax, eps)`` for the tensor."""
    x64 = x.double()
    amax = x64.abs().max().item() if x64.numel() else 0.0
    scale = capped_scale(FMAX[dtype], max(amax, f32(eps)) if eps else amax)
    return saturated_cast(x64 * scale, dtype).double() / scale


def ref_slices(x: torch.Tensor, rows: int, cols: int, dtype=E4M3, power_of_2=True, eps: float = 0.0) -> torch.Tensor:
    """float64 dequantized operand with one scale per (rows, cols) tile of a 2-D ``x`` (ragged edges allowed):
    ``fp8_max / max(amax, eps)``, a power of two when asked, 1 where the amax is not finite or 0."""
    x64 = x.double()
    m, k = x64.shape
    out = torch.empty_like(x64)
    for r in range(0, m, rows):
        for c in range(0, k, cols):
            tile = x64[r:r + rows, c:c + cols]
            amax = tile.abs().max().item()
            amax = max(amax, f32(eps)) if eps and not math.isnan(amax) else amax
            if not math.isfinite(amax) or amax == 0:
                scale = 1.0
            else:
                scale = capped_scale(FMAX[dtype], amax)
                scale = power_of_2_below(scale) if power_of_2 else scale
            out[r:r + rows, c:c + cols] = saturated_cast(tile * scale, dtype).double() / scale
    return out


def mx_exponent(amax: float, dtype: torch.dtype, rounding: str) -> int:
    """The E8M0 exponent of an MX block with this finite amax, by definition (float64 search)."""
    if amax == 0:
        return -127
    if rounding == "floor":  # floor(log2(amax)) - emax
        exp = math.frexp(amax)[1] - 1 - EMAX[dtype]
    else:  # the smallest e with amax / 2**e <= fp8_max
        exp = -127
        while amax / 2.0**exp > FMAX[dtype]:
            exp += 1
    return max(-127, min(127, exp))


def ref_mx(x: torch.Tensor, block: int = 32, dtype=E4M3, rounding="rceil") -> torch.Tensor:
    """float64 dequantized MX operand (blocks along the last dimension), finite ``x``."""
    blocks = x.double().reshape(-1, x.shape[-1] // block, block)
    out = torch.empty_like(blocks)
    for index in range(blocks.shape[0]):
        for b in range(blocks.shape[1]):
            scale = 2.0 ** mx_exponent(blocks[index, b].abs().max().item(), dtype, rounding)
            out[index, b] = saturated_cast(blocks[index, b] / scale, dtype).double() * scale
    return out.reshape(x.shape)


# ------------------------------------------------------------------------------------------------------------
# Per-tensor casts and scales
# ------------------------------------------------------------------------------------------------------------

shapes = st.tuples(st.integers(0, 24), st.integers(0, 40))


@PROPERTY
@given(data=st.data(), shape=shapes, dtype=st.sampled_from(FP8_DTYPES),
       x_dtype=st.sampled_from([torch.float32, torch.bfloat16]), scale_exp=st.integers(-40, 40))
def test_quantize_with_scale_is_the_saturated_cast_of_the_exact_product(data, shape, dtype, x_dtype, scale_exp):
    x = data.draw(tensors(shape, dtype=x_dtype))
    mantissa = data.draw(st.floats(1.0, 2.0, exclude_max=True, width=32))
    scale = torch.tensor(mantissa * 2.0**scale_exp, dtype=torch.float32)
    got = quantize.quantize_with_scale(x, scale, dtype)
    assert_same_codes(got, saturated_cast(x.double() * scale.double(), dtype))


@PROPERTY
@given(amax=st.one_of(st.floats(0.0, FLOAT32_MAX, width=32), st.sampled_from(FINITE_SPECIALS[3:]).map(abs)),
       eps=st.sampled_from([1e-12, 1e-30, 2.0**-149, 1e-6, 0.25]), dtype=st.sampled_from(FP8_DTYPES),
       power_of_2=st.booleans())
def test_tensorwise_scale_is_max_over_amax_rounded_once(amax, eps, dtype, power_of_2):
    want = capped_scale(FMAX[dtype], max(amax, f32(eps)))
    if power_of_2:
        want = power_of_2_below(want)
    got = quantize.tensorwise_scale(torch.tensor(amax, dtype=torch.float32), dtype, eps, power_of_2)
    assert got.dtype == torch.float32 and got.item() == want, f"amax={amax!r} eps={eps}: {got.item()!r} != {want!r}"
    assert quantize.tensorwise_scale_value(amax, dtype, eps, power_of_2) == want


@pytest.mark.parametrize("amax", [INF, NAN], ids=["inf", "nan"])
def test_tensorwise_scale_of_a_nonfinite_amax(amax):
    """``fp8_max / inf`` is 0 and a NaN amax gives a NaN scale: the recipes keep their previous scale then."""
    got = quantize.tensorwise_scale(torch.tensor(amax), E4M3).item()
    assert got == 0.0 if amax == INF else math.isnan(got)


@PROPERTY
@given(data=st.data(), shape=shapes, dtype=st.sampled_from(FP8_DTYPES))
def test_quantize_tensorwise_uses_the_amax_scale_and_the_saturated_cast(data, shape, dtype):
    x = data.draw(tensors(shape))
    got_data, got_scale = fp8_lightning.quantize_tensorwise(x, dtype)
    x64 = x.double()
    amax = x64.abs().max().item() if x.numel() else 0.0
    finite_amax = math.isfinite(amax)  # inf or NaN: scale 1 (infinities saturate, NaN stays NaN)
    want_scale = capped_scale(FMAX[dtype], max(amax, f32(1e-12))) if finite_amax else 1.0
    assert got_scale.item() == want_scale, f"amax {amax!r}: scale {got_scale.item()!r}, want {want_scale!r}"
    assert_same_codes(got_data, saturated_cast(x64 * want_scale, dtype))
    if not finite_amax:  # at scale 1 values beyond the format's max saturate: no round-trip bound
        return
    finite = torch.isfinite(x64)
    back = fp8_lightning.dequantize_tensorwise(got_data, got_scale).double()
    bound = half_step(x64 * want_scale, dtype) / want_scale
    assert ((back - x64).abs()[finite] <= bound[finite] * (1 + 2.0**-20)).all(), "dequantize(quantize(x))"


# ------------------------------------------------------------------------------------------------------------
# MXFP8
# ------------------------------------------------------------------------------------------------------------


@PROPERTY
@given(data=st.data(), rows=st.integers(0, 6), n_blocks=st.integers(0, 4), dtype=st.sampled_from(FP8_DTYPES),
       rounding=st.sampled_from(["rceil", "floor"]), reference=st.booleans())
def test_mx_blocks_round_trip_within_half_a_step_with_power_of_two_scales(data, rows, n_blocks, dtype, rounding,
                                                                          reference):
    x = data.draw(tensors((rows, 32 * n_blocks), specials=[v for v in SPECIALS if not math.isinf(v)]))
    quantize_mxfp8 = mx.quantize_mxfp8 if reference else fp8_lightning.quantize_mxfp8
    got_data, got_scale = quantize_mxfp8(x, scale_rounding=rounding, fp8_format=dtype)
    assert got_scale.dtype == torch.float8_e8m0fnu and got_scale.shape == (rows, n_blocks)
    back = mx.dequantize_mxfp8(got_data, got_scale).double()
    blocks, back = x.double().reshape(rows, n_blocks, 32), back.reshape(rows, n_blocks, 32)
    codes = got_data.reshape(rows, n_blocks, 32)
    for r in range(rows):
        for b in range(n_blocks):
            block, byte = blocks[r, b], got_scale[r, b].view(torch.uint8).item()
            if torch.isnan(block).any():
                assert byte == 255 and torch.isnan(back[r, b]).all(), "a block with NaN is a NaN block"
                continue
            exp = mx_exponent(block.abs().max().item(), dtype, rounding)
            assert byte == exp + 127, f"block {r},{b}: scale 2**{byte - 127}, want 2**{exp} ({rounding})"
            scaled = block / 2.0**exp
            assert_same_codes(codes[r, b], saturated_cast(scaled, dtype))
            bound = half_step(scaled, dtype) * 2.0**exp
            if rounding == "floor":  # floor lets the top binade saturate
                bound = torch.maximum(bound, block.abs() - FMAX[dtype] * 2.0**exp)
            assert ((back[r, b] - block).abs() <= bound).all(), f"block {r},{b} off by more than half a step"


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("quantize_mxfp8", [mx.quantize_mxfp8, fp8_lightning.quantize_mxfp8],
                         ids=["reference", "backend"])
def test_an_mx_block_with_an_infinity_gets_scale_1(quantize_mxfp8, dtype, rounding):
    """The rule of every scale whose amax is not finite (TransformerEngine's for current scaling): scale 1, the
    infinities saturate to +-max and the block's finite values are cast at scale 1; the other blocks keep their
    own scales. (torchao gives such a block the largest scale, which flushes its finite values to zero.)"""
    x = torch.linspace(-100.0, 100.0, 64).reshape(1, 64)
    x[0, 1], x[0, 5] = INF, -INF
    data, scale = quantize_mxfp8(x, scale_rounding=rounding, fp8_format=dtype)
    assert scale.view(torch.uint8)[0, 0].item() == 127  # 2**0
    want = saturated_cast(x[0, :32].double(), dtype)
    assert_same_codes(data[0, :32], want)
    assert data[0, 1].float().item() == FMAX[dtype] and data[0, 5].float().item() == -FMAX[dtype]
    exp = mx_exponent(x[0, 32:].abs().max().item(), dtype, rounding)
    assert scale.view(torch.uint8)[0, 1].item() == exp + 127


# ------------------------------------------------------------------------------------------------------------
# Rowwise and blockwise casts
# ------------------------------------------------------------------------------------------------------------


@PROPERTY
@given(data=st.data(), m=st.integers(0, 12), k=st.integers(1, 40), dim=st.sampled_from([-1, 0]),
       dtype=st.sampled_from(FP8_DTYPES), power_of_2=st.booleans(), eps=st.sampled_from([1e-12, 1e-3]))
def test_rowwise_scale_per_slice_is_max_over_amax(data, m, k, dim, dtype, power_of_2, eps):
    shape = (m, k) if dim == -1 else (k, m)  # the reduced dimension is never empty
    x = data.draw(tensors(shape))
    got_data, got_scale = rowwise.quantize_rowwise(x, dtype, dim=dim, eps=eps, power_of_2=power_of_2)
    slices = x.double() if dim == -1 else x.double().t()
    for index, row in enumerate(slices):
        amax = row.abs().max().item()
        if not math.isfinite(amax):
            want = 1.0
        else:
            want = capped_scale(FMAX[dtype], max(amax, f32(eps)))
            want = power_of_2_below(want) if power_of_2 else want
        got = got_scale.reshape(-1)[index].item()
        assert got == want, f"slice {index} (amax {amax!r}): scale {got!r}, want {want!r}"
    want_data = saturated_cast(x.double() * got_scale.double(), dtype)  # the scale was checked above
    assert_same_codes(got_data, want_data)


@pytest.mark.parametrize("shape, dim", [((16, 0), -1), ((0, 16), 0)])
def test_rowwise_cast_of_an_empty_slice_says_what_is_needed(shape, dim):
    with pytest.raises(ValueError, match=rf"non-empty dimension {dim}; got shape \({shape[0]}, {shape[1]}\)"):
        rowwise.quantize_rowwise(torch.zeros(shape), E4M3, dim=dim)


@PROPERTY
@given(data=st.data(), m=st.integers(1, 140), k=st.integers(1, 140),
       tile=st.sampled_from([blockwise.ROW_TILE, blockwise.COLUMN_TILE, blockwise.WEIGHT_BLOCK]),
       dtype=st.sampled_from(FP8_DTYPES), power_of_2=st.booleans())
def test_blockwise_scale_per_tile_is_max_over_amax(data, m, k, tile, dtype, power_of_2):
    x = data.draw(tensors((m, k)))
    got_data, got_scale = blockwise.quantize_blockwise(x, tile, dtype, power_of_2)
    rows, cols = tile
    assert got_scale.shape == (-(-m // rows), -(-k // cols)) and got_data.shape == (m, k)
    x64 = x.double()
    for i in range(got_scale.shape[0]):
        for j in range(got_scale.shape[1]):
            amax = x64[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols].abs().max().item()
            if not math.isfinite(amax) or amax == 0:
                want = 1.0
            else:
                want = capped_scale(FMAX[dtype], amax)
                want = power_of_2_below(want) if power_of_2 else want
            assert got_scale[i, j].item() == want, f"tile {i},{j} (amax {amax!r}): {got_scale[i, j].item()!r}"
    spread = blockwise.per_element(got_scale.double(), x.shape)
    assert_same_codes(got_data, saturated_cast(x64 * spread, dtype))


def test_blockwise_cast_of_an_empty_tensor_says_what_is_needed():
    with pytest.raises(ValueError, match=r"non-empty 2-D tensor; got shape \(0, 128\)"):
        blockwise.quantize_blockwise(torch.zeros(0, 128), blockwise.ROW_TILE, E4M3)


# ------------------------------------------------------------------------------------------------------------
# The layer
# ------------------------------------------------------------------------------------------------------------


def reference_operands(recipe, x2d: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward GEMM's operands as each recipe casts them, dequantized in float64 (E4M3 forward)."""
    if isinstance(recipe, MXFP8BlockScaling):
        return ref_mx(x2d), ref_mx(weight)
    if isinstance(recipe, RowwiseScaling):
        return ref_slices(x2d, 1, x2d.shape[1], eps=recipe.eps), ref_slices(weight, 1, weight.shape[1], eps=recipe.eps)
    if isinstance(recipe, BlockwiseScaling):
        return ref_slices(x2d, 1, 128), ref_slices(weight, 128, 128)
    eps = recipe.eps if isinstance(recipe, TensorwiseScaling) else None  # delayed: the first use scales just in time
    return ref_tensorwise(x2d, eps=eps), ref_tensorwise(weight, eps=eps)


def fresh_layer(recipe, k: int, n: int, seed: int) -> FP8Linear:
    torch.manual_seed(seed)
    return FP8Linear.from_linear(nn.Linear(k, n), recipe)


def multiple_of(recipe) -> int:
    return 32 if isinstance(recipe, MXFP8BlockScaling) else 16


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@settings(max_examples=25, deadline=None, database=None)
@given(data=st.data(), lead=st.sampled_from([(), (2,), (1, 3)]), m=st.integers(0, 24), k_units=st.integers(1, 5),
       n_units=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_layer_forward_is_the_float64_product_of_the_dequantized_operands(recipe, data, lead, m, k_units, n_units,
                                                                          seed):
    k, n = k_units * multiple_of(recipe), n_units * multiple_of(recipe)
    layer = fresh_layer(recipe, k, n, seed)
    x = data.draw(tensors((*lead, m, k), specials=[0.0, -0.0, 2.0**-126], max_exp=8))
    with fp8_autocast():
        y = layer(x)
    assert y.shape == (*lead, m, n) and y.dtype == x.dtype
    xq, wq = reference_operands(recipe, x.reshape(-1, k), layer.weight.detach())
    bias = layer.bias.detach().double()
    want = xq @ wq.T + bias
    # float32: each product exact, K sums and the bias each round once (plus the dequantization's own rounding)
    bound = (k + 3) * 2.0**-24 * (xq.abs() @ wq.abs().T + bias.abs()) + 2.0**-149
    error = (y.reshape(-1, n).double() - want).abs()
    assert (error <= bound).all(), f"off by {(error - bound).max().item():.3g} beyond float32 rounding"


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@settings(max_examples=15, deadline=None, database=None)
@given(data=st.data(), m=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_layer_nan_input_gives_nan_rows_and_leaves_other_rows_finite(recipe, data, m, seed):
    k, n = 2 * multiple_of(recipe), multiple_of(recipe)
    layer = fresh_layer(recipe, k, n, seed)
    x = data.draw(tensors((m, k), specials=[], max_exp=6))
    bad = data.draw(st.lists(st.tuples(st.integers(0, m - 1), st.integers(0, k - 1)), min_size=1, max_size=3))
    for r, c in bad:
        x[r, c] = NAN
    x.requires_grad_()
    with fp8_autocast():
        y = layer(x)
    y.sum().backward()  # no crash in backward either
    nan_rows = torch.isnan(x.detach()).any(dim=1)
    assert torch.isnan(y[nan_rows]).all(), "a row with NaN input gives an all-NaN output row"
    assert torch.isfinite(y[~nan_rows]).all(), "rows without NaN stay finite"
    assert x.grad.shape == x.shape and layer.weight.grad.shape == layer.weight.shape


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@settings(max_examples=10, deadline=None, database=None)
@given(lead=st.sampled_from([(0,), (2, 0), (0, 3)]), k_units=st.integers(1, 3), n_units=st.integers(1, 3),
       grad_mode=st.booleans())
def test_layer_empty_input_gives_empty_output_and_zero_gradients(recipe, lead, k_units, n_units, grad_mode):
    k, n = k_units * multiple_of(recipe), n_units * multiple_of(recipe)
    layer = fresh_layer(recipe, k, n, 0)
    x = torch.randn(*lead, k, requires_grad=grad_mode)
    with fp8_autocast(), torch.set_grad_enabled(grad_mode):
        y = layer(x)
    assert y.shape == (*lead, n)
    if grad_mode:
        y.sum().backward()
        assert x.grad.shape == x.shape
        assert torch.equal(layer.weight.grad, torch.zeros_like(layer.weight))
        assert torch.equal(layer.bias.grad, torch.zeros_like(layer.bias))


@pytest.mark.parametrize("shape", [(0, 0), (3, 0), (2, 4, 0)])
def test_mx_round_trip_of_an_empty_last_dimension(shape):
    """K = 0 has no blocks: the scales are (..., 0) and dequantizing gives the empty tensor back."""
    for quantize_mxfp8 in (mx.quantize_mxfp8, fp8_lightning.quantize_mxfp8):
        data, scale = quantize_mxfp8(torch.zeros(shape))
        assert scale.shape == (*shape[:-1], 0)
        for dequantize in (mx.dequantize_mxfp8, fp8_lightning.dequantize_mxfp8):
            assert dequantize(data, scale).shape == shape
