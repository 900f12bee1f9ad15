"""NVFP4 numerics (fp8_lightning.nvfp4) against float64 references written out here: E2M1 rounding (every value,
every tie, saturation, signs), two-level block scales, 16x16 tiles, packing, special values, the random Hadamard
transform and stochastic rounding."""

from __future__ import annotations

import pytest
import torch

from fp8_lightning import dequantize_nvfp4, quantize_nvfp4
from fp8_lightning.nvfp4 import (
    E2M1_VALUES,
    apply_rht,
    e2m1_codes,
    e2m1_values,
    global_scale_from_amax,
    hadamard_16,
    mix_seed,
    pack_e2m1,
    rht_matrix,
    rht_signs,
    stochastic_e2m1_codes,
    uniform_like,
    unpack_e2m1,
)

GRID = torch.tensor(E2M1_VALUES, dtype=torch.float64)


def _rne_reference(v: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 magnitude code by brute force in float64, ties to the even code, saturating; sign bit kept."""
    mag = v.double().abs().clamp(max=6.0)
    dist = (mag[..., None] - GRID).abs()
    best = dist.min(dim=-1, keepdim=True).values
    candidates = dist == best
    # among equally near codes take the even one (a tie has exactly two neighbours, one even)
    even = candidates & (torch.arange(8) % 2 == 0)
    code = torch.where(even.any(-1), even.float().argmax(-1), candidates.float().argmax(-1)).to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def test_every_e2m1_value_is_its_own_code_and_decodes_back():
    values = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))
    codes = e2m1_codes(values)
    assert codes.tolist() == list(range(16))
    assert torch.equal(e2m1_values(codes), values)


@pytest.mark.parametrize(
    "value, code", [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6), (-0.75, 10), (-5.0, 14)]
)
def test_ties_round_to_the_even_code(value, code):
    assert e2m1_codes(torch.tensor([value])).item() == code


def test_rounding_matches_a_float64_brute_force_reference():
    torch.manual_seed(0)
    v = torch.cat([torch.randn(20000) * 3, torch.linspace(-7, 7, 2801), torch.tensor([0.0, -0.0, 6.0, -6.0, 1e-8])])
    assert torch.equal(e2m1_codes(v.float()), _rne_reference(v))


def test_saturation_and_signed_zero():
    codes = e2m1_codes(torch.tensor([6.5, 100.0, -7.0, -0.1, 0.1, -0.0]))
    assert codes.tolist() == [7, 7, 15, 8, 0, 8]  # small negatives keep the sign bit (-0), as torchao's cast


def test_packing_puts_the_even_element_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 3, 15]], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0xF3]]
    assert torch.equal(unpack_e2m1(packed), codes)


def _two_level_reference(x: torch.Tensor, tile_rows: int = 1):
    """The two-level scaling of the module docstring in float64, each step rounded to float32 where the format
    computes in float32: the global scale; the block scale ``amax / 6 / g`` (rounded once to E4M3); the encode factor
    ``(1 / g) / s``; the scaled value ``x * factor`` (a float64 value can fall either side of an E2M1 midpoint that
    the float32 one lands on: bf16 inputs hit such ties); then E2M1 by brute force."""
    f32 = lambda t: t.float().double()  # noqa: E731
    xd = x.double()
    amax = xd.abs().max()
    g = f32(torch.tensor(float(amax) / 2688.0 if 0 < amax < float("inf") else 1.0))
    rows, k = x.shape
    tiles = xd.reshape(rows // tile_rows, tile_rows, k // 16, 16)
    block_amax = tiles.abs().amax(dim=(1, 3))
    s = f32(f32(block_amax / 6.0) / g).clamp(2.0**-6, 448.0).to(torch.float8_e4m3fn)
    encode = f32(f32(1.0 / g) / s.double())
    scaled = f32(tiles * encode[:, None, :, None]).reshape(rows, k)
    return _rne_reference(scaled), s, f32(g * s.double())


@pytest.mark.parametrize("tile_rows", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_level_quantization_matches_the_float64_formula(tile_rows, dtype):
    torch.manual_seed(1)
    x = (torch.randn(64, 96) * torch.logspace(-3, 3, 96)).to(dtype)
    q = quantize_nvfp4(x, tile_rows=tile_rows)
    codes, scales, total = _two_level_reference(x, tile_rows)
    assert torch.equal(q.block_scales.view(torch.uint8), scales.view(torch.uint8))
    assert torch.equal(unpack_e2m1(q.codes), codes)
    assert q.global_scale.item() == pytest.approx(float(x.float().abs().max()) / 2688.0, rel=1e-7)
    want = e2m1_values(codes).double() * total.repeat_interleave(tile_rows, 0).repeat_interleave(16, 1)
    torch.testing.assert_close(dequantize_nvfp4(q).double(), want, rtol=1.2e-7, atol=0)  # one float32 rounding


def test_the_largest_block_scale_lands_near_448_and_the_error_is_bounded():
    torch.manual_seed(2)
    x = torch.randn(32, 64)
    q = quantize_nvfp4(x)
    assert 416 <= q.block_scales.float().max().item() <= 448
    err = (dequantize_nvfp4(q) - x).abs()
    block_amax = x.abs().reshape(32, 4, 16).amax(-1, keepdim=True).expand(32, 4, 16).reshape(32, 64)
    assert bool((err <= block_amax / 6 * 1.0 * 1.07 + 1e-7).all())  # half the widest E2M1 gap (2) of the block


def test_16x16_tiles_commute_with_the_transpose():
    torch.manual_seed(3)
    w = torch.randn(48, 32)
    a, b = quantize_nvfp4(w, tile_rows=16), quantize_nvfp4(w.t(), tile_rows=16)
    assert torch.equal(dequantize_nvfp4(a).t(), dequantize_nvfp4(b))
    assert torch.equal(a.block_scales.t().view(torch.uint8), b.block_scales.view(torch.uint8))


def test_zero_blocks_zero_tensors_and_ragged_k():
    x = torch.zeros(4, 40)
    x[0, :16] = torch.arange(16.0)
    q = quantize_nvfp4(x)
    assert q.codes.shape == (4, 24) and q.block_scales.shape == (4, 3) and q.shape == (4, 40)
    assert q.block_scales[1:].float().eq(2.0**-6).all() and q.block_scales[0, 1:].float().eq(2.0**-6).all()
    assert dequantize_nvfp4(q).shape == (4, 40) and dequantize_nvfp4(q)[1:].eq(0).all()
    zero = quantize_nvfp4(torch.zeros(2, 16))
    assert zero.global_scale.item() == 1.0 and dequantize_nvfp4(zero).eq(0).all()


def test_nan_poisons_its_block_and_inf_saturates():
    x = torch.randn(2, 32)
    x[0, 3] = float("nan")
    q = quantize_nvfp4(x, global_scale=torch.tensor(1.0))
    out = dequantize_nvfp4(q)
    assert out[0, :16].isnan().all() and not out[0, 16:].isnan().any() and not out[1].isnan().any()
    y = torch.ones(1, 16)
    y[0, 0] = float("inf")
    q = quantize_nvfp4(y)
    assert q.global_scale.item() == 1.0
    assert dequantize_nvfp4(q)[0, 0].item() == 6 * 448.0


def test_codes_view_as_torch_float4():
    q = quantize_nvfp4(torch.randn(4, 32))
    assert q.as_float4().dtype == torch.float4_e2m1fn_x2 and q.as_float4().shape == (4, 16)


def test_global_scale_is_amax_over_2688_and_one_for_degenerate_amaxes():
    amax = torch.tensor([2688.0, 0.0, float("inf"), float("nan"), 1.0])
    assert global_scale_from_amax(amax).tolist() == [1.0, 1.0, 1.0, 1.0, pytest.approx(1 / 2688)]


# -- the random Hadamard transform ---------------------------------------------------------------------------------


def test_hadamard_is_orthogonal_and_the_rht_keeps_products():
    h = hadamard_16(torch.float64)
    assert torch.equal(h @ h.T, 16 * torch.eye(16, dtype=torch.float64))
    r = rht_matrix(rht_signs(7), torch.float64)
    torch.testing.assert_close(r @ r.T, torch.eye(16, dtype=torch.float64), rtol=0, atol=1e-15)
    torch.manual_seed(4)
    a, b = torch.randn(8, 64, dtype=torch.float64), torch.randn(5, 64, dtype=torch.float64)
    torch.testing.assert_close(apply_rht(a, r) @ apply_rht(b, r).T, a @ b.T, rtol=1e-12, atol=1e-12)


def test_rht_signs_are_seeded():
    assert torch.equal(rht_signs(3), rht_signs(3))
    assert not torch.equal(rht_signs(3), rht_signs(4))
    assert set(rht_signs(3).tolist()) <= {-1.0, 1.0} and rht_signs(3).abs().sum() == 16


# -- stochastic rounding -------------------------------------------------------------------------------------------


def test_stochastic_rounding_only_reaches_the_two_neighbours_and_is_deterministic():
    v = torch.linspace(-6, 6, 1001)
    u = uniform_like((1, 1001), 5).reshape(-1)
    codes = stochastic_e2m1_codes(v, u)
    assert torch.equal(codes, stochastic_e2m1_codes(v, u))
    got = e2m1_values(codes)
    lower = torch.tensor([max(g for g in E2M1_VALUES if g <= abs(x)) for x in v.tolist()]) * v.sign()
    upper = torch.tensor([min(g for g in E2M1_VALUES if g >= abs(x)) for x in v.tolist()]) * v.sign()
    assert bool(((got == lower) | (got == upper)).all())
    exact = torch.tensor([abs(x) in E2M1_VALUES for x in v.tolist()])
    assert torch.equal(got[exact], v[exact])


def test_stochastic_rounding_is_unbiased():
    """The mean of 4096 stochastic casts of each value lies within 5 standard errors of the value (seeded)."""
    v = torch.tensor([0.1, 0.3, 0.6, 1.2, 1.9, 2.2, 2.9, 3.3, 4.5, 5.9, -0.2, -2.7, -5.1])
    draws = 4096
    u = uniform_like((draws, v.numel()), mix_seed(11, 0, 0))
    means = e2m1_values(stochastic_e2m1_codes(v.expand(draws, -1), u)).double().mean(0)
    lower = torch.tensor([max(g for g in E2M1_VALUES if g <= abs(x)) for x in v.tolist()], dtype=torch.float64)
    upper = torch.tensor([min(g for g in E2M1_VALUES if g >= abs(x)) for x in v.tolist()], dtype=torch.float64)
    p = (v.abs().double() - lower) / (upper - lower)
    stderr = (upper - lower) * (p * (1 - p) / draws).sqrt()
    assert bool(((means - v.double()).abs() <= 5 * stderr + 1e-12).all()), (means, v)
    rtn = e2m1_values(e2m1_codes(v)).double()
    assert (means - v.double()).abs().mean() < (rtn - v.double()).abs().mean() / 4  # RTN is biased; SR is not


def test_uniform_numbers_are_uniform_and_keyed():
    u = uniform_like((256, 256), 1)
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.005
    assert torch.equal(u, uniform_like((256, 256), 1)) and not torch.equal(u, uniform_like((256, 256), 2))
    assert mix_seed(1, 0, 5) != mix_seed(1, 1, 5) and mix_seed(1, 0, 5) != mix_seed(1, 0, 6)


def test_stochastic_quantization_is_unbiased_through_the_scales():
    torch.manual_seed(5)
    x = torch.randn(1, 64)
    outs = torch.stack([
        dequantize_nvfp4(quantize_nvfp4(x, uniform=uniform_like((1, 64), mix_seed(0, 0, i)))) for i in range(2000)
    ])
    scale = quantize_nvfp4(x).block_scales.float().max() * quantize_nvfp4(x).global_scale
    assert (outs.double().mean(0) - x.double()).abs().max() < 0.1 * scale * 2


def test_bad_arguments_name_what_is_allowed():
    """quantize_nvfp4 / dequantize_nvfp4 refuse what they cannot use with the fix, instead of an attribute error, a
    broadcasting error or silently wrong values; a Python number is taken as the global scale."""
    x = torch.randn(20, 48)
    as_float = dequantize_nvfp4(quantize_nvfp4(x, 0.01))
    assert torch.equal(as_float, dequantize_nvfp4(quantize_nvfp4(x, torch.tensor(0.01))))
    bad = [
        (dict(x=torch.randn(64)), ValueError, r"2-D tensor \(K last\); got shape \(64,\). Reshape it to \(-1, K\)"),
        (dict(x=[[1.0] * 16]), TypeError, "2-D floating-point tensor .K last.; got list"),
        (dict(global_scale=torch.ones(2)), ValueError, r"global_scale must be one positive finite number.*shape \(2,\)"),
        (dict(global_scale="1"), ValueError, "global_scale must be one positive finite number.*got str"),
        (dict(uniform=torch.rand(3)), ValueError, r"uniform must be .* padded shape \(20, 48\).*got \(3,\)"),
        (dict(rht_signs=torch.ones(3)), ValueError, r"rht_signs must be a tensor of 16 signs.*got \(3,\)"),
    ]
    for kwargs, error, match in bad:
        with pytest.raises(error, match=match):
            quantize_nvfp4(**{"x": x, **kwargs})
    with pytest.raises(TypeError, match="takes the NVFP4Tensor quantize_nvfp4 returns; got Tensor"):
        dequantize_nvfp4(x)
    with pytest.raises(ValueError, match="out_dtype=torch.int32 is invalid"):
        dequantize_nvfp4(quantize_nvfp4(x), torch.int32)
