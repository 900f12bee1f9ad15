"""State quantizers and master-weight bit tricks against independent float64 references."""

import math

import pytest
import torch

from fp8_lightning.optim import master_weights as mw
from fp8_lightning.optim.config import config_from
from fp8_lightning.optim.state_formats import StateFormat, decode_state, encode_state


def fp8_grid(dtype: torch.dtype) -> torch.Tensor:
    """Every finite non-negative value of a float8 dtype, in float64, sorted (built from the bit patterns)."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).double()
    values = values[torch.isfinite(values) & (values >= 0)]
    return torch.unique(values)


def nearest_on_grid(x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Round float64 ``x`` to the nearest signed grid value (saturating at the grid's maximum)."""
    mag = x.abs().clamp(max=grid[-1].item())
    idx = torch.searchsorted(grid, mag).clamp(1, len(grid) - 1)
    lo, hi = grid[idx - 1], grid[idx]
    pick = torch.where((mag - lo) <= (hi - mag), lo, hi)
    return torch.sign(x) * pick


def reference_block_quantize(x: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """float64 reference: per-block scale = max/amax, round to the nearest representable value, unscale."""
    flat = x.double().reshape(-1)
    pad = (-flat.numel()) % block
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, block)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    fmax = float(torch.finfo(dtype).max)
    scale = torch.where(amax > 0, fmax / amax, torch.ones_like(amax))
    return (nearest_on_grid(blocks * scale, fp8_grid(dtype)) / scale).reshape(-1)[: x.numel()].reshape(x.shape)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("block", [32, 128])
def test_fp8_block_state_matches_float64_reference(dtype, block):
    # magnitudes spanning many binades, lengths that leave a partial last block
    x = torch.randn(37, 53) * torch.exp(torch.randn(37, 53) * 3)
    fmt = StateFormat(dtype, block)
    data, scale = encode_state(x, fmt)
    assert data.dtype == dtype and data.numel() == math.ceil(x.numel() / block) * block
    assert scale.shape == (math.ceil(x.numel() / block),) and scale.dtype == torch.float32
    got = decode_state(data, scale, fmt, x.shape).double()
    ref = reference_block_quantize(x, block, dtype)
    # scales are float32 in the code, float64 in the reference: agree to float32 rounding
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)


def test_e4m3_relative_error_bound_within_block_range():
    x = torch.rand(4096) + 0.5  # one binade: every element is a normal E4M3 number after scaling
    fmt = StateFormat("e4m3", 128)
    got = decode_state(*encode_state(x, fmt), fmt, x.shape).double()
    rel = ((got - x.double()).abs() / x.double()).max().item()
    assert 0 < rel <= 2.0**-4  # E4M3 has 3 mantissa bits: half an ulp is at most 2**-4 relative


def test_zero_and_padded_blocks_decode_to_zero():
    x = torch.zeros(300)
    x[:5] = torch.tensor([1.0, -2.0, 3.0, 0.5, -0.25])
    fmt = StateFormat("e4m3", 128)
    data, scale = encode_state(x, fmt)
    assert scale[1].item() == 1.0 and scale[2].item() == 1.0  # all-zero blocks
    got = decode_state(data, scale, fmt, x.shape)
    assert torch.equal(got[5:], torch.zeros(295)) and got.shape == x.shape
    torch.testing.assert_close(got[:5], x[:5], rtol=2.0**-4, atol=0)


def test_sqrt_transform_keeps_twice_the_binades():
    # a second moment v = g**2 for gradients spanning 2**-12 .. 2**0: v spans 2**-24 .. 2**0
    g = torch.logspace(-12, 0, 128, base=2.0)
    v = g * g
    plain, sqrt = StateFormat("e4m3", 128), StateFormat("e4m3", 128, "sqrt")
    v_plain = decode_state(*encode_state(v, plain), plain, v.shape)
    v_sqrt = decode_state(*encode_state(v, sqrt), sqrt, v.shape)
    # E4M3 covers about 2**17.8: plain storage flushes v below ~2**-18 to zero, sqrt storage keeps every entry
    assert (v_plain == 0).sum() > 20
    assert (v_sqrt > 0).all()
    rel = ((v_sqrt.double() - v.double()).abs() / v.double()).max().item()
    assert rel <= 2 * 2.0**-4 + 2.0**-8  # (1 + 2**-4)**2 - 1


def test_fp16_block_scaling_keeps_tiny_second_moments():
    v = torch.full((256,), 1e-12)
    v[0] = 1e-9
    fmt = StateFormat("fp16", 128)
    got = decode_state(*encode_state(v, fmt), fmt, v.shape)
    assert (v.half() == 0).all()  # unscaled FP16 would lose every one of them
    torch.testing.assert_close(got, v, rtol=2.0**-11, atol=0)


def test_state_format_parsing_and_refusals():
    assert StateFormat.parse("e4m3") == StateFormat("float8_e4m3fn", 128)
    assert StateFormat.parse("e4m3:64:sqrt") == StateFormat("float8_e4m3fn", 64, "sqrt")
    with pytest.raises(ValueError, match="needs per-block scales"):
        StateFormat("e4m3", 0)
    with pytest.raises(ValueError, match="allowed"):
        StateFormat("int4")
    with pytest.raises(ValueError, match="square root"):
        config_from("default", exp_avg="e4m3:128:sqrt")
    with pytest.raises(TypeError, match="allowed"):
        config_from("default", moment_dtype="e4m3")
    with pytest.raises(ValueError, match="max_savings"):
        config_from("tiny")
    assert config_from("max_savings", block_size=32).exp_avg_sq.block_size == 32


def test_bf16_remainder_is_exact_and_rounds_to_nearest():
    x = torch.randn(10_000) * torch.exp(torch.randn(10_000) * 4)
    high, low = mw.split_fp32(x)
    assert high.dtype == torch.bfloat16 and low.dtype == torch.int16
    assert torch.equal(mw.join_fp32(high, low), x)  # exact reconstruction, bit for bit
    # the bf16 part is a nearest bf16 value: within half a bf16 ulp (2**-8 relative to its binade), in float64
    h = high.double()
    ulp = torch.ldexp(torch.ones_like(h), torch.frexp(h)[1] - 8)
    assert ((x.double() - h).abs() <= ulp / 2).all()


def test_bf16_int8_remainder_is_the_nearest_16_significant_bit_value():
    """float64 reference: the master is x rounded to nearest with 16 significant bits; its bf16 part is nearest."""
    x = torch.randn(20_000) * torch.exp(torch.randn(20_000) * 4)
    high, low = mw.split_fp32_int8(x)
    assert high.dtype == torch.bfloat16 and low.dtype == torch.int8 and low.shape == x.shape
    master = mw.join_fp32_int8(high, low).double()
    xd = x.double()
    _, exponent = torch.frexp(xd)  # |x| in [2**(e-1), 2**e): a 16-significant-bit ulp there is 2**(e-16)
    ulp16 = torch.ldexp(torch.ones_like(xd), exponent - 16)
    assert ((master - xd).abs() <= ulp16 / 2).all()
    assert torch.equal(master / ulp16, torch.round(master / ulp16))  # on the 16-bit grid (within x's binade+1)
    # the bf16 parameter is within half a bf16 ulp of the master
    h = high.double()
    assert ((master - h).abs() <= torch.ldexp(torch.ones_like(h), torch.frexp(h)[1] - 8) / 2).all()
    # values already on the 16-bit grid round-trip exactly, both signs, zero included
    on_grid = torch.tensor([0.0, 1.0, -1.0, 1.0 + 2.0**-15, -(3.0 + 2.0**-14), 2.0**-100 * (1 + 2.0**-15)])
    assert torch.equal(mw.join_fp32_int8(*mw.split_fp32_int8(on_grid)), on_grid)


def test_int8_remainder_master_keeps_updates_below_a_bf16_ulp():
    """Updates of 2**-12 on 0.5 (bf16 ulp there: 2**-8) are 16 steps of the 16-bit grid: all kept, exactly."""
    param = torch.full((64,), 0.5, dtype=torch.bfloat16)
    state = mw.init_master(param, "bf16_int8_remainder")
    assert state["master_remainder"].dtype == torch.int8
    plain = param.clone()
    for _ in range(100):
        master = mw.load_master(param, state, "bf16_int8_remainder")
        master.add_(2.0**-12)
        mw.store_master(param, state, "bf16_int8_remainder", master)
        plain.add_(torch.full_like(plain, 2.0**-12))
    exact = mw.load_master(param, state, "bf16_int8_remainder")
    assert torch.equal(exact.double(), torch.full((64,), 0.5 + 100 * 2.0**-12, dtype=torch.float64))
    assert torch.equal(param, exact.bfloat16())
    assert torch.equal(plain, torch.full_like(plain, 0.5))  # every update lost without a master
    # an update that is not on the grid (1e-4 ~ 6.6 grid steps) loses at most half a grid step per store
    for _ in range(100):
        master = mw.load_master(param, state, "bf16_int8_remainder")
        mw.store_master(param, state, "bf16_int8_remainder", master.add_(1e-4))
    drift = (mw.load_master(param, state, "bf16_int8_remainder").double() - (0.5 + 100 * 2.0**-12 + 100 * 1e-4))
    assert (drift.abs() <= 100 * 2.0**-17).all()


def test_fp16_scaled_master_scale_is_power_of_two_in_range():
    x = torch.randn(1000) * 1e-3
    scale = mw.fp16_master_scale(x)
    assert math.log2(scale.item()).is_integer()
    assert 2.0**13 <= (x.abs().max() * scale).item() <= 2.0**14


def test_remainder_master_keeps_updates_below_a_bf16_ulp():
    """1000 updates of 1e-5 on a weight of 0.5 (bf16 ulp there: 2**-8): the remainder keeps every one."""
    param = torch.full((64,), 0.5, dtype=torch.bfloat16)
    state = mw.init_master(param, "bf16_remainder")
    plain = param.clone()
    fp32 = torch.full((64,), 0.5)
    for _ in range(1000):
        fp32.add_(1e-5)
        master = mw.load_master(param, state, "bf16_remainder")
        master.add_(1e-5)
        mw.store_master(param, state, "bf16_remainder", master)
        plain.add_(torch.full_like(plain, 1e-5))  # rounding into bf16 every step
    exact = mw.load_master(param, state, "bf16_remainder")
    assert torch.equal(exact, fp32)  # the same as a float32 master, bit for bit
    assert abs(exact[0].item() - (0.5 + 1000 * 1e-5)) < 1e-4  # and near the float64 sum
    assert torch.equal(plain, torch.full_like(plain, 0.5))  # every update lost without a master


def test_rounding_noise_is_uniform_16_bit_and_changes_with_the_step():
    noise = mw.rounding_noise(1 << 16, step=3)
    assert noise.dtype == torch.int32 and int(noise.min()) >= 0 and int(noise.max()) < 1 << 16
    counts = torch.bincount(noise.long() >> 12, minlength=16).double()  # 16 bins of 4096 values, 4096 expected
    assert ((counts - 4096).abs() < 6 * 64).all()  # within 6 standard deviations (sqrt(4096) = 64)
    assert torch.equal(noise, mw.rounding_noise(1 << 16, step=3))  # deterministic
    assert (noise != mw.rounding_noise(1 << 16, step=4)).double().mean() > 0.99


def test_stochastic_bf16_rounding_is_unbiased_against_float64():
    """x = a bf16 value + a quarter ulp: rounds to one of its two bf16 neighbours, up about 1/4 of the time."""
    n = 1 << 16
    base = torch.tensor([1.5, -0.375, 1.5 * 2.0**-66], dtype=torch.float64)  # bf16 values
    ulp = torch.ldexp(torch.ones_like(base), torch.frexp(base)[1] - 8)
    for b, u in zip(base, ulp):
        x = torch.full((n,), (b + torch.sign(b) * u / 4).item(), dtype=torch.float32)
        assert x[0].double() == b + torch.sign(b) * u / 4  # exactly representable in float32
        rounded = mw.round_to_bf16_stochastic(x, mw.rounding_noise(n, step=1)).double()
        up = rounded.abs() > abs(b)
        assert torch.equal(rounded[up].abs().unique(), (abs(b) + u).reshape(1))
        assert torch.equal(rounded[~up].abs().unique(), abs(b).reshape(1))
        assert abs(up.double().mean().item() - 0.25) < 0.01
        assert torch.equal(torch.sign(rounded), torch.sign(x.double()))


def test_stochastic_rounding_accumulates_updates_below_half_a_bf16_ulp():
    """200 updates of 2**-11 (1/8 ulp) on 0.5: nearest rounding keeps none, stochastic keeps them on average."""
    param = torch.full((4096,), 0.5, dtype=torch.bfloat16)
    state = {"step": torch.tensor(0.0)}
    assert mw.init_master(param, "bf16_stochastic") == {}
    for _ in range(200):
        state["step"] += 1
        master = mw.load_master(param, state, "bf16_stochastic")
        mw.store_master(param, state, "bf16_stochastic", master.add_(2.0**-11))
    expected = 0.5 + 200 * 2.0**-11
    assert abs(param.double().mean().item() - expected) < 0.002 * expected
    assert mw.resolve_master_kind("bf16_stochastic", torch.float16) == "none"


@pytest.mark.parametrize("block_size", [1.5, "128", True, -1])
def test_a_block_size_that_is_not_an_integer_is_refused(block_size):
    """Guards against block_size=1.5 silently becoming 1 (int()) and a string being taken."""
    from fp8_lightning.optim import FP8Optimizer

    parameter = torch.nn.Parameter(torch.zeros(8))
    with pytest.raises(ValueError, match=r"block_size=.* is invalid; allowed: an integer >= 0"):
        FP8Optimizer(torch.optim.AdamW([parameter]), "default", block_size=block_size)
