"""Per-tensor quantization, float8 decoding and the GEMM operand: the reference implementations, and the ground
truth for ``kernels/`` (MXFP8 block scaling is in :mod:`fp8_lightning.mx`).

Per-tensor (delayed and tensorwise scaling), following TransformerEngine's convention::

    scale = fp8_max / amax                  (a multiplier: larger scale, finer resolution)
    data  = saturate(x * scale)             (clamp to +-fp8_max *before* the cast, then round to nearest even)
    x    ~= data * (1 / scale)

Saturation is explicit because casts disagree on overflow: the CPU cast saturates E4M3 but turns large E5M2
values into inf, and the Triton interpreter produces NaN. Every function computes in float32 (float64 inputs
stay float64) so that the result does not depend on the input dtype's rounding.

On CUDA, ``amax``, ``quantize_with_scale`` and ``quantize_tensorwise`` hand float32/bf16/fp16 tensors to the Triton
kernels of ``fp8_lightning.kernels`` (same bits, fewer passes) when Triton is usable and
``FP8_LIGHTNING_DISABLE_TRITON`` is not set (:func:`cuda_kernels`). On CPU the casts and decoding of float32/bf16
tensors go to the fused C functions of ``fp8_lightning.kernels.cpu_codec`` (same bits, one pass) when a C compiler
built them and ``FP8_LIGHTNING_DISABLE_CPU_CODEC`` is not set (:func:`cpu_codec`). The code below is the reference
for both.
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


def cuda_kernels(x: torch.Tensor):
    """``fp8_lightning.kernels`` for a CUDA tensor the Triton kernels take, else None (always None on CPU)."""
    if not x.is_cuda:
        return None
    from fp8_lightning.kernels.availability import kernels_for

    kernels = kernels_for(x)
    return kernels if kernels is not None and kernels.supports_input(x) else None


_codec_module = None  # fp8_lightning.kernels.cpu_codec, imported on first use (the kernels package imports this one)


def cpu_codec(x: torch.Tensor | None = None):
    """``fp8_lightning.kernels.cpu_codec`` when it is built and enabled, for a CPU tensor ``x`` it takes
    (float32/bf16 input to quantize; any tensor with ``x=None``), else None. Never while ``torch.compile`` traces
    (the codec reads raw memory), nor for tensor subclasses (FSDP2's FP8 weights, DTensor), which may have no
    memory of their own to read."""
    global _codec_module
    if x is not None and x.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    if _codec_module is None:
        from fp8_lightning.kernels import cpu_codec as _codec_module
    codec = _codec_module
    if x is not None and (type(x) not in codec.PLAIN_TYPES or x.dtype not in codec.INPUT_DTYPES):
        return None
    return codec if codec.enabled() else None


def to_fp8_saturated(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Clamp to the finite range of ``dtype`` and cast (round to nearest even). NaN stays NaN.

    The CPU cast to E4M3 saturates by itself (infinities included; ``tests/core/test_formats_bits.py`` holds it to
    that), so the clamp, a full pass over the tensor, is skipped there."""
    if dtype == torch.float8_e4m3fn and x.device.type == "cpu":
        return x.to(dtype)
    limit = fp8_max(dtype)
    return x.clamp(-limit, limit).to(dtype)


def amax(x: torch.Tensor) -> torch.Tensor:
    """Max of |x| as a float32 scalar tensor (0 for an empty tensor). NaN in x gives NaN."""
    return amax_and_value(x)[0]


def amax_reference(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a float32 scalar (NaN when x holds NaN; 0 for an empty x) in plain tensor operations: what a
    traced step writes and what devices without a kernel compute."""
    if x.numel() == 0:
        return x.new_zeros((), dtype=torch.float32)
    return x.detach().abs().amax().float()


def is_transposed_2d(t: torch.Tensor) -> bool:
    """Whether ``t`` is the transposed view of a contiguous 2-D tensor (a columnwise copy quantized in place)."""
    return t.dim() == 2 and not t.is_contiguous() and t.t().is_contiguous()


def amax_and_value(x: torch.Tensor) -> tuple[torch.Tensor, float | None]:
    """:func:`amax`, and its value as a Python float where reading it costs no device synchronisation (CPU; else
    None). On CPU one ``aminmax`` pass gives both ends; the larger magnitude is picked on the host."""
    on_cpu = x.device.type == "cpu"
    if x.numel() == 0:
        return amax_reference(x), (0.0 if on_cpu else None)
    kernels = cuda_kernels(x)
    if kernels is not None:
        return kernels.amax(x.detach()), None
    if not on_cpu:
        return amax_reference(x), None
    low, high = torch.aminmax(x.detach())
    lo, hi = low.item(), high.item()
    top, value = (high, hi) if math.isnan(hi) or hi >= -lo else (low.neg(), -lo)  # NaN anywhere: both ends NaN
    if top.dtype != torch.float32:
        top = top.float()
        value = top.item()
    return top, value


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


def _one_float32_scale(scale) -> bool:
    return torch.is_tensor(scale) and scale.dtype == torch.float32 and scale.numel() == 1


def cast_codec(x: torch.Tensor, scale):
    """The CPU codec when it can cast ``x`` with ``scale`` (a float32/bf16 CPU tensor, one float32 CPU scale),
    else None."""
    return cpu_codec(x) if _one_float32_scale(scale) and scale.device.type == "cpu" else None


def quantize_with_scale(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, saturate: bool = True
) -> torch.Tensor:
    """``saturate(x * scale)`` in the float8 ``dtype``. ``saturate=False``: the caller knows no value exceeds the
    format's range by more than the cast rounds away (the clamp is skipped)."""
    kernels, codec = cuda_kernels(x), cast_codec(x, scale)
    if kernels is not None and _one_float32_scale(scale):
        return kernels.cast(x.detach(), scale.to(x.device), dtype, record_amax=False)[0]
    if codec is not None:
        return codec.cast(x, scale.item(), dtype)[0]  # saturates always: equal bits when the caller skips it
    scaled = wide(x) * scale
    return to_fp8_saturated(scaled, dtype) if saturate else scaled.to(dtype)


def quantize_operand(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, saturate: bool = True, nan_free: bool = False
) -> "Quantized":
    """:func:`quantize_with_scale` as a GEMM operand. On CPU with the codec, the codes' float32 values (what the
    CPU GEMM multiplies) come from the same pass and ride on the operand."""
    codec = cast_codec(x, scale)
    if codec is not None:
        data, values, _ = codec.cast(x, scale.item(), dtype)
        return Quantized(data, scale, "tensor", values, nan_free)
    return Quantized(quantize_with_scale(x, scale, dtype, saturate), scale, "tensor", nan_free=nan_free)


_DECODE_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
_TABLE_DECODE_BELOW = 16384  # elements; measured crossover of the two E4M3 decodes on one CPU thread


def _decode_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The float32 value of each of the 256 codes of a float8 ``dtype`` (built once per dtype and device)."""
    key = (dtype, device)
    if key not in _DECODE_TABLES:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
        _DECODE_TABLES[key] = codes.float().to(device)
    return _DECODE_TABLES[key]


def fp8_to_float32(data: torch.Tensor, nan_free: bool = False) -> torch.Tensor:
    """``data.float()``, bit for bit, for any tensor; float8 on CPU is decoded with vectorized integer operations.

    The CPU cast from float8 converts element by element (about 4 ns each, more than a float32 matmul of the
    same operand at small sizes). Both common formats are a float16 in disguise:

    * E5M2 is the upper byte of a float16 (same exponent bias): shift it up by 8 bits.
    * E4M3 ``s eeee mmm`` shifted up by 7 bits is the float16 ``s 0eeee mmm0000000``, whose value is the E4M3
      value times 2**-8 (float16's exponent bias is 15, E4M3's 7; the subnormals line up as well). E4M3 has no
      infinity and its NaN codes (0x7F, 0xFF) would decode as 480: data holding them goes through a 256-entry
      table instead, as do tensors under 16K elements (one gather beats five small operations there).
      ``nan_free=True`` (the caller knows there are none) skips looking for NaN codes.

    Both give exactly the values of ``data.float()`` several times faster; the CPU codec (when built) does it in
    one pass. A transposed 2-D view is decoded through its contiguous base and stays a transposed view.
    """
    if data.device.type != "cpu" or data.dtype.itemsize != 1 or not data.is_floating_point():
        return data.float()
    if is_transposed_2d(data):
        return fp8_to_float32(data.t(), nan_free).t()
    codec = cpu_codec()
    if codec is not None and data.dtype in codec.FORMATS:
        return codec.decode(data)  # one vectorized pass, any size
    codes = data.contiguous().view(torch.uint8)
    if data.dtype == torch.float8_e5m2:
        return codes.to(torch.int16).mul_(256).view(torch.float16).float()
    small = codes.numel() < _TABLE_DECODE_BELOW  # a gather costs fewer operations; the shifts win on more data
    if data.dtype == torch.float8_e4m3fn and not small and (nan_free or (codes & 0x7F).max() < 0x7F):
        sign_extended = codes.view(torch.int8).to(torch.int16)  # bits 15..8 all copy the sign bit
        half = sign_extended.bitwise_left_shift_(7).bitwise_and_(~0x4000)  # drop the copy that lands in bit 14
        return half.view(torch.float16).float().mul_(256.0)
    flat = codes.reshape(-1).to(torch.int64)  # int64 indices: index_select slows down badly with int32 ones
    return _decode_table(data.dtype, data.device).index_select(0, flat).view(data.shape)


def dequantize_with_scale(
    data: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``data * (1 / scale)`` in ``out_dtype`` (the inverse of :func:`quantize_with_scale`)."""
    return (fp8_to_float32(data) * scale.float().reciprocal()).to(out_dtype)


def quantize_tensorwise(
    x: torch.Tensor, fp8_format: "Format | str | torch.dtype" = Format.E4M3, eps: float = 1e-12
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor current scaling. Returns ``(data, scale)`` with ``data = saturate(x * scale)``.

    ``fp8_format`` is a float8 dtype or a :class:`Format` (HYBRID means its forward dtype, E4M3).
    """
    _check_floating(x, "quantize_tensorwise")
    dtype = fp8_dtype(fp8_format)
    kernels = cuda_kernels(x)
    if kernels is not None:
        return kernels.tensorwise_cast(x.detach(), dtype, eps)
    scale = tensorwise_scale(amax(x), dtype, eps)
    return quantize_with_scale(x, scale, dtype), scale


def dequantize_tensorwise(
    data: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_tensorwise`."""
    return dequantize_with_scale(data, scale, out_dtype)


# --------------------------------------------------------------------------------------------------------
# A quantized operand, as the GEMMs consume it
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Quantized:
    """An FP8 GEMM operand whose *last* dimension is the reduction dimension K.

    ``scale`` is the per-tensor multiplier (``kind="tensor"``, data = x * scale) or the E8M0 block scales
    (``kind="mx"``, x = data * scale); ``kind="row"`` / ``"block"`` hold float32 multipliers per row / per tile
    (data = x * scale, :mod:`fp8_lightning.rowwise`, :mod:`fp8_lightning.blockwise`) and ``"hp"`` an unquantized
    tensor.
    """

    data: torch.Tensor
    scale: torch.Tensor
    kind: str = "tensor"
    # The float32 matrix a CPU float GEMM multiplies, made by the CPU codec's cast or on first use, and kept for the
    # operand's other GEMMs: the codes' exact values for per-tensor scaling (the scales multiply the product), the
    # dequantized values for MX.
    f32: torch.Tensor | None = dataclasses.field(default=None, repr=False, compare=False)
    nan_free: bool = dataclasses.field(default=False, repr=False, compare=False)  # known to hold no NaN code
    inverse: torch.Tensor | None = dataclasses.field(default=None, repr=False, compare=False)  # see inverse_scale
    # ``data.T`` as a contiguous copy, when the cast wrote one (CUDA): the layout a scaled GEMM needs for the
    # operand's transposed uses, which :meth:`t` then hands out instead of a view to copy.
    transposed: torch.Tensor | None = dataclasses.field(default=None, repr=False, compare=False)

    def inverse_scale(self) -> torch.Tensor:
        """``1 / scale`` (per-tensor: the dequantization factor a scaled GEMM takes), made on the first call and
        kept for the operand's other GEMM: on a GPU each computation is a kernel launch."""
        if self.inverse is None:
            self.inverse = self.scale.reciprocal()
        return self.inverse

    def gemm_f32(self) -> torch.Tensor:
        """The operand in float32 for a float GEMM (see ``f32``), made on the first call."""
        if self.f32 is None:
            self.f32 = fp8_to_float32(self.data, self.nan_free) if self.kind == "tensor" else self._mx_values()
        return self.f32

    def dequantize(self, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.kind != "tensor":
            return (self.f32 if self.f32 is not None else self._mx_values()).to(out_dtype)
        return dequantize_with_scale(self.data, self.scale, out_dtype)

    def _mx_values(self) -> torch.Tensor:
        """The dequantized values of a block-scaled operand (MX, rowwise, blockwise)."""
        if self.kind != "mx":
            from fp8_lightning.fine_grained import fine_dequantize  # builds on this module

            return fine_dequantize(self)
        from fp8_lightning.mx import dequantize_mxfp8  # mx builds on this module

        return dequantize_mxfp8(self.data, self.scale)

    def t(self) -> "Quantized":
        """``q.T``: the contiguous transposed copy when there is one, else a view of the same FP8 bytes
        (per-tensor operands only; a GEMM copies a view if it must).
        Block-scaled operands (MX, rowwise, blockwise) cannot be transposed: their scales follow K, so quantize the
        high-precision tensor (or, for 128x128 blocks, transpose data and scales together)."""
        if self.kind != "tensor":
            raise ValueError(
                f"A {self.kind!r} operand cannot be transposed: its scales follow K, so quantize the high-precision "
                "tensor along the new K."
            )
        f32 = None if self.f32 is None else self.f32.t()
        data, transposed = (self.data.t(), None) if self.transposed is None else (self.transposed, self.data)
        return Quantized(data, self.scale, self.kind, f32, self.nan_free, self.inverse, transposed)

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()


def pad_dim(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """Zero-pad dimension ``dim`` up to a multiple of ``multiple`` (works for float8 via a uint8 view)."""
    size = t.shape[dim]
    extra = (-size) % multiple
    if extra == 0:
        return t
    dim = dim % t.dim()
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, extra]
    if t.dtype.itemsize == 1 and t.is_floating_point():
        return F.pad(t.view(torch.uint8), pad).view(t.dtype)  # 0x00 is +0.0 in every float8 format
    return F.pad(t, pad)


def _check_floating(x: torch.Tensor, what: str) -> None:
    if not torch.is_tensor(x) or not x.is_floating_point():
        got = f"a tensor of dtype {x.dtype}" if torch.is_tensor(x) else type(x).__name__
        raise TypeError(f"{what} expects a floating-point tensor; got {got}. Cast it with .float() first.")
