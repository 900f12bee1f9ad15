"""Float64 reference for FP8 encodings, written from the format definitions (not from torch's casts).

E4M3 (fn): bias 7, no infinities, S.1111.111 is NaN, max = 1.75 * 2**8 = 448.
E5M2: bias 15, exponent 11111 is inf (mantissa 0) or NaN, max = 1.75 * 2**15 = 57344.
"""

import math
from fractions import Fraction

import torch

SPECS = {
    torch.float8_e4m3fn: dict(exp_bits=4, man_bits=3, bias=7, ieee_specials=False),
    torch.float8_e5m2: dict(exp_bits=5, man_bits=2, bias=15, ieee_specials=True),
}


def decode(code: int, dtype: torch.dtype) -> float:
    """Value of an 8-bit pattern, from sign/exponent/mantissa."""
    s = SPECS[dtype]
    sign = -1.0 if code & 0x80 else 1.0
    exp = (code >> s["man_bits"]) & ((1 << s["exp_bits"]) - 1)
    man = code & ((1 << s["man_bits"]) - 1)
    all_ones = (1 << s["exp_bits"]) - 1
    if s["ieee_specials"] and exp == all_ones:
        return sign * math.inf if man == 0 else math.nan
    if not s["ieee_specials"] and exp == all_ones and man == (1 << s["man_bits"]) - 1:
        return math.nan
    if exp == 0:
        return sign * man * 2.0 ** (1 - s["bias"] - s["man_bits"])
    return sign * (1 + man / 2 ** s["man_bits"]) * 2.0 ** (exp - s["bias"])


def finite_table(dtype: torch.dtype) -> list[tuple[float, int]]:
    """(value, code) of every finite non-negative pattern, ascending (code 0 for zero)."""
    out = {}
    for code in range(128):
        v = decode(code, dtype)
        if math.isfinite(v):
            out.setdefault(v, code)
    return sorted(out.items())


def round_saturate(x: float, dtype: torch.dtype) -> float:
    """Reference cast: saturate to +-max, then round to nearest, ties to the even mantissa (even code)."""
    if math.isnan(x):
        return math.nan
    table = finite_table(dtype)
    max_value = table[-1][0]
    a = min(abs(x), max_value)
    below = max(v for v in table if v[0] <= a)
    above = min(v for v in table if v[0] >= a)
    if below[0] == above[0]:
        result = below[0]
    elif a - below[0] < above[0] - a:
        result = below[0]
    elif a - below[0] > above[0] - a:
        result = above[0]
    else:
        result = below[0] if below[1] % 2 == 0 else above[0]
    return math.copysign(result, x)


def nearest_float32(q: Fraction) -> float:
    """The float32 nearest the exact rational ``q > 0`` (ties to even mantissa), inf past float32's range, by
    exact comparison with its two float32 neighbours (no floating-point division involved)."""
    top = Fraction(torch.finfo(torch.float32).max)
    if q > top:  # round-to-nearest overflows at max + half an ulp of the top binade
        return math.inf if q >= top + Fraction(2) ** 103 else float(top)
    guess = torch.tensor(float(q), dtype=torch.float32)  # within an ulp or two of the answer
    below = guess
    while Fraction(below.item()) > q:
        below = torch.nextafter(below, torch.tensor(0.0))
    while Fraction(torch.nextafter(below, torch.tensor(math.inf)).item()) <= q:
        below = torch.nextafter(below, torch.tensor(math.inf))
    above = torch.nextafter(below, torch.tensor(math.inf))
    low, high = Fraction(below.item()), Fraction(above.item())
    if q - low != high - q:
        return below.item() if q - low < high - q else above.item()
    return below.item() if below.view(torch.int32).item() % 2 == 0 else above.item()
