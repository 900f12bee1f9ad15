"""The CPU codec's NVFP4 cast and uniform numbers compute the bits of the pure-torch reference.

The references are ``nvfp4._quantize_reference`` and ``nvfp4._uniform_reference`` (what :func:`quantize_nvfp4`
and :func:`uniform_like` run without the codec; held to torchao by ``test_nvfp4_torchao.py``). Hypothesis draws
ragged shapes and values spanning float32's range (subnormals, zeros, NaN with any payload and sign, infinities),
float32 and bfloat16, 1x16 blocks and 16x16 tiles, round to nearest even and stochastic rounding, and explicit
global scales (zero, infinite, NaN included). With ``FP8_LIGHTNING_DISABLE_CPU_CODEC=1`` the reference runs.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp8_lightning import nvfp4
from fp8_lightning.kernels import cpu_codec
from fp8_lightning.nvfp4 import quantize_nvfp4, uniform_like
from tests.environment import set_env

pytestmark = pytest.mark.skipif(
    not cpu_codec.status()[0], reason=f"the CPU codec is not built here: {cpu_codec.status()[1]}"
)

SPECIAL_BITS = [0x7FC00000, 0xFFC00000, 0x7FC00123, 0x7F800001, 0xFFBFFFFF, 0x7F800000, 0xFF800000, 0x00000001,
                0x80000001, 0x007FFFFF, 0x00000000, 0x80000000]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same(a: nvfp4.NVFP4Tensor, b: nvfp4.NVFP4Tensor) -> None:
    assert a.shape == b.shape and a.tile_rows == b.tile_rows
    assert a.codes.shape == b.codes.shape and a.codes.dtype == b.codes.dtype == torch.uint8
    assert torch.equal(a.codes, b.codes), f"{int((a.codes != b.codes).sum())} code bytes differ"
    assert a.block_scales.dtype == b.block_scales.dtype == torch.float8_e4m3fn
    assert torch.equal(bits(a.block_scales), bits(b.block_scales))
    assert a.global_scale.shape == b.global_scale.shape and torch.equal(bits(a.global_scale), bits(b.global_scale))


def hard_input(m: int, k: int, seed: int, specials: int, scale_exp: int) -> torch.Tensor:
    """(m, k) float32: rows scaled by powers of two from 2**-150 on, zero rows, and `specials` elements set to
    NaNs (several payloads and signs), infinities, zeros of both signs and subnormals."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-30, 30, (m, 1), generator=g).float())
    x = x * 2.0**scale_exp
    if m > 2:
        x[1] = 0.0
    flat = x.view(torch.int32).view(-1)
    for i in torch.randint(0, m * k, (specials,), generator=g).tolist():
        choice = SPECIAL_BITS[int(torch.randint(0, len(SPECIAL_BITS), (1,), generator=g))]
        flat[i] = torch.tensor(choice, dtype=torch.int64).to(torch.int32)
    return x


shapes = st.tuples(st.integers(1, 48), st.integers(1, 70))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=shapes, seed=st.integers(0, 2**31 - 1), specials=st.integers(0, 4),
       scale_exp=st.sampled_from([-140, -126, -60, 0, 40, 100]), tile_rows=st.sampled_from([1, 16]),
       stochastic=st.booleans(), bf16=st.booleans())
def test_codec_cast_is_the_reference_bit_for_bit(shape, seed, specials, scale_exp, tile_rows, stochastic, bf16):
    m, k = shape
    x = hard_input(m, k, seed, specials, scale_exp)
    if bf16:
        x = x.bfloat16()
    padded = (-(-m // tile_rows) * tile_rows, -(-k // 16) * 16)
    uniform = uniform_like(padded, seed) if stochastic else None
    assert_same(quantize_nvfp4(x, tile_rows=tile_rows, uniform=uniform),
                nvfp4._quantize_reference(x, tile_rows=tile_rows, uniform=uniform))


@settings(max_examples=150, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1), tile_rows=st.sampled_from([1, 16]), stochastic=st.booleans(),
       global_scale=st.sampled_from([0.0, 1e-30, 1.0, 3.5, -2.0, float("inf"), float("nan")]))
def test_codec_cast_with_a_given_global_scale_is_the_reference(shape, seed, tile_rows, stochastic, global_scale):
    m, k = shape
    x = hard_input(m, k, seed, 2, 0)
    scale = torch.tensor(global_scale)
    padded = (-(-m // tile_rows) * tile_rows, -(-k // 16) * 16)
    uniform = uniform_like(padded, seed) if stochastic else None
    assert_same(quantize_nvfp4(x, scale, tile_rows, uniform), nvfp4._quantize_reference(x, scale, tile_rows, uniform))


@settings(max_examples=30, deadline=None)
@given(shape=st.tuples(st.integers(1, 40), st.integers(1, 40)),
       key=st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 2**20).map(lambda c: nvfp4.mix_seed(7, 1, c)),
                     st.integers(0, 2**20).map(lambda c: nvfp4.mix_seed(7, torch.tensor(c)))))
def test_codec_uniform_numbers_are_the_reference(shape, key):
    assert torch.equal(bits(uniform_like(shape, key)), bits(nvfp4._uniform_reference(shape, key)))


def test_large_casts_split_over_threads_are_the_reference():
    """Above the codec's parallel threshold the bands run on several threads: still the same bits."""
    x = hard_input(1040, 1030, 3, 8, 0)
    padded = (1040, 1040)
    assert torch.equal(bits(uniform_like(padded, 5)), bits(nvfp4._uniform_reference(padded, 5)))
    for tile_rows in (1, 16):
        for uniform in (None, uniform_like(padded, 5)):
            assert_same(quantize_nvfp4(x, tile_rows=tile_rows, uniform=uniform),
                        nvfp4._quantize_reference(x, tile_rows=tile_rows, uniform=uniform))


def test_the_codec_is_used_when_enabled_and_the_reference_when_disabled(monkeypatch):
    x = hard_input(20, 40, 1, 2, 0)
    uniform = uniform_like((20, 48), 9)
    calls = []
    for name in ("nvfp4_quantize", "nvfp4_uniform"):
        original = getattr(cpu_codec, name)
        monkeypatch.setattr(cpu_codec, name, lambda *a, _f=original, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    with_codec = quantize_nvfp4(x, uniform=uniform)
    uniform_like((20, 48), 9)
    assert calls == ["nvfp4_quantize", "nvfp4_uniform"]
    set_env(monkeypatch, **{cpu_codec.CODEC_DISABLE_ENV: "1"})
    calls.clear()
    without = quantize_nvfp4(x, uniform=uniform)
    assert torch.equal(bits(uniform_like((20, 48), 9)), bits(uniform))
    assert calls == []
    assert_same(with_codec, without)
    assert_same(without, nvfp4._quantize_reference(x, uniform=uniform))


def test_inputs_the_codec_does_not_take_use_the_reference():
    """float16/float64 input, a float64 global scale, a uniform of another shape or dtype, empty tensors: the
    reference runs (the same results as calling it)."""
    x = hard_input(5, 20, 2, 1, 0)
    cases = [(x.half(), None, None), (x.double(), None, None), (x, torch.tensor(2.0, dtype=torch.float64), None),
             (x, None, torch.rand(5, 32, dtype=torch.float64)), (torch.zeros(0, 16), None, None)]
    for inp, scale, uniform in cases:
        assert_same(quantize_nvfp4(inp, scale, uniform=uniform), nvfp4._quantize_reference(inp, scale, uniform=uniform))


def test_codec_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="tile_rows"):
        cpu_codec.nvfp4_quantize(torch.ones(4, 16), 1.0, tile_rows=8)
    with pytest.raises(ValueError, match="padded shape"):
        cpu_codec.nvfp4_quantize(torch.ones(4, 20), 1.0, uniform=torch.rand(4, 20))
    with pytest.raises(TypeError, match="float32"):
        cpu_codec.nvfp4_quantize(torch.ones(4, 16, dtype=torch.float64), 1.0)
    with pytest.raises(ValueError, match="non-empty"):
        cpu_codec.nvfp4_quantize(torch.ones(0, 16), 1.0)
