"""MXFP8 quantization kernel against ``quantize_mxfp8`` (the twin) and the exponent rules from their definitions.

Bit for bit, in Triton's interpreter on CPU. Rowwise and columnwise copies come from the same read; the
columnwise copy must equal the twin applied to the zero-padded transpose, which is what FP8Linear's wgrad uses.
"""

from __future__ import annotations

import pytest
import torch

from fp8_lightning.ops import triton_ops
from fp8_lightning.gemm import pad_dim
from fp8_lightning.mx import quantize_mxfp8
from tests.kernels.references import assert_same_fp8, mx_exponent_reference

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
RULES = ("rceil", "floor")


def blockwise_data(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Each 32-wide stretch has its own magnitude (2**-60 .. 2**40), so block scales vary over a wide range."""
    g = torch.Generator().manual_seed(seed)
    magnitude = torch.exp2(torch.randint(-60, 40, (rows, -(-cols // 32)), generator=g).float())
    return torch.randn(rows, cols, generator=g) * magnitude.repeat_interleave(32, dim=1)[:, :cols]


def assert_same_mx(actual, data: torch.Tensor, scale: torch.Tensor) -> None:
    assert_same_fp8(actual.data, data)
    assert actual.scale.dtype == torch.float8_e8m0fnu
    assert torch.equal(actual.scale.view(torch.uint8), scale.view(torch.uint8))


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("rule", RULES)
def test_rowwise_and_columnwise_match_the_twin(fp8, rule):
    x = blockwise_data(96, 160)  # 96 rows: columnwise needs no padding; 160 = 5 blocks per row
    rows, cols = triton_ops.triton_mx_quantize(x, 32, rule, fp8, rowwise=True, columnwise=True)
    assert_same_mx(rows, *quantize_mxfp8(x, scale_rounding=rule, fp8_format=fp8))
    assert_same_mx(cols, *quantize_mxfp8(x.t().contiguous(), scale_rounding=rule, fp8_format=fp8))


@pytest.mark.parametrize("block_size", [16, 64, 128])  # 128: one launch per direction (mxfp8.launches)
def test_other_block_sizes(block_size):
    x = blockwise_data(256, 384, seed=1).bfloat16()
    rows, cols = triton_ops.triton_mx_quantize(x, block_size, "rceil", torch.float8_e4m3fn, columnwise=True)
    assert_same_mx(rows, *quantize_mxfp8(x, block_size=block_size))
    assert_same_mx(cols, *quantize_mxfp8(x.t().contiguous(), block_size=block_size))


def test_ragged_rows_are_zero_padded_in_the_columnwise_copy():
    x = blockwise_data(70, 64, seed=2)  # 70 rows -> 96 after padding to whole blocks
    rows, cols = triton_ops.triton_mx_quantize(x, 32, "floor", torch.float8_e5m2, columnwise=True)
    assert cols.data.shape == (64, 96) and cols.scale.shape == (64, 3)
    padded = pad_dim(x.t(), -1, 32)
    assert_same_mx(cols, *quantize_mxfp8(padded, scale_rounding="floor", fp8_format=torch.float8_e5m2))
    assert_same_mx(rows, *quantize_mxfp8(x, scale_rounding="floor", fp8_format=torch.float8_e5m2))


def test_transposed_view_is_read_in_place():
    base = blockwise_data(64, 96, seed=3)
    view = base.t()  # (96, 64), strides (1, 96): quantize along base's rows without a copy
    rows, _ = triton_ops.triton_mx_quantize(view, 32, "rceil", torch.float8_e4m3fn)
    assert_same_mx(rows, *quantize_mxfp8(view.contiguous()))


def test_only_requested_copies_are_made():
    x = blockwise_data(32, 64)
    rows, cols = triton_ops.triton_mx_quantize(x, columnwise=False)
    assert cols is None and rows.data.shape == (32, 64)
    rows, cols = triton_ops.triton_mx_quantize(x, rowwise=False, columnwise=True)
    assert rows is None and cols.data.shape == (64, 32)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("rule", RULES)
def test_special_blocks(fp8, rule):
    fmax = torch.finfo(fp8).max
    x = torch.ones(12, 32)
    x[0] = 0.0  # all zero: scale 2**-127
    x[1, 3] = float("nan")  # NaN block: E8M0 NaN byte
    x[2, 5] = float("inf")  # inf: the twin's frexp(inf) rule
    x[3] = 1e-40  # float32 subnormal amax
    x[4, 0] = fmax  # amax exactly fp8_max: rceil keeps scale 1
    x[5, 0] = torch.nextafter(torch.tensor(fmax), torch.tensor(1e9)).item()  # just above: rceil steps up
    x[6, 0] = 3.0e38  # near float32 max
    x[7] = -2.0**-126  # smallest normal float32, negative
    x[8, :16] = 2.0**100  # binade edge
    x[9] = torch.linspace(-1e-3, 1e-3, 32)  # values that become FP8 subnormals after scaling
    x[10, 0] = 1.75 * 2.0**20  # mantissa exactly 1.75
    x[11, 0] = -0.0
    rows, _ = triton_ops.triton_mx_quantize(x, 32, rule, fp8)
    data, scale = quantize_mxfp8(x, scale_rounding=rule, fp8_format=fp8)
    assert_same_mx(rows, data, scale)
    assert rows.scale.view(torch.uint8)[1, 0].item() == 255


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("rule", RULES)
def test_shared_exponent_follows_the_definitions(fp8, rule):
    """The scale bytes against the OCP floor rule / rceil's smallest-power-of-two rule in float64."""
    g = torch.Generator().manual_seed(4)
    amaxes = torch.exp2(torch.empty(256).uniform_(-140, 127, generator=g))
    amaxes[:8] = torch.tensor([448.0, 449.0, 57344.0, 57345.0, 2.0**-130, 1.0, 1.75, 1.7500001])
    x = torch.zeros(256, 32)
    x[:, 7] = amaxes
    rows, _ = triton_ops.triton_mx_quantize(x, 32, rule, fp8)
    got = rows.scale.view(torch.uint8).flatten().long() - 127
    expected = torch.tensor([mx_exponent_reference(a, fp8, rule) for a in amaxes.tolist()])
    assert torch.equal(got, expected)


def test_invalid_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="block_size=48 is not supported"):
        triton_ops.triton_mx_quantize(torch.randn(4, 96), block_size=48)
    with pytest.raises(ValueError, match="rceil or floor"):
        triton_ops.triton_mx_quantize(torch.randn(4, 32), scale_rounding="nearest")
    with pytest.raises(ValueError, match="2-D"):
        triton_ops.triton_mx_quantize(torch.randn(2, 4, 32))
