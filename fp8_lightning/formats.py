"""FP8 formats: which torch dtype each GEMM operand uses, and the numeric limits of each dtype.

Two 8-bit floating-point encodings are in use (OCP FP8):

* E4M3 (``torch.float8_e4m3fn``): 4 exponent bits, 3 mantissa bits, max 448, a NaN but no infinity.
  More precision, less range: the forward operands (activations and weights).
* E5M2 (``torch.float8_e5m2``): 5 exponent bits, 2 mantissa bits, max 57344, infinities.
  More range, less precision: gradients, whose dynamic range is wider.

A :class:`Format` names the *policy*: E4M3 everywhere, E5M2 everywhere, or HYBRID (E4M3 in the forward pass,
E5M2 for the output gradient in the backward pass), the default of every recipe, following TransformerEngine.
"""

from __future__ import annotations

import enum

import torch

E4M3_DTYPE = torch.float8_e4m3fn
E5M2_DTYPE = torch.float8_e5m2
FP8_DTYPES = (E4M3_DTYPE, E5M2_DTYPE)

# Largest finite value and the exponent of the largest binade (emax_elem in the OCP MX specification).
_MAX = {E4M3_DTYPE: 448.0, E5M2_DTYPE: 57344.0}
_EMAX = {E4M3_DTYPE: 8, E5M2_DTYPE: 15}
# Smallest positive normal value: 2**(1 - bias).
_MIN_NORMAL = {E4M3_DTYPE: 2.0**-6, E5M2_DTYPE: 2.0**-14}
# Smallest positive subnormal value.
_MIN_SUBNORMAL = {E4M3_DTYPE: 2.0**-9, E5M2_DTYPE: 2.0**-16}

# NVIDIA compute capabilities with FP8 hardware, one definition for every device check:
FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores and conversions (Ada, Hopper, Blackwell)
NATIVE_MX_MIN_CAPABILITY = (10, 0)  # cuBLAS's 1x32 block-scaled (MX) GEMM (Blackwell) ...
NATIVE_MX_MIN_CUDA = (12, 8)  # ... in cuBLAS 12.8 on (VEC32_UE8M0 scales)
BLOCKWISE_CAPABILITY_MAJOR = 9  # cuBLAS's 1x128 / 128x128 block-scaled GEMM (Hopper only)


class Format(str, enum.Enum):
    """Which FP8 dtype the forward operands and the backward (gradient) operand use."""

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"

    @property
    def forward_dtype(self) -> torch.dtype:
        """dtype of activations and weights (the forward GEMM operands)."""
        return E5M2_DTYPE if self is Format.E5M2 else E4M3_DTYPE

    @property
    def backward_dtype(self) -> torch.dtype:
        """dtype of the output gradient (the operand that only the backward GEMMs see)."""
        return E4M3_DTYPE if self is Format.E4M3 else E5M2_DTYPE

    @classmethod
    def parse(cls, value: "Format | str | torch.dtype") -> "Format":
        """Accept a Format, its name in any case (``"hybrid"``), or a float8 torch dtype."""
        if isinstance(value, Format):
            return value
        if isinstance(value, torch.dtype):
            if value == E4M3_DTYPE:
                return cls.E4M3
            if value == E5M2_DTYPE:
                return cls.E5M2
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        allowed = ", ".join(cls.__members__)
        raise ValueError(f"fp8_format={value!r} is not an FP8 format; allowed: {allowed} (any case).")


def fp8_dtype(value: "Format | str | torch.dtype") -> torch.dtype:
    """The single dtype a low-level cast uses: a float8 dtype as given, or a format's forward dtype."""
    if isinstance(value, torch.dtype):
        check_fp8_dtype(value)
        return value
    return Format.parse(value).forward_dtype


def check_fp8_dtype(dtype: torch.dtype) -> None:
    if dtype not in FP8_DTYPES:
        raise ValueError(f"dtype={dtype} is not a supported FP8 dtype; allowed: {FP8_DTYPES}.")


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of a float8 dtype (448 for E4M3, 57344 for E5M2)."""
    check_fp8_dtype(dtype)
    return _MAX[dtype]


def fp8_emax(dtype: torch.dtype) -> int:
    """Exponent of the largest binade (8 for E4M3, 15 for E5M2), used by the MX "floor" scale rule."""
    check_fp8_dtype(dtype)
    return _EMAX[dtype]


def fp8_min_normal(dtype: torch.dtype) -> float:
    """Smallest positive normal value; below it values are subnormal and lose precision."""
    check_fp8_dtype(dtype)
    return _MIN_NORMAL[dtype]


def fp8_min_subnormal(dtype: torch.dtype) -> float:
    """Smallest positive representable value; smaller magnitudes flush to zero."""
    check_fp8_dtype(dtype)
    return _MIN_SUBNORMAL[dtype]
