"""Independent references and comparisons for the kernel tests.

* :func:`assert_same_fp8` compares float8 tensors bit for bit (NaN payloads aside: every NaN is equal).
* :func:`tie_cases` builds inputs that sit exactly halfway between neighbouring FP8 values, with the expected
  round-to-nearest-even result derived from the *codes* (the even code wins), not from any cast.
* :func:`mx_exponent_reference` is the MX shared-exponent rule in float64 Python arithmetic, from the OCP
  definition (floor) and from "smallest power of two that keeps amax / scale <= fp8_max" (rceil).
"""

from __future__ import annotations

import math

import torch

from fp8_lightning.formats import fp8_emax, fp8_max


def assert_same_fp8(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (tuple(actual.shape), tuple(expected.shape))
    a_nan, e_nan = torch.isnan(actual.float()), torch.isnan(expected.float())
    assert torch.equal(a_nan, e_nan), "NaN positions differ"
    a_bits, e_bits = actual.view(torch.uint8)[~a_nan], expected.view(torch.uint8)[~e_nan]
    mismatches = (a_bits != e_bits).sum().item()
    if mismatches:
        idx = (a_bits != e_bits).nonzero()[:5].flatten()
        raise AssertionError(
            f"{mismatches} of {a_bits.numel()} FP8 codes differ; first: kernel {a_bits[idx].tolist()} vs "
            f"reference {e_bits[idx].tolist()}"
        )


def finite_codes(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, values in float64) of all finite non-negative FP8 values, ascending."""
    codes = torch.arange(128, dtype=torch.uint8)
    values = codes.view(dtype).double()
    keep = torch.isfinite(values)
    return codes[keep], values[keep]


def tie_cases(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs exactly halfway between consecutive FP8 values (both signs, subnormals included) and the
    expected float8 result under round-to-nearest-even: the neighbour with the even code."""
    codes, values = finite_codes(dtype)
    mid = (values[:-1] + values[1:]) / 2  # exact in float64, and in float32 (one more mantissa bit)
    even = torch.where(codes[:-1] % 2 == 0, codes[:-1], codes[1:])
    x = torch.cat([mid, -mid]).float()
    expected = torch.cat([even, even | 0x80]).view(dtype)
    assert torch.equal(x.double().abs()[: len(mid)], mid)
    return x, expected


def mx_exponent_reference(block_amax: float, dtype: torch.dtype, rule: str) -> int:
    """The E8M0 exponent of one block (before the NaN byte), from the definitions in float64."""
    if not block_amax > 0 or math.isnan(block_amax):
        return -127
    if math.isinf(block_amax):  # the twin follows torch.frexp(inf): exponent 0, i.e. floor(log2) = -1
        return -1 - fp8_emax(dtype) + (rule == "rceil")
    exp = math.frexp(block_amax)[1] - 1 - fp8_emax(dtype)
    if rule == "rceil":
        exp = -127
        while exp < 127 and not block_amax / 2.0**exp <= fp8_max(dtype):
            exp += 1
    return max(-127, min(127, exp))
