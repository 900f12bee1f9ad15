"""Per-tensor quantization, float8 decoding and the GEMM operand: the reference implementations, and the ground
truth for ``kernels/`` (MXFP8 block scaling is in :mod:`fp8_lightning.mx`).

Per-tensor (delayed and tensorwise scaling), following TransformerEngine's convention::

    scale = fp8_max / amax                  (a multiplier: larger scale, finer resolution)
    data  = saturate(x * scale)             (clamp to +-fp8_max *before* the cast, then round to nearest even)
    x    ~= data * (1 / scale)

Saturation is explicit because casts disagree on overflow: the CPU cast saturates E4M3 but turns large E5M2
values into inf, and the Triton interpreter produces NaN. Every function computes in float32 (float64 inputs
stay float64) so that the result does not depend on the input dtype's rounding.

Plain PyTorch with no device or backend branches: :mod:`fp8_lightning.ops.dispatch` runs the same operations on the
Triton kernels (CUDA) or the C codec (CPU), with the same bits, and is what the layer calls.
"""

from __future__ import annotations

import dataclasses
import math
import struct

import torch
import torch.nn.functional as F

from fp8_lightning.formats import Format, fp8_dtype, fp8_max

FLOAT32_MAX = torch.finfo(torch.float32).max


def wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32, or float64 when it is float64: the precision every cast computes in."""
    return x if x.dtype == torch.float64 else x.float()


def to_fp8_saturated(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Clamp to the finite range of ``dtype`` and cast (round to nearest even). NaN stays NaN."""
    limit = fp8_max(dtype)
    return x.clamp(-limit, limit).to(dtype)


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a float32 scalar (NaN when x holds NaN; 0 for an empty x)."""
    if x.numel() == 0:
        return x.new_zeros((), dtype=torch.float32)
    return x.detach().abs().amax().float()


def is_transposed_2d(t: torch.Tensor) -> bool:
    """Whether ``t`` is the transposed view of a contiguous 2-D tensor (a columnwise copy quantized in place)."""
    return t.dim() == 2 and not t.is_contiguous() and t.t().is_contiguous()


def round_scale_to_power_of_2(scale: torch.Tensor) -> torch.Tensor:
    """Largest power of two <= scale (exact, via frexp); keeps x*scale within range after rounding down."""
    mantissa, exponent = torch.frexp(scale)
    return torch.ldexp(torch.ones_like(mantissa), exponent - 1)


def max_over_amax(max_value: float | torch.Tensor, amax_value: torch.Tensor) -> torch.Tensor:
    """``max_value / amax`` rounded once to float32, capped at float32 max: the scale of every recipe.

    Divided in float64, where the quotient of two float32 numbers rounds to the float32 nearest the exact one
    (53 >= 2 * 24 + 2 bits), in eager and compiled code alike: torchao divides the same way and TransformerEngine
    with an IEEE float32 division, so all three give the same bits. Torch's ``float / tensor`` would round twice
    (``reciprocal(amax) * max``) and can land one unit in the last place away.
    """
    amax64 = amax_value.double()
    top = max_value.double() if torch.is_tensor(max_value) else torch.full_like(amax64, max_value)
    return torch.clamp((top / amax64).float(), max=FLOAT32_MAX)


def tensorwise_scale(
    amax_value: torch.Tensor, dtype: torch.dtype, eps: float = 1e-12, power_of_2: bool = False
) -> torch.Tensor:
    """Current scaling: ``fp8_max / max(amax, eps)`` (:func:`max_over_amax`; eps rounded to float32)."""
    scale = max_over_amax(fp8_max(dtype), torch.clamp(amax_value.float(), min=eps))
    return round_scale_to_power_of_2(scale) if power_of_2 else scale


def current_scale(
    amax_value: torch.Tensor, dtype: torch.dtype, eps: float = 1e-12, power_of_2: bool = False
) -> torch.Tensor:
    """The scale a stateless cast takes from its own amax: :func:`tensorwise_scale`, and 1 where the amax is inf or
    NaN (TransformerEngine's rule): infinities saturate to +-fp8_max, NaN stays NaN, finite values keep scale 1.

    Args:
        amax_value: the amax (any shape: one scale per element).
        dtype: the float8 dtype cast to.
        eps: the smallest amax a scale is computed from.
        power_of_2: round each scale down to a power of two.

    Returns:
        float32 scales shaped like ``amax_value``.
    """
    scale = tensorwise_scale(amax_value, dtype, eps, power_of_2)
    return torch.where(torch.isfinite(amax_value), scale, torch.ones_like(scale))


def tensorwise_scale_value(
    amax_value: float, dtype: torch.dtype, eps: float = 1e-12, power_of_2: bool = False
) -> float:
    """:func:`tensorwise_scale` of an amax known on the host, in Python floats with the same roundings: ``clamp``
    against eps rounded to float32, then the float64 quotient rounded to float32. Equal bit for bit
    (``tests/core/test_quantize.py``); on CPU it replaces several tensor operations on a scalar, each of which
    costs more than the arithmetic."""
    clamped = max(_float32(amax_value), _float32(eps))
    scale = math.inf if clamped == 0 else fp8_max(dtype) / clamped
    scale = min(_float32(scale), FLOAT32_MAX)
    return 2.0 ** (math.frexp(scale)[1] - 1) if power_of_2 else scale


def _float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (overflowing to inf), as a Python float."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def quantize_with_scale(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, saturate: bool = True
) -> torch.Tensor:
    """``saturate(x * scale)`` in the float8 ``dtype``. ``saturate=False``: the caller knows no value exceeds the
    format's range by more than the cast rounds away (the clamp is skipped)."""
    scaled = wide(x) * scale
    return to_fp8_saturated(scaled, dtype) if saturate else scaled.to(dtype)


def fp8_to_float32(data: torch.Tensor) -> torch.Tensor:
    """The float32 value of each float8 code (exact: every float8 value is a float32 value)."""
    return data.float()


def dequantize_with_scale(
    data: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``data * (1 / scale)`` in ``out_dtype`` (the inverse of :func:`quantize_with_scale`)."""
    return (fp8_to_float32(data) * scale.float().reciprocal()).to(out_dtype)


def quantize_tensorwise(
    x: torch.Tensor, fp8_format: "Format | str | torch.dtype" = Format.E4M3, eps: float = 1e-12
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor current scaling. Returns ``(data, scale)`` with ``data = saturate(x * scale)``.

    ``fp8_format`` is a float8 dtype or a :class:`Format` (HYBRID means its forward dtype, E4M3). An input holding
    inf or NaN gets scale 1 (:func:`current_scale`).
    """
    _check_floating(x, "quantize_tensorwise")
    dtype = fp8_dtype(fp8_format)
    scale = current_scale(amax(x), dtype, eps)
    return quantize_with_scale(x, scale, dtype), scale


def dequantize_tensorwise(
    data: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_tensorwise`."""
    return dequantize_with_scale(data, scale, out_dtype)


# --------------------------------------------------------------------------------------------------------
# A quantized operand, as the GEMMs consume it
# --------------------------------------------------------------------------------------------------------


class OperandKind(str):
    """What an operand's scale means, as a type: ``"tensor"`` (one multiplier), ``"row"`` (one per row along K),
    ``"block"`` (one per 1x128 / 128x128 tile), ``"mx"`` (E8M0 per block of K) or ``"hp"`` (not quantized).

    A kind is declared here, below every backend, so that casts anywhere can mark what they made; the recipe module
    that makes operands of a kind gives it its behaviour with :meth:`implement` (its GEMM, its float32 form, what
    its statistics read). The rest of the code calls those methods and never compares kinds. A kind is a ``str``
    (its name), so it crosses ``torch.library`` op boundaries as one; :meth:`named` gives the kind of a name back.
    """

    _declared: dict[str, "OperandKind"] = {}

    def __new__(cls, name: str, transposable: bool = False):
        if name in cls._declared:
            raise ValueError(f"operand kind {name!r} is declared already; use OperandKind.named({name!r}).")
        kind = super().__new__(cls, name)
        kind.transposable = transposable  # one scale for the whole tensor: its transpose is a view of the bytes
        kind.name = str(name)  # a plain str, for code torch.compile traces (torch 2.11 cannot call str() on a kind)
        cls._declared[name] = kind
        return kind

    @classmethod
    def named(cls, name: "str | OperandKind") -> "OperandKind":
        """The declared kind called ``name``."""
        if isinstance(name, OperandKind):
            return name
        try:
            return cls._declared[name]
        except KeyError:
            raise ValueError(f"operand kind {name!r} is unknown; declared: {sorted(cls._declared)}.") from None

    def implement(
        self, gemm, to_f32, dequantize, scale_multiplier, representative_scale, value_limits=None, code_values=None,
        traced_cache=None,
    ) -> None:
        """Give the kind its behaviour (once, from the recipe module that makes it):

        * ``gemm(a, b, out_dtype, emulate, bias, fast_accum)``: ``a @ b.T (+ bias)`` of two operands of the kind;
        * ``to_f32(q)``: the float32 matrix a CPU float GEMM multiplies (codes or dequantized values);
        * ``dequantize(q, out_dtype)``: the high-precision values the operand stands for;
        * ``scale_multiplier(q, k)``: each element's factor before the cast, broadcastable to ``q.data[..., :k]``;
        * ``representative_scale(q)``: one number for the operand's scale (its smallest multiplier);
        * ``value_limits(q)`` (optional): (largest code value, the scaled magnitude above which the cast saturated),
          by default the float8 dtype's (:func:`float8_limits`);
        * ``code_values(q)`` (optional): each element's code value in float32, by default ``q.data`` as float32;
        * ``traced_cache(extra)`` (optional): the cache of an operand the traced step's GEMM op rebuilds from the
          extra tensor its cast handed out, by default ``OperandCache(inverse=extra)`` (its ``1 / scale``).
        """
        # instance attributes: a call goes straight to the implementation (the GEMM is on the hot path)
        self.gemm, self.to_f32, self.dequantize = gemm, to_f32, dequantize
        self.scale_multiplier, self.representative_scale = scale_multiplier, representative_scale
        if value_limits is not None:
            self.value_limits = value_limits
        if code_values is not None:
            self.code_values = code_values
        if traced_cache is not None:
            self.traced_cache = traced_cache

    def value_limits(self, q: "Quantized") -> tuple[float, float]:
        return float8_limits(q.data.dtype)

    def code_values(self, q: "Quantized") -> torch.Tensor:
        return q.data.float()

    def traced_cache(self, extra: torch.Tensor | None) -> "OperandCache":
        return OperandCache(inverse=extra)

    def _unimplemented(self, *args, **kwargs):
        raise NotImplementedError(
            f"operand kind {str(self)!r} has no behaviour: the recipe module that makes it must call "
            "OperandKind.implement (import fp8_lightning.recipes)."
        )

    gemm = to_f32 = dequantize = scale_multiplier = representative_scale = _unimplemented

    def __reduce__(self):
        return (OperandKind.named, (str(self),))

    __hash__ = str.__hash__


def float8_limits(dtype: torch.dtype) -> tuple[float, float]:
    """(max, saturation threshold) of a float8 ``dtype``: a scaled magnitude above ``max + ulp / 2`` (half a step of
    the top binade) was changed by the clamp before the cast; exactly ``max`` or a rounding step above it was not."""
    top = fp8_max(dtype)
    ulp = 2.0 ** math.floor(math.log2(top)) * torch.finfo(dtype).eps
    return top, top + ulp / 2


TENSOR = OperandKind("tensor", transposable=True)
ROW = OperandKind("row")
BLOCK = OperandKind("block")
MX = OperandKind("mx")
HIGH_PRECISION = OperandKind("hp")


@dataclasses.dataclass
class OperandCache:
    """What is known about an operand's codes, or derived from them, kept apart from the codes themselves.

    A cast or the operand's first GEMM fills it; the operand's other GEMMs reuse it. None of it changes the operand's
    values: dropping the cache costs time, never bits.
    """

    # The float32 matrix a CPU float GEMM multiplies (``dispatch.operand_f32``): the codes' exact values for per-tensor
    # and rowwise scaling (the scales multiply the product), the dequantized values for MX and blockwise.
    f32: torch.Tensor | None = None
    nan_free: bool = False  # known to hold no NaN code
    inverse: torch.Tensor | None = None  # ``1 / scale``: see Quantized.inverse_scale
    # ``data.T`` as a contiguous copy, when the cast wrote one (CUDA): the layout a scaled GEMM needs for the
    # operand's transposed uses, which Quantized.t then hands out instead of a view to copy.
    transposed: torch.Tensor | None = None
    # MX or NVFP4 block scales in cuBLAS's swizzled layout, made by the first native GEMM that reads the operand
    # (``gemm.swizzled_scales``, ``nvfp4_gemm``) and kept for its later GEMMs (the cached weight's: once per
    # optimizer step).
    swizzled: torch.Tensor | None = None
    # ``data`` is a transposed copy that a cast wrote (handed out by Quantized.t) where a cast without one hands out
    # a transposed view: a CPU float GEMM reads it in the view's layout, so its bits (MKL sums transposed inputs in
    # another order) do not depend on whether a kernel wrote the copy.
    from_copy: bool = False
    # What a native GEMM reads besides ``data`` and ``scale`` where ``scale`` cannot give it back: an NVFP4 cast's E4M3
    # block scales and float32 global scale (``scale`` holds their rounded product; :mod:`fp8_lightning.nvfp4_gemm`).
    # Without it such an operand's GEMM is emulated.
    native: torch.Tensor | None = None

    def for_backward(self, keep_f32: bool) -> "OperandCache":
        """The part worth saving for the backward GEMMs: the small facts, and the float32 form only when asked
        (a weight's, made once per optimizer step; an activation's would double the saved bytes)."""
        return OperandCache(self.f32 if keep_f32 else None, self.nan_free, self.inverse, from_copy=self.from_copy,
                            native=self.native)


@dataclasses.dataclass
class Quantized:
    """An FP8 GEMM operand whose *last* dimension is the reduction dimension K.

    ``scale`` is the per-tensor multiplier (``kind=TENSOR``, data = x * scale) or the E8M0 block scales
    (``kind=MX``, x = data * scale); ``ROW`` / ``BLOCK`` hold float32 multipliers per row / per tile
    (data = x * scale, :mod:`fp8_lightning.rowwise`, :mod:`fp8_lightning.blockwise`) and ``HIGH_PRECISION`` an
    unquantized tensor (:class:`OperandKind`; a kind's name is accepted and turned into the kind). ``cache`` holds
    what was derived from them (:class:`OperandCache`).
    """

    data: torch.Tensor
    scale: torch.Tensor
    # The defaults are None, not a kind or a cache: torch.compile (2.11) cannot trace a default that is an object
    kind: OperandKind = None  # type: ignore[assignment]  # TENSOR
    cache: OperandCache = dataclasses.field(default=None, repr=False, compare=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.kind is None:
            self.kind = TENSOR
        elif type(self.kind) is not OperandKind:
            self.kind = OperandKind.named(self.kind)
        if self.cache is None:  # not a default_factory: torch.compile cannot trace one
            self.cache = OperandCache()

    def inverse_scale(self) -> torch.Tensor:
        """``1 / scale`` (per-tensor: the dequantization factor a scaled GEMM takes), made on the first call and
        kept for the operand's other GEMM: on a GPU each computation is a kernel launch."""
        cache = self.cache
        if cache.inverse is None:
            cache.inverse = self.scale.reciprocal()
        return cache.inverse

    def t(self) -> "Quantized":
        """``q.T``: the contiguous transposed copy when there is one, else a view of the same FP8 bytes
        (per-tensor operands only; a GEMM copies a view if it must).
        Block-scaled operands (MX, rowwise, blockwise) cannot be transposed: their scales follow K, so quantize the
        high-precision tensor (or, for 128x128 blocks, transpose data and scales together)."""
        if not self.kind.transposable:
            raise ValueError(
                f"A {self.kind!r} operand cannot be transposed: its scales follow K, so quantize the high-precision "
                "tensor along the new K."
            )
        cache = self.cache
        f32 = None if cache.f32 is None else cache.f32.t()
        if cache.transposed is None:
            return Quantized(self.data.t(), self.scale, self.kind, OperandCache(f32, cache.nan_free, cache.inverse))
        swapped = OperandCache(f32, cache.nan_free, cache.inverse, self.data, from_copy=not cache.from_copy)
        return Quantized(cache.transposed, self.scale, self.kind, swapped)

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()


LAYOUT_MULTIPLE = 16  # torch._scaled_mm on CUDA: K and N in multiples of 16


def row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a row-major tensor (itself when it is one): ``contiguous()`` by ``clone``, which fake tensors
    support."""
    return t if t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)


def scaled_mm_layout(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 data of ``a @ b.T`` (``a``: (M, K), ``b``: (N, K)) as ``torch._scaled_mm`` takes it: ``a`` row-major
    with K zero-padded to :data:`LAYOUT_MULTIPLE`, and ``b`` row-major with K and N padded (so that ``b.T``, the
    GEMM's second operand, is column-major). Zeros add nothing to a sum; padded output columns are cut after."""
    padded_b = pad_2d(row_major(b), LAYOUT_MULTIPLE, LAYOUT_MULTIPLE)
    return pad_dim(row_major(a), -1, LAYOUT_MULTIPLE), padded_b


def pad_dim(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """Zero-pad dimension ``dim`` up to a multiple of ``multiple`` (works for float8 via a uint8 view)."""
    return _pad(t, {dim % t.dim(): multiple})


def pad_2d(t: torch.Tensor, row_multiple: int, col_multiple: int) -> torch.Tensor:
    """Zero-pad the last two dimensions up to multiples of ``row_multiple`` and ``col_multiple`` in one pass (one
    kernel on a GPU, where padding one dimension after the other is two)."""
    return _pad(t, {t.dim() - 2: row_multiple, t.dim() - 1: col_multiple})


def _pad(t: torch.Tensor, multiples: dict[int, int]) -> torch.Tensor:
    """Zero-pad each dimension ``d`` of ``multiples`` up to a multiple of ``multiples[d]``, in one ``F.pad``."""
    extras = {d: (-t.shape[d]) % m for d, m in multiples.items()}
    if not any(extras.values()):
        return t
    pad = [side for d in range(t.dim() - 1, min(multiples) - 1, -1) for side in (0, extras.get(d, 0))]  # last first
    if t.dtype.itemsize == 1 and t.is_floating_point():
        return F.pad(t.view(torch.uint8), pad).view(t.dtype)  # 0x00 is +0.0 in every float8 format
    return F.pad(t, pad)


def _check_floating(x: torch.Tensor, what: str) -> None:
    if not torch.is_tensor(x) or not x.is_floating_point():
        got = f"a tensor of dtype {x.dtype}" if torch.is_tensor(x) else type(x).__name__
        raise TypeError(f"{what} expects a floating-point tensor; got {got}. Cast it with .float() first.")
