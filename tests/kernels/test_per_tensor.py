"""Per-tensor cast kernels (amax, tensorwise, delayed with amax, cast+transpose) against the pure-torch twins.

Run in Triton's interpreter on CPU. The kernels round to the FP8 grid in float32 before converting when
interpreted (the interpreter's own float8 conversion is not round-to-nearest-even), so every comparison is bit
for bit, ties and subnormals included; ``tie_cases`` checks the rounding against codes, not against a cast.
"""

from __future__ import annotations

import pytest
import torch

from fp8_lightning.ops import triton_ops
from fp8_lightning.quantize import amax, current_scale, quantize_tensorwise, quantize_with_scale, tensorwise_scale
from tests.kernels.references import assert_same_fp8, tie_cases

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def wide_range(shape, seed=0) -> torch.Tensor:
    """Normal values spread over 2**-40 .. 2**20: after scaling they land in every FP8 binade and below."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.exp2(torch.randint(-40, 20, shape, generator=g).float())


# --------------------------------------------------------------------------------------------------------
# amax
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_amax_matches_torch_across_blocks(dtype):
    x = (wide_range((3, 5000)) * 1e-3).to(dtype)  # several programs, ragged last block
    x[1, 4321] = -6144.0
    assert triton_ops.triton_amax(x).item() == x.float().abs().max().item() == 6144.0


def test_amax_nan_inf_and_empty():
    x = torch.randn(9000)
    x[8999] = float("inf")
    assert triton_ops.triton_amax(x).item() == float("inf")
    x[17] = float("nan")
    assert torch.isnan(triton_ops.triton_amax(x))
    assert triton_ops.triton_amax(-torch.zeros(10)).item() == 0.0
    assert triton_ops.triton_amax(torch.empty(0, 4)).item() == 0.0


# --------------------------------------------------------------------------------------------------------
# Delayed scaling: cast with a given scale, amax in the same pass
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cast_is_bit_exact_and_records_amax(fp8, dtype):
    x = wide_range((37, 301)).to(dtype)
    x[5, 7] = -1e9
    scale = torch.tensor(2.0**-14 * 3)  # not a power of two: x * scale rounds in float32 first
    data, x_amax = triton_ops.triton_cast(x, scale, fp8)
    assert_same_fp8(data, quantize_with_scale(x, scale, fp8))
    assert x_amax.item() == amax(x).item()
    # Saturation: scaled values far beyond fp8_max clamp to +-max, not inf/NaN.
    assert data.float().abs().max().item() == torch.finfo(fp8).max


@pytest.mark.parametrize("fp8", FP8)
def test_cast_rounds_ties_to_even_and_keeps_signed_zero_and_nan(fp8):
    x, expected = tie_cases(fp8)
    data, _ = triton_ops.triton_cast(x, torch.tensor(1.0), fp8, record_amax=False)
    assert_same_fp8(data, expected)
    special = torch.tensor([-0.0, -1e-30, 1e-30, float("nan"), float("inf"), -float("inf"), 1e6])
    data, x_amax = triton_ops.triton_cast(special, torch.tensor(1.0), fp8)
    assert_same_fp8(data, quantize_with_scale(special, torch.tensor(1.0), fp8))
    assert data.view(torch.uint8)[0].item() == 0x80 and data.view(torch.uint8)[1].item() == 0x80  # -0.0
    assert torch.isnan(x_amax)


def test_cast_without_amax_reports_zero():
    _, x_amax = triton_ops.triton_cast(torch.randn(100), torch.tensor(1.0), record_amax=False)
    assert x_amax.item() == 0.0


@pytest.mark.parametrize("fp8", FP8)
def test_cast_transpose_gives_both_layouts_from_one_pass(fp8):
    x = wide_range((70, 45), seed=1)  # not multiples of the 64x64 tile
    scale = torch.tensor(0.37)
    data, data_t, x_amax = triton_ops.triton_cast_transpose(x, scale, fp8)
    reference = quantize_with_scale(x, scale, fp8)
    assert_same_fp8(data, reference)
    assert_same_fp8(data_t, reference.t().contiguous())
    assert x_amax.item() == amax(x).item()


def test_cast_transpose_reads_strided_input():
    base = torch.randn(50, 130)
    x = base[:, ::2]  # non-contiguous columns
    data, data_t, _ = triton_ops.triton_cast_transpose(x, torch.tensor(4.0))
    reference = quantize_with_scale(x, torch.tensor(4.0), torch.float8_e4m3fn)
    assert_same_fp8(data, reference)
    assert_same_fp8(data_t, reference.t().contiguous())


# --------------------------------------------------------------------------------------------------------
# Tensorwise (current) scaling
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tensorwise_cast_matches_quantize_tensorwise(fp8, dtype):
    x = (torch.randn(20, 517) * 3e-3).to(dtype)
    data, scale = triton_ops.triton_tensorwise_cast(x, fp8)
    ref_data, ref_scale = quantize_tensorwise(x, fp8)
    assert scale.dtype == torch.float32 and scale.item() == ref_scale.item()
    assert_same_fp8(data, ref_data)
    # The amax element lands exactly on fp8_max.
    assert data.float().abs().max().item() == torch.finfo(fp8).max


@pytest.mark.parametrize(
    "values, eps, power_of_2",
    [
        ([0.0, -0.0, 0.0], 1e-12, False),  # all zero: scale from eps
        ([3.0, -5.0, 1e-3], 1e-12, True),  # power-of-two scale
        ([1e-30, 2e-30], 0.0, False),  # scale beyond float32 max is capped
        ([1.0, float("nan")], 1e-12, False),  # NaN amax: scale 1, NaN stays NaN
        ([1.0, float("nan")], 1e-12, True),  # ... also with power-of-two scales
        ([1.0, float("inf"), -500.0], 1e-12, False),  # inf amax: scale 1, inf and -500 saturate
    ],
)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf * 0 in the interpreter
def test_tensorwise_scale_edge_cases_follow_the_twin(values, eps, power_of_2):
    x = torch.tensor(values)
    data, scale = triton_ops.triton_tensorwise_cast(x, torch.float8_e4m3fn, eps=eps, power_of_2=power_of_2)
    expected_scale = current_scale(amax(x), torch.float8_e4m3fn, eps, power_of_2)
    assert torch.equal(scale, expected_scale)
    assert_same_fp8(data, quantize_with_scale(x, expected_scale, torch.float8_e4m3fn))


def test_tensorwise_cast_of_empty_tensor():
    data, scale = triton_ops.triton_tensorwise_cast(torch.empty(0, 3))
    assert data.shape == (0, 3) and scale.item() == tensorwise_scale(torch.tensor(0.0), torch.float8_e4m3fn).item()


def test_inputs_the_kernels_do_not_take_raise_clear_errors():
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        triton_ops.triton_amax(torch.randn(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="one-element scale"):
        triton_ops.triton_cast(torch.randn(4), torch.ones(2))
    with pytest.raises(ValueError, match="2-D"):
        triton_ops.triton_cast_transpose(torch.randn(2, 3, 4), torch.tensor(1.0))
