"""Every bit pattern of E4M3 and E5M2 against a float64 reference built from the format definitions."""

import math

import pytest
import torch

from fp8_lightning.formats import Format, fp8_emax, fp8_max, fp8_min_normal, fp8_min_subnormal
from fp8_lightning.ops.dispatch import fast_dequantize_with_scale, fast_fp8_to_float32, fast_quantize_with_scale, fast_to_fp8_saturated
from tests.core.fp8_reference import decode, finite_table, round_saturate
from tests.environment import set_env

DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_256_patterns_decode_like_the_reference(dtype):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = codes.view(dtype).to(torch.float64).tolist()
    for code, got in enumerate(values):
        want = decode(code, dtype)
        if math.isnan(want):
            assert math.isnan(got), code
        else:
            assert got == want, (code, got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", ["C codec", "pure torch"])
def test_fast_cpu_decode_matches_the_reference_bit_for_bit(dtype, codec, monkeypatch):
    set_env(monkeypatch, FP8_LIGHTNING_DISABLE_CPU_CODEC="1" if codec == "pure torch" else "0")
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = [c for c in range(256) if not math.isnan(decode(c, dtype)) and not math.isinf(decode(c, dtype))]
    # E4M3: finite codes in a large tensor take the integer (float16) path; NaN codes, or a small tensor, the table
    for chosen, copies in ((finite, 40), (list(range(256)), 40), (finite, 1)):
        data = codes[chosen].view(dtype)
        got = fast_fp8_to_float32(data.reshape(-1, 1).repeat(1, 2 * copies).t())  # a transposed view stays one
        assert got.shape == (2 * copies, len(chosen)) and not got.is_contiguous()
        for code, value in zip(chosen, got[-1].tolist()):
            want = decode(code, dtype)
            if math.isnan(want):
                assert math.isnan(value), code
            else:
                assert value == want and math.copysign(1, value) == math.copysign(1, want), (code, value, want)
        assert torch.equal(got.isnan(), got[:1].isnan().expand_as(got))  # every copy decoded alike


@pytest.mark.parametrize("dtype", DTYPES)
def test_limits_match_the_format_definition(dtype):
    table = finite_table(dtype)
    assert fp8_max(dtype) == table[-1][0]
    assert fp8_min_subnormal(dtype) == table[1][0]
    bias = 7 if dtype == torch.float8_e4m3fn else 15
    assert fp8_min_normal(dtype) == 2.0 ** (1 - bias)
    assert 2 ** fp8_emax(dtype) <= fp8_max(dtype) < 2 ** (fp8_emax(dtype) + 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_pattern_survives_a_quantize_dequantize_round_trip(dtype):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = codes.view(dtype).to(torch.float32)
    finite = torch.isfinite(values)
    scale = torch.tensor(4.0)  # power of two: x / scale * scale is exact
    data = fast_quantize_with_scale(values[finite] / scale, scale, dtype)
    assert torch.equal(data.view(torch.uint8)[values[finite] != 0], codes[finite][values[finite] != 0])
    back = fast_dequantize_with_scale(data, scale)
    assert torch.equal(back, values[finite] / scale)


def _probe_values(dtype) -> list[float]:
    """Representable values, midpoints (ties), points just off the midpoints, and out-of-range values."""
    table = [v for v, _ in finite_table(dtype)]
    mids = torch.tensor([(lo + hi) / 2 for lo, hi in zip(table, table[1:])], dtype=torch.float32)
    up = torch.nextafter(mids, torch.full_like(mids, math.inf))
    down = torch.nextafter(mids, torch.zeros_like(mids))
    probes = table + mids.double().tolist() + up.double().tolist() + down.double().tolist()
    top = table[-1]
    probes += [top, top * 1.01, top * 1.5, top * 1e3, table[1] / 2, table[1] / 3, 0.0]
    probes = torch.tensor(probes + [-p for p in probes], dtype=torch.float32)
    return probes.double().tolist()  # the float32 values themselves, so the reference sees what the cast sees


@pytest.mark.parametrize("dtype", DTYPES)
def test_cast_rounds_to_nearest_even_and_saturates(dtype):
    probes = _probe_values(dtype)
    x = torch.tensor(probes, dtype=torch.float32)
    assert x.double().tolist() == probes  # every probe is exact in float32
    got = fast_to_fp8_saturated(x, dtype).to(torch.float64).tolist()
    want = [round_saturate(p, dtype) for p in probes]
    assert got == want


@pytest.mark.parametrize("dtype", DTYPES)
def test_saturation_holds_where_a_plain_cast_would_not(dtype):
    x = torch.tensor([1e6, -1e6, float("inf"), -float("inf")])
    got = fast_to_fp8_saturated(x, dtype).float()
    assert got.tolist() == [fp8_max(dtype), -fp8_max(dtype), fp8_max(dtype), -fp8_max(dtype)]
    assert torch.isnan(fast_to_fp8_saturated(torch.tensor([float("nan")]), dtype).float()).all()


def test_format_policies():
    assert Format.HYBRID.forward_dtype == torch.float8_e4m3fn
    assert Format.HYBRID.backward_dtype == torch.float8_e5m2
    assert Format.E4M3.backward_dtype == torch.float8_e4m3fn
    assert Format.E5M2.forward_dtype == torch.float8_e5m2
    assert Format.parse("hybrid") is Format.HYBRID
    assert Format.parse(torch.float8_e5m2) is Format.E5M2
    with pytest.raises(ValueError, match="allowed: E4M3, E5M2, HYBRID"):
        Format.parse("e3m4")
