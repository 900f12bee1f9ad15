"""The NVFP4 cast kernel against the pure-torch reference, bit for bit, in Triton's interpreter.

The reference is ``nvfp4._quantize_reference`` (held to torchao in ``tests/core/test_nvfp4_torchao.py``) of
``nvfp4.rht_blocks`` of the padded input for the RHT, with ``nvfp4._uniform_reference`` numbers for stochastic
rounding; ``rht_blocks`` itself is held to the float64 product with the Hadamard matrix. Cases: ragged shapes, zero
rows, NaN, infinities, float32 subnormals, bfloat16 input, transposed views, given global scales, 1x16 blocks and
16x16 tiles, both roundings, RHT on and off. The recipe's layer step on the kernels equals the step on the reference.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from fp8_lightning import fp8_autocast, nvfp4
from fp8_lightning.ops import dispatch, triton_ops
from fp8_lightning.recipes import NVFP4BlockScaling
from tests.environment import set_env

SHAPES = [(1, 1), (5, 20), (16, 64), (33, 70), (40, 130)]


@pytest.fixture(autouse=True)
def _reference_without_codec(monkeypatch):
    set_env(monkeypatch, FP8_LIGHTNING_DISABLE_CPU_CODEC="1")


def hard_input(rows: int, cols: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Rows of magnitudes 2**-20 .. 2**20, a zero row, and (in float32) NaN, +-inf, a subnormal and -0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-20, 20, (rows, 1), generator=g).float())
    if rows > 2:
        x[1] = 0.0
    if rows > 4 and cols > 8:
        x[2, 3], x[3, cols - 1], x[4, 0] = float("nan"), float("inf"), float("-inf")
        x[0, 5], x[0, 6] = 1e-40, -0.0
    return x.to(dtype)


def reference(x, global_scale, tile_rows, rht, key) -> nvfp4.NVFP4Tensor:
    signs = nvfp4.rht_signs(11) if rht else None
    if rht:
        x = nvfp4.rht_blocks(nvfp4._pad_to(x.float(), 1, 16), signs)
    uniform = None
    if key is not None:
        padded = (-(-x.shape[0] // tile_rows) * tile_rows, -(-x.shape[1] // 16) * 16)
        uniform = nvfp4._uniform_reference(padded, key)
    return nvfp4._quantize_reference(x, global_scale, tile_rows, uniform)


def assert_kernel_is_reference(x, global_scale=None, tile_rows=1, rht=False, key=None) -> None:
    expected = reference(x, global_scale, tile_rows, rht, key)
    signs = nvfp4.rht_signs(11) if rht else None
    codes, scales, g = triton_ops.triton_nvfp4_cast(x, global_scale, tile_rows, signs, key)
    assert codes.dtype == torch.uint8 and codes.shape == expected.codes.shape
    assert scales.dtype == torch.float8_e4m3fn and scales.shape == expected.block_scales.shape
    mismatch = int((codes != expected.codes).sum())
    assert mismatch == 0, f"{mismatch} of {codes.numel()} code bytes differ"
    assert torch.equal(scales.view(torch.uint8), expected.block_scales.view(torch.uint8))
    assert torch.equal(g.view(torch.int32), expected.global_scale.view(torch.int32))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tile_rows", [1, 16])
@pytest.mark.parametrize("rht, stochastic", list(itertools.product([False, True], repeat=2)))
def test_cast_is_the_reference_bit_for_bit(shape, tile_rows, rht, stochastic):
    x = hard_input(*shape, seed=shape[0] * 7 + shape[1])
    assert_kernel_is_reference(x, None, tile_rows, rht, 0x1234ABCD if stochastic else None)


@pytest.mark.parametrize("tile_rows, rht, stochastic", [(1, False, True), (16, False, False), (1, True, True)])
def test_bf16_fp16_input_and_transposed_views(tile_rows, rht, stochastic):
    x = hard_input(37, 90, seed=3)
    x[0, 5] = 1.0  # the interpreter flushes bf16 subnormals as it loads them (conftest); the GPU check covers them
    key = 99 if stochastic else None
    assert_kernel_is_reference(x.to(torch.bfloat16), None, tile_rows, rht, key)
    assert_kernel_is_reference((x * 2.0**-12).to(torch.float16), None, tile_rows, rht, key)  # overflow to inf too
    assert_kernel_is_reference(x.t(), None, tile_rows, rht, key)  # strides (1, 90): read as it lies


@pytest.mark.parametrize("scale", [1e-3, 0.37, 5.0])
@pytest.mark.parametrize("tile_rows, stochastic", [(1, False), (16, True)])
def test_given_global_scales(scale, tile_rows, stochastic):
    x = hard_input(24, 48, seed=5)
    assert_kernel_is_reference(x, torch.tensor(scale), tile_rows, False, 7 if stochastic else None)


def test_all_zero_and_all_nan_inputs():
    assert_kernel_is_reference(torch.zeros(16, 32), tile_rows=16)
    assert_kernel_is_reference(torch.full((3, 16), float("nan")))


def test_stochastic_rounding_is_unbiased_and_keyed():
    """Rounding up with probability by distance: 0.3 with a global scale of 1 has the block scale 0.05078125 (E4M3
    of 0.3 / 6) and lies between the codes 4 and 6 after scaling; the mean of its 16384 casts is 0.3 (4 standard
    deviations: 0.2%), an independent check of the hash's uniform numbers. Another key gives other codes."""
    x = torch.full((64, 256), 0.3)
    one = torch.tensor(1.0)
    q1 = nvfp4.NVFP4Tensor(*triton_ops.triton_nvfp4_cast(x, one, 1, None, 1), (64, 256))
    q2 = nvfp4.NVFP4Tensor(*triton_ops.triton_nvfp4_cast(x, one, 1, None, 2), (64, 256))
    assert torch.equal(q1.block_scales.float(), torch.full((64, 16), 0.05078125))
    values = nvfp4.dequantize_nvfp4(q1).double()
    assert set(values.unique().tolist()) == {4 * 0.05078125, 6 * 0.05078125}
    assert abs(values.mean().item() - 0.3) < 0.3 * 0.002
    assert not torch.equal(q1.codes, q2.codes)


def test_rht_blocks_is_the_hadamard_product():
    """The fixed-order butterfly equals ``x @ (diag(signs) H16 / 4)`` (float64, independent) to float32 rounding."""
    x = torch.randn(8, 48, dtype=torch.float64)
    signs = nvfp4.rht_signs(5)
    exact = nvfp4.apply_rht(x, nvfp4.rht_matrix(signs, torch.float64))
    torch.testing.assert_close(nvfp4.rht_blocks(x.float(), signs).double(), exact, rtol=1e-6, atol=1e-6)


def test_fake_describes_the_outputs():
    x = hard_input(21, 50, seed=1)
    for tile_rows in (1, 16):
        real = triton_ops._nvfp4_cast.impl(x, None, tile_rows, None, None)
        fake = triton_ops._nvfp4_cast_fake(x, None, tile_rows, None, None)
        assert [(t.shape, t.dtype) for t in real] == [(t.shape, t.dtype) for t in fake]


def test_bad_requests_are_refused_with_the_allowed_values():
    with pytest.raises(ValueError, match="tile_rows=8 is invalid; allowed: 1"):
        triton_ops.triton_nvfp4_cast(torch.randn(4, 16), tile_rows=8)
    with pytest.raises(ValueError, match="needs a 2-D tensor"):
        triton_ops.triton_nvfp4_cast(torch.randn(16))
    with pytest.raises(ValueError, match="needs 16 RHT signs"):
        triton_ops.triton_nvfp4_cast(torch.randn(4, 16), rht_signs=torch.ones(8))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        triton_ops.triton_nvfp4_cast(torch.randn(4, 16, dtype=torch.float64))


def _training_step(recipe):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48)
    from fp8_lightning import convert_to_fp8

    convert_to_fp8(layer, recipe)
    x = torch.randn(20, 64, requires_grad=True)
    with fp8_autocast():
        layer(x).backward(torch.randn(20, 48))
    return layer.weight.grad.clone(), x.grad.clone()


@pytest.mark.parametrize("recipe", [NVFP4BlockScaling(), NVFP4BlockScaling(disable_rht=True, fp4_2d_weights=False)])
def test_layer_step_on_the_kernel_equals_the_reference(monkeypatch, recipe):
    calls = []
    original = triton_ops.triton_nvfp4_cast

    def recorded(x, global_scale, tile_rows, rht_signs, sr_key):
        calls.append((tile_rows, rht_signs is not None, sr_key is not None))
        return original(x, global_scale, tile_rows, rht_signs, sr_key)

    monkeypatch.setattr(triton_ops, "triton_nvfp4_cast", recorded)
    monkeypatch.setattr(dispatch, "cuda_kernels", lambda x: triton_ops if triton_ops.supports_input(x) else None)
    dw, dx = _training_step(recipe)
    assert calls and any(c[2] for c in calls) and any(c[1] for c in calls) != recipe.disable_rht
    with monkeypatch.context() as pure:
        pure.setattr(dispatch, "cuda_kernels", lambda x: None)
        ref_dw, ref_dx = _training_step(recipe)
    assert torch.equal(dw, ref_dw) and torch.equal(dx, ref_dx)
