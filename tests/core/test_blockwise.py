"""BlockwiseScaling against a float64 reference of the 1x128 / 128x128 rule, written here from its definition (tile
amax, the exact quotient fp8_max / amax rounded once to float32, power-of-two rounding by frexp), on ragged shapes,
all-zero tiles and NaN/inf; the layer's gradients against float64 products; cuBLAS's layouts on fake CUDA tensors."""

from __future__ import annotations

import copy
import math
from fractions import Fraction

import pytest
import torch

from fp8_lightning import FP8Linear, fp8_autocast
from fp8_lightning.blockwise import (
    COLUMN_TILE,
    ROW_TILE,
    WEIGHT_BLOCK,
    blockwise_gemm_support,
    blockwise_mm,
    blockwise_scaled_mm_args,
    dequantize_blockwise,
    quantize_blockwise,
)
from fp8_lightning import blockwise, cuda_rules, fine_grained, gemm
from fp8_lightning.cuda_rules import Layout
from fp8_lightning.quantize import Quantized
from fp8_lightning.recipes import BlockwiseScaling
from tests.core.fake_cuda import fake_cuda, fake_operand
from tests.core.fp8_reference import nearest_float32, round_saturate
from tests.environment import set_env

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MAX = {E4M3: 448.0, E5M2: 57344.0}
U = 2.0**-24


def reference_scales(x: torch.Tensor, tile: tuple[int, int], dtype, power_of_2: bool) -> torch.Tensor:
    """One float64 scale per tile, tile by tile in Python: 1 for an all-zero or non-finite tile."""
    rows, cols = tile
    m, k = x.shape
    out = torch.empty(-(-m // rows), -(-k // cols), dtype=torch.float64)
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            amax = x[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols].double().abs().max().item()
            if not math.isfinite(amax) or amax == 0:
                out[i, j] = 1.0
                continue
            scale = min(nearest_float32(Fraction(MAX[dtype]) / Fraction(amax)), torch.finfo(torch.float32).max)
            out[i, j] = 2.0 ** (math.frexp(scale)[1] - 1) if power_of_2 else scale
    return out


def expand(scale: torch.Tensor, tile: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    return scale.repeat_interleave(tile[0], 0)[: shape[0]].repeat_interleave(tile[1], 1)[:, : shape[1]]


def reference_codes(x: torch.Tensor, scale: torch.Tensor, tile, dtype) -> torch.Tensor:
    """``saturate(float32(x * scale))`` per element: the product exact in float64, rounded once to float32, then
    saturated and rounded to the FP8 format."""
    scaled = (x.double() * expand(scale, tile, x.shape)).float()
    return scaled.clamp(-MAX[dtype], MAX[dtype]).to(dtype)


def _tensors() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    ragged = torch.randn(136, 264, generator=gen) * torch.logspace(-8, 8, 264)  # spans binades along K
    ragged[:128, :128] = 0.0  # an all-zero 128x128 block (and zero 1x128 tiles)
    special = torch.randn(130, 260, generator=gen) * 7
    special[3, 5], special[129, 200], special[20, 250] = float("inf"), float("nan"), float("-inf")
    return [ragged, special, special.bfloat16(), torch.randn(1, 17, generator=gen)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("tile", [ROW_TILE, COLUMN_TILE, WEIGHT_BLOCK], ids=["1x128", "128x1", "128x128"])
@pytest.mark.parametrize("dtype, power_of_2", [(E4M3, False), (E5M2, True)], ids=["e4m3-float32", "e5m2-pow2"])
def test_tile_casts_equal_the_float64_reference(tile, dtype, power_of_2):
    for x in _tensors():
        data, scale = quantize_blockwise(x, tile, dtype, power_of_2)
        want_scale = reference_scales(x, tile, dtype, power_of_2)
        assert scale.dtype == torch.float32 and torch.equal(scale.double(), want_scale)
        assert data.shape == x.shape and torch.equal(_bits(data), _bits(reference_codes(x, want_scale, tile, dtype)))
        nan = torch.isnan(x)
        assert torch.isnan(data.float()[nan]).all() and not torch.isnan(data.float()[~nan]).any()
        # the element rounding itself, against the format's definition on a sample
        flat_x, flat_d = x.double().flatten(), data.float().flatten()
        factors = expand(want_scale, tile, x.shape).flatten()
        for i in range(0, flat_x.numel(), max(1, flat_x.numel() // 50)):
            want = round_saturate(float(torch.tensor(flat_x[i].item() * factors[i].item()).float()), dtype)
            assert flat_d[i].item() == want or (math.isnan(want) and math.isnan(flat_d[i].item()))


def test_dequantize_repeats_each_float32_factor_over_its_tile():
    x = _tensors()[0]
    for tile in (ROW_TILE, COLUMN_TILE, WEIGHT_BLOCK):
        data, scale = quantize_blockwise(x, tile, E4M3, power_of_2=False)
        factors = expand(scale.reciprocal().double(), tile, x.shape)  # 1 / scale rounded to float32
        assert torch.equal(dequantize_blockwise(data, scale), (data.double() * factors).float())  # one rounding
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_blockwise(data, scale[:, :1])


def test_bad_tiles_and_shapes_are_refused():
    with pytest.raises(ValueError, match=r"tile=\(64, 64\) is invalid"):
        quantize_blockwise(torch.randn(4, 4), (64, 64), E4M3)
    with pytest.raises(ValueError, match="non-empty 2-D"):
        quantize_blockwise(torch.randn(4), ROW_TILE, E4M3)


def _within_float32_sum_bound(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``got`` is a float32 ``a @ b.T`` of exactly representable operands: within (K + 1) u of the float64 sum of
    |products|."""
    a, b = a.double(), b.double()
    exact, magnitude = a @ b.t(), a.abs() @ b.abs().t()
    err = (got.double() - exact).abs()
    assert (err <= (a.shape[1] + 1) * U * magnitude).all(), (err / magnitude.clamp(min=1e-300)).max().item()


def _dequantized(t: torch.Tensor, tile, dtype, power_of_2: bool) -> torch.Tensor:
    """The reference cast of ``t``, dequantized in float64 with the float32 factors 1 / scale."""
    scale = reference_scales(t, tile, dtype, power_of_2)
    inverse = scale.float().reciprocal().double()
    return reference_codes(t, scale, tile, dtype).double() * expand(inverse, tile, t.shape)


@pytest.mark.parametrize("fmt, power_of_2", [("E4M3", True), ("HYBRID", False)])
def test_layer_gradients_are_float64_products_of_the_tiled_operands(fmt, power_of_2):
    """Ragged sizes (K = 160, N = 144, M = 200 tokens): y from x in 1x128 tiles along K and W in 128x128 blocks; dx
    from g in 1x128 tiles along N and the same W blocks transposed; dW from g and x in 1x128 tiles along M."""
    torch.manual_seed(2)
    base = torch.nn.Linear(160, 144, bias=False)
    ours = FP8Linear.from_linear(copy.deepcopy(base), BlockwiseScaling(fp8_format=fmt, power_of_2_scales=power_of_2))
    x = (torch.randn(200, 160) * torch.logspace(-2, 2, 160)).requires_grad_()
    grad_y = torch.randn(200, 144) * 1e-3
    with fp8_autocast():
        y = ours(x)
    y.backward(grad_y)
    w, g_dtype = base.weight.detach(), E5M2 if fmt == "HYBRID" else E4M3
    x0 = x.detach()
    w_blocks = _dequantized(w, WEIGHT_BLOCK, E4M3, power_of_2)
    _within_float32_sum_bound(y, _dequantized(x0, ROW_TILE, E4M3, power_of_2), w_blocks)
    _within_float32_sum_bound(x.grad, _dequantized(grad_y, ROW_TILE, g_dtype, power_of_2), w_blocks.t())
    g_cols = _dequantized(grad_y, COLUMN_TILE, g_dtype, power_of_2)
    _within_float32_sum_bound(ours.weight.grad, g_cols.t(), _dequantized(x0, COLUMN_TILE, E4M3, power_of_2).t())


def _outer_dim_major(t_shape, scale) -> bool:
    """torch's ``is_blockwise_1x128_scaling`` (ScaledBlas.cpp): scale (rows, ceil(K/128)), stride (1, rows); a
    dimension of size 1 may have any stride."""
    rows, k = t_shape
    return _fits(scale, ((rows, 1), (-(-k // 128), rows)))


def _inner_dim_major_padded(t_shape, scale) -> bool:
    """cuBLAS's 128x128 layout, which the casts write: scale (ceil(R/128), ceil(K/128)), stride
    (round_up(ceil(K/128), 4), 1). torch's v1 ``is_blockwise_128x128_scaling`` wants the stride ceil(K/128) exactly,
    so v1 takes this layout only where the two agree (fp8_lightning.cuda_rules; tests/core/test_cuda_rules.py)."""
    k_tiles = -(-t_shape[1] // 128)
    return _fits(scale, ((-(-t_shape[0] // 128), -(-k_tiles // 4) * 4), (k_tiles, 1)))


def _fits(scale, want) -> bool:
    """torch's ``check_size_stride`` for each (size, stride) of ``want``."""
    return all(
        scale.shape[d] == size and (size <= 1 or scale.stride(d) == stride) for d, (size, stride) in enumerate(want)
    )


@pytest.mark.parametrize("m, k, n", [(256, 384, 512), (200, 300, 144), (16, 1000, 40)])
def test_cuda_layouts_pass_torchs_scaled_mm_checks(m, k, n):
    """The three GEMMs' operand pairs on fake CUDA tensors: torch's meta ``_scaled_mm`` accepts the shapes, and the
    strides are those cuBLAS reads (outer-dim-major 1x128, 16-byte aligned inner-dim-major 128x128). The meta
    function checks no strides: torch's CUDA rule for v1 refuses the padded 128x128 layout where ceil(K/128) is not
    a multiple of 4 (K = 384 and 300 here), so on sm_90 those GEMMs take v2 or the emulation (the plan), never v1."""
    kt, nt = -(-k // 128), -(-n // 128)
    with fake_cuda():
        x, w = fake_operand((m, k), (m, kt), "block"), fake_operand((n, k), (nt, kt), "block")
        g, w_t = fake_operand((m, n), (m, nt), "block"), Quantized(w.data.t(), w.scale.t(), "block")  # dgrad
        g_t = fake_operand((n, m), (n, -(-m // 128)), "block")  # wgrad: 1x128 x 1x128
        x_t = fake_operand((k, m), (k, -(-m // 128)), "block")
        for a, b in ((x, w), (g, w_t), (g_t, x_t)):
            mat1, mat2, scale_a, scale_b = blockwise_scaled_mm_args(a, b)
            out = torch._scaled_mm(mat1, mat2, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
            assert out.shape == (a.data.shape[0], mat2.shape[1]) and mat1.stride(1) == 1 and mat2.stride(0) == 1
            assert mat1.shape[1] % 16 == 0 == mat2.shape[1] % 16
            assert _outer_dim_major(mat1.shape, scale_a)
            b_check = _outer_dim_major if b is x_t else _inner_dim_major_padded
            assert b_check(mat2.t().shape, scale_b.t()) and scale_a.dtype == scale_b.dtype == torch.float32
            layouts = [Layout.of(t) for t in (mat1, mat2, scale_a, scale_b)]
            v1_takes_it = cuda_rules.v1_violation((9, 0), (12, 9), *layouts) is None
            block = None if b is x_t else "b"
            for has_v2 in (True, False):
                path, _ = cuda_rules.blockwise_gemm_plan(*a.data.shape, b.data.shape[0], (9, 0), has_v2, (12, 9), block)
                assert v1_takes_it or path != cuda_rules.V1
            assert v1_takes_it == (b is x_t or -(-mat1.shape[1] // 128) % 4 == 0)
        with pytest.raises(ValueError, match="two 128x128"):
            blockwise_scaled_mm_args(w, w)


def test_gemm_emulated_where_cublas_lacks_it_with_a_warning_naming_the_emulation_option(monkeypatch):
    """Off sm_90 the GEMM falls back to the emulation with one warning that names the reason and the option that
    chooses the emulation (it raised here before, in the first training step)."""
    ok, reason = blockwise_gemm_support("cpu")
    assert not ok and "CUDA device" in reason
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    monkeypatch.setattr(blockwise, "_WARNED", set())
    ok, reason = blockwise_gemm_support("cuda")
    assert not ok and "10.0" in reason
    with fake_cuda():
        a = fake_operand((32, 128), (32, 1), "block")
        with pytest.warns(UserWarning, match="compute capability 10.0.*FP8_LIGHTNING_EMULATE=1"):
            assert blockwise_mm(a, a, torch.bfloat16).shape == (32, 32)
    set_env(monkeypatch, FP8_LIGHTNING_EMULATE="1")  # the named option reaches the blockwise GEMM as emulate=True
    seen = []
    monkeypatch.setattr(fine_grained, "blockwise_mm", lambda a, b, out_dtype, emulate: seen.append(emulate))
    q = Quantized(*quantize_blockwise(torch.randn(4, 32), ROW_TILE, E4M3), "block")
    gemm.fp8_mm(q, q, torch.float32)
    assert seen == [True]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    assert blockwise_gemm_support("cuda") == (False, "CUDA 12.4 has no block-scaled GEMM (needs CUDA 12.9+)")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert blockwise_gemm_support("cuda")[0]
