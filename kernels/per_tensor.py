"""Per-tensor FP8 casts in Triton: amax, tensorwise (current) scaling, delayed scaling with amax recording.

The pure-torch twins live in :mod:`fp8_lightning.quantize` (``amax``, ``tensorwise_scale``,
``quantize_with_scale``); these kernels compute the same bits with fewer passes over the tensor:

* **tensorwise** needs the amax of the whole tensor before the first element can be cast, so it is two passes
  (the minimum): :func:`launch_amax` (one read), then :func:`tensorwise_cast`'s cast kernel, which derives the scale
  from the amax itself (no host round trip, no extra launches) and writes it out once.
* **delayed** scaling already knows its scale, so :func:`cast` reads once and writes once, and records the
  input's amax in the same pass (for the next step's history). :func:`cast_transpose` also writes the
  transposed FP8 copy (the wgrad/dgrad operand) from the same registers: one read, two writes.
* **a layer's scaling state** (``OperandScaling``) casts through :func:`tensorwise_cast` (given the last scale and
  the non-finite count) and :func:`delayed_cast`, whose kernels also do its bookkeeping (the last program to
  finish books a delayed amax), write ``1 / scale`` and, for a 2-D operand, its transposed copy: one custom op
  per cast and no scalar operation around it, each of which would be a launch.

The design in full: ``docs/design/notes.md``, section ``kernels.per_tensor``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fp8_lightning.formats import fp8_max, fp8_min_normal
from fp8_lightning.kernels.availability import explicit_rounding

MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
NAN_BITS = {torch.float8_e4m3fn: 0x7FF00000, torch.float8_e5m2: 0x7FC00000}  # float32 NaNs: S.1111.111 / S.11111.10
FLAT_BLOCK = 4096  # elements per program of the flat amax and casts (the kernels' BLOCK)
TRANSPOSE_TILE = 64  # edge of the square tile of the casts that also write the transpose (the kernels' TILE)
# 8 warps: 16 elements of a 4096-element block (or 64 x 64 tile) per thread. At 4 warps (32 per thread) the flat
# casts spill on sm_100a (benchmarks/aot_compile.py).
PER_TENSOR_NUM_WARPS = 8
# float32's largest value as a Triton constexpr (a global a kernel reads must be one): a scale's cap
# (quantize.tensorwise_scale's FLOAT32_MAX)
FLOAT32_MAX_CONSTEXPR = tl.constexpr(torch.finfo(torch.float32).max)


# --------------------------------------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------------------------------------


# tl.max's own combine function: the interpreter recognises it and reduces with numpy in one call.
_MAX_COMBINE = tl.standard._elementwise_max


@triton.jit
def _reduce_max(x, axis: tl.constexpr):
    """``tl.max`` written as the ``tl.reduce`` it is (see "Triton's standard library" in the module doc)."""
    return tl.reduce(x, axis, _MAX_COMBINE)


@triton.jit
def _abs_bits(x):
    """|x| as float32 bits in an int32: integer order == float order, NaN above +inf."""
    return x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _saturate(y, FP8_MAX: tl.constexpr):
    """Clamp to +-FP8_MAX, keeping NaN (min/max alone would drop it)."""
    clamped = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    return tl.where(y != y, y, clamped)


@triton.jit
def _round_to_grid(y, MANTISSA_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, NAN_BITS: tl.constexpr):
    """Round float32 ``y`` (|y| <= fp8 max) to the nearest FP8 value, ties to even, staying in float32.

    Adding and subtracting ``1.5 * 2**(k + 23)`` rounds to a multiple of ``2**k`` in float32's own
    round-to-nearest-even; ``k`` is the FP8 spacing at |y| (fixed below the smallest normal). The sign is put
    back so that values rounding to zero keep it (-0.0, like the cast).
    """
    bits = y.to(tl.int32, bitcast=True)
    exp = tl.maximum(((bits >> 23) & 0xFF) - 127, MIN_NORMAL_EXP)
    magic = (((exp - MANTISSA_BITS + 150) << 23) | 0x400000).to(tl.float32, bitcast=True)
    rounded = (y + magic) - magic
    rounded = (rounded.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
    # NaN becomes a float32 NaN whose leading mantissa bits are a NaN code of the format and whose next bit is
    # clear, so that a conversion that only slices and rounds bits (the interpreter's) also yields NaN.
    return tl.where(y != y, NAN_BITS, rounded.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)


@triton.jit
def _to_fp8_values(y, FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr,
                   NAN_BITS: tl.constexpr, EXPLICIT_ROUNDING: tl.constexpr):
    """Saturate, and optionally pre-round, so the float8 conversion that follows is exact (see module doc)."""
    y = _saturate(y, FP8_MAX)
    if EXPLICIT_ROUNDING:
        y = _round_to_grid(y, MANTISSA_BITS, MIN_NORMAL_EXP, NAN_BITS)
    return y


@triton.jit
def _tensorwise_scale(amax, eps, FP8_MAX: tl.constexpr, POWER_OF_2: tl.constexpr):
    """Bit-for-bit ``fp8_lightning.quantize.tensorwise_scale`` (see the module docstring)."""
    clamped = tl.where(amax < eps, eps, amax)  # clamp(min=eps); NaN stays NaN
    scale = tl.math.div_rn(FP8_MAX, clamped)  # IEEE division: the correctly rounded quotient
    scale = tl.where(scale > FLOAT32_MAX_CONSTEXPR, FLOAT32_MAX_CONSTEXPR, scale)
    if POWER_OF_2:
        bits = scale.to(tl.int32, bitcast=True) & -8388608  # keep sign and exponent: 2**floor(log2(scale))
        scale = tl.where(scale != scale, 0.5, bits.to(tl.float32, bitcast=True))
    return scale


# --------------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _amax_kernel(x_ptr, amax_bits_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.atomic_max(amax_bits_ptr, _reduce_max(_abs_bits(x), 0))


@triton.jit
def _cast_block(
    x_ptr, out_ptr, n, scale, FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr,
    NAN_BITS: tl.constexpr, EXPLICIT_ROUNDING: tl.constexpr, BLOCK: tl.constexpr,
):
    """This program's block of the flat x cast with ``scale`` into out; returns the block (for its amax)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    y = _to_fp8_values(x.to(tl.float32) * scale, FP8_MAX, MANTISSA_BITS, MIN_NORMAL_EXP, NAN_BITS, EXPLICIT_ROUNDING)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
    return x


@triton.jit
def _cast_tile(
    x_ptr, out_ptr, out_t_ptr, M, K, stride_xm, stride_xk, scale, FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr,
    MIN_NORMAL_EXP: tl.constexpr, NAN_BITS: tl.constexpr, EXPLICIT_ROUNDING: tl.constexpr, TILE: tl.constexpr,
):
    """This program's tile of a 2-D x (M, K), any strides, cast with ``scale`` into out (M, K) and its transpose
    out_t (K, M), both contiguous; returns the tile's max |x| as float32 bits."""
    rm = (tl.program_id(0) * TILE + tl.arange(0, TILE)).to(tl.int64)
    rk = (tl.program_id(1) * TILE + tl.arange(0, TILE)).to(tl.int64)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk, mask=mask, other=0.0)
    y = _to_fp8_values(x.to(tl.float32) * scale, FP8_MAX, MANTISSA_BITS, MIN_NORMAL_EXP, NAN_BITS, EXPLICIT_ROUNDING)
    q = y.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rm[:, None] * K + rk[None, :], q, mask=mask)
    tl.store(out_t_ptr + rk[:, None] * M + rm[None, :], tl.trans(q), mask=tl.trans(mask))
    return _reduce_max(_reduce_max(_abs_bits(x), 1), 0)


@triton.jit
def _cast_part(
    x_ptr, out_ptr, out_t_ptr, M, K, scale, FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr,
    MIN_NORMAL_EXP: tl.constexpr, NAN_BITS: tl.constexpr, EXPLICIT_ROUNDING: tl.constexpr,
    TRANSPOSE: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr,
):
    """This program's part of a contiguous x of M * K elements (a (M, K) matrix when ``TRANSPOSE``, whose
    transpose goes to out_t) cast with ``scale``; returns its max |x| as float32 bits."""
    if TRANSPOSE:
        part_max = _cast_tile(x_ptr, out_ptr, out_t_ptr, M, K, K, 1, scale, FP8_MAX, MANTISSA_BITS, MIN_NORMAL_EXP,
                              NAN_BITS, EXPLICIT_ROUNDING, TILE)  # fmt: skip
    else:
        x = _cast_block(x_ptr, out_ptr, M * K, scale, FP8_MAX, MANTISSA_BITS, MIN_NORMAL_EXP, NAN_BITS,
                        EXPLICIT_ROUNDING, BLOCK)  # fmt: skip
        part_max = _reduce_max(_abs_bits(x), 0)
    return part_max


@triton.jit
def _is_last_program(counter_ptr):
    """True in the program that finishes last (the counter starts at 0): acq_rel atomics, so that program sees
    everything the others wrote before they counted themselves."""
    return tl.atomic_add(counter_ptr, 1) == tl.num_programs(0) * tl.num_programs(1) - 1


@triton.jit
def _cast_kernel(
    x_ptr, scale_ptr, out_ptr, amax_bits_ptr, n,
    FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, NAN_BITS: tl.constexpr,
    EXPLICIT_ROUNDING: tl.constexpr, RECORD_AMAX: tl.constexpr, BLOCK: tl.constexpr,
):
    x = _cast_block(x_ptr, out_ptr, n, tl.load(scale_ptr), FP8_MAX, MANTISSA_BITS, MIN_NORMAL_EXP, NAN_BITS,
                    EXPLICIT_ROUNDING, BLOCK)  # fmt: skip
    if RECORD_AMAX:
        tl.atomic_max(amax_bits_ptr, _reduce_max(_abs_bits(x), 0))


@triton.jit
def _delayed_cast_kernel(
    x_ptr, scale_ptr, out_ptr, out_t_ptr, sync_ptr, pending_ptr, count_ptr, pending_out_ptr, count_out_ptr,
    inverse_out_ptr, M, K,
    FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, NAN_BITS: tl.constexpr,
    EXPLICIT_ROUNDING: tl.constexpr, RECORD: tl.constexpr, TRANSPOSE: tl.constexpr, BLOCK: tl.constexpr,
    TILE: tl.constexpr,
):
    """A delayed-scaling state's cast with its bookkeeping: each program casts its part and folds its amax into
    ``sync[0]``; the last program to finish (``sync[1]`` counts them) books the tensor's amax: a non-finite one is
    counted and never enters the pending amax (``OperandScaling.book``). It also writes ``1 / scale``."""
    scale = tl.load(scale_ptr)
    part_max = _cast_part(x_ptr, out_ptr, out_t_ptr, M, K, scale, FP8_MAX, MANTISSA_BITS, MIN_NORMAL_EXP, NAN_BITS,
                          EXPLICIT_ROUNDING, TRANSPOSE, BLOCK, TILE)  # fmt: skip
    tl.atomic_max(sync_ptr, part_max)
    if _is_last_program(sync_ptr + 1):
        tl.store(inverse_out_ptr, tl.math.div_rn(1.0, scale))
        amax_bits = tl.atomic_max(sync_ptr, 0)  # read atomically
        finite = amax_bits < 0x7F800000
        pending = tl.load(pending_ptr)
        if RECORD:
            pending = tl.maximum(pending, tl.where(finite, amax_bits.to(tl.float32, bitcast=True), 0.0))
        tl.store(pending_out_ptr, pending)
        tl.store(count_out_ptr, tl.load(count_ptr) + tl.where(finite, 0, 1).to(tl.int64))


@triton.jit
def _tensorwise_cast_kernel(
    x_ptr, amax_bits_ptr, out_ptr, out_t_ptr, scale_out_ptr, prev_scale_ptr, count_ptr, count_out_ptr,
    inverse_out_ptr, M, K, eps,
    FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, NAN_BITS: tl.constexpr,
    EXPLICIT_ROUNDING: tl.constexpr, POWER_OF_2: tl.constexpr, KEEP_PREVIOUS: tl.constexpr,
    TRANSPOSE: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr,
):
    amax_bits = tl.load(amax_bits_ptr)
    amax = amax_bits.to(tl.float32, bitcast=True)
    if KEEP_PREVIOUS:  # OperandScaling's rule: a zero or non-finite amax keeps the previous scale and is counted
        finite = amax_bits < 0x7F800000
        clean = tl.where(finite, amax, 0.0)
        scale = tl.where(clean > 0, _tensorwise_scale(clean, eps, FP8_MAX, POWER_OF_2), tl.load(prev_scale_ptr))
    else:  # a stateless cast: an inf or NaN amax gives scale 1 (quantize.current_scale)
        scale = tl.where(amax_bits < 0x7F800000, _tensorwise_scale(amax, eps, FP8_MAX, POWER_OF_2), 1.0)
    _cast_part(x_ptr, out_ptr, out_t_ptr, M, K, scale, FP8_MAX, MANTISSA_BITS, MIN_NORMAL_EXP, NAN_BITS,
               EXPLICIT_ROUNDING, TRANSPOSE, BLOCK, TILE)  # fmt: skip
    if tl.program_id(0) + tl.program_id(1) == 0:
        tl.store(scale_out_ptr, scale)
        if KEEP_PREVIOUS:
            tl.store(count_out_ptr, tl.load(count_ptr) + tl.where(finite, 0, 1).to(tl.int64))
            tl.store(inverse_out_ptr, tl.math.div_rn(1.0, scale))  # what dequantization multiplies by


@triton.jit
def _cast_transpose_kernel(
    x_ptr, scale_ptr, out_ptr, out_t_ptr, amax_bits_ptr, M, K, stride_xm, stride_xk,
    FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, NAN_BITS: tl.constexpr,
    EXPLICIT_ROUNDING: tl.constexpr, RECORD_AMAX: tl.constexpr, TILE: tl.constexpr,
):
    tile_max = _cast_tile(x_ptr, out_ptr, out_t_ptr, M, K, stride_xm, stride_xk, tl.load(scale_ptr), FP8_MAX,
                          MANTISSA_BITS, MIN_NORMAL_EXP, NAN_BITS, EXPLICIT_ROUNDING, TILE)  # fmt: skip
    if RECORD_AMAX:
        tl.atomic_max(amax_bits_ptr, tile_max)


# --------------------------------------------------------------------------------------------------------
# Launchers (inputs already validated by fp8_lightning.kernels.ops)
# --------------------------------------------------------------------------------------------------------


def format_constants(dtype: torch.dtype) -> dict:
    """The constexprs that describe a float8 format to the kernels, and the rounding mode to use."""
    return {
        "FP8_MAX": fp8_max(dtype),
        "MANTISSA_BITS": MANTISSA_BITS[dtype],
        "MIN_NORMAL_EXP": int(math.log2(fp8_min_normal(dtype))),
        "NAN_BITS": NAN_BITS[dtype],
        "EXPLICIT_ROUNDING": explicit_rounding(),
    }


def _amax_buffer(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=device)


def _bits_to_amax(bits: torch.Tensor) -> torch.Tensor:
    return bits.view(torch.float32).reshape(())


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(-1)


def launch_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a float32 scalar; one read of ``x``."""
    bits = _amax_buffer(x.device)
    n = x.numel()
    if n:
        _amax_kernel[(triton.cdiv(n, FLAT_BLOCK),)](
            _flat(x), bits, n, BLOCK=FLAT_BLOCK, num_warps=PER_TENSOR_NUM_WARPS
        )
    return _bits_to_amax(bits)


def cast(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, record_amax: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``saturate(x * scale)`` in ``dtype`` and (when ``record_amax``) max |x|, from one read of ``x``."""
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    bits = _amax_buffer(x.device)
    n = x.numel()
    if n:
        _cast_kernel[(triton.cdiv(n, FLAT_BLOCK),)](
            _flat(x), scale.reshape(1).float(), out.view(-1), bits, n,
            **format_constants(dtype), RECORD_AMAX=record_amax, BLOCK=FLAT_BLOCK, num_warps=PER_TENSOR_NUM_WARPS,
        )
    return out, _bits_to_amax(bits)


def _operand_layout(x: torch.Tensor, dtype: torch.dtype, transpose: bool):
    """(flat x, out, out_t, M, K, grid) for a scaling state's cast: 2-D tiles writing the transpose too when
    ``transpose`` (x 2-D), else flat blocks (out_t empty); at least one program, which does the bookkeeping."""
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if transpose:
        m, k = x.shape
        out_t = torch.empty((k, m), dtype=dtype, device=x.device)
        grid = (max(1, triton.cdiv(m, TRANSPOSE_TILE)), max(1, triton.cdiv(k, TRANSPOSE_TILE)))
    else:
        m, k = 1, x.numel()
        out_t = torch.empty(0, dtype=dtype, device=x.device)
        grid = (max(1, triton.cdiv(k, FLAT_BLOCK)), 1)
    return _flat(x), out, out_t, m, k, grid


def delayed_cast(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, pending: torch.Tensor, count: torch.Tensor, record: bool,
    transpose: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A delayed-scaling state's cast in one pass: ``(data, data_t, amax, pending, count, 1 / scale)``, where
    ``pending`` is the state's pending amax folded with this amax (when ``record`` and finite), ``count`` + 1 when
    it is not finite, and ``data_t`` the contiguous transpose of a 2-D x's data when ``transpose`` (else empty)."""
    flat, out, out_t, m, k, grid = _operand_layout(x, dtype, transpose)
    sync = torch.zeros(2, dtype=torch.int32, device=x.device)  # amax bits, programs finished
    pending_out = torch.empty((), dtype=torch.float32, device=x.device)
    count_out = torch.empty((), dtype=torch.int64, device=x.device)
    inverse = torch.empty((), dtype=torch.float32, device=x.device)
    _delayed_cast_kernel[grid](
        flat, scale.reshape(1).float(), out.view(-1), out_t, sync, pending.float(), count, pending_out, count_out,
        inverse, m, k, **format_constants(dtype), RECORD=record, TRANSPOSE=transpose, BLOCK=FLAT_BLOCK,
        TILE=TRANSPOSE_TILE, num_warps=PER_TENSOR_NUM_WARPS,
    )  # fmt: skip
    return out, out_t, _bits_to_amax(sync[:1]), pending_out, count_out, inverse


def tensorwise_cast(
    x: torch.Tensor, dtype: torch.dtype, eps: float, power_of_2: bool,
    prev_scale: torch.Tensor | None = None, count: torch.Tensor | None = None, transpose: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Current scaling in two passes: ``(data, data_t, scale, amax, count, 1 / scale)`` as
    ``quantize.tensorwise_scale`` defines them; ``data_t`` is the contiguous transpose of a 2-D x's data when
    ``transpose`` (else empty).

    With ``prev_scale`` and ``count`` (a scaling state's): a zero or non-finite amax keeps ``prev_scale``, and
    ``count`` + 1 where the amax is not finite is returned (``OperandScaling``'s bookkeeping, in the cast kernel),
    with the scale's inverse; without them the last two are None.
    """
    flat, out, out_t, m, k, grid = _operand_layout(x, dtype, transpose)
    n = x.numel()
    bits = _amax_buffer(x.device)
    scale = torch.empty(1, dtype=torch.float32, device=x.device)
    keep = prev_scale is not None
    count_out = torch.empty((), dtype=torch.int64, device=x.device) if keep else None
    inverse = torch.empty((), dtype=torch.float32, device=x.device) if keep else None
    if n:
        _amax_kernel[(triton.cdiv(n, FLAT_BLOCK),)](
            flat, bits, n, BLOCK=FLAT_BLOCK, num_warps=PER_TENSOR_NUM_WARPS
        )
    _tensorwise_cast_kernel[grid](
        flat, bits, out.view(-1), out_t, scale, prev_scale if keep else scale, count if keep else bits,
        count_out if keep else bits, inverse if keep else scale, m, k, eps, **format_constants(dtype),
        POWER_OF_2=power_of_2, KEEP_PREVIOUS=keep, TRANSPOSE=transpose, BLOCK=FLAT_BLOCK, TILE=TRANSPOSE_TILE,
        num_warps=PER_TENSOR_NUM_WARPS,
    )  # fmt: skip
    return out, out_t, scale.reshape(()), _bits_to_amax(bits), count_out, inverse


def cast_transpose(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, record_amax: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a 2-D ``x`` (M, K): ``(data (M, K), data_t (K, M), amax)`` from one read of ``x``."""
    m, k = x.shape
    out = torch.empty((m, k), dtype=dtype, device=x.device)
    out_t = torch.empty((k, m), dtype=dtype, device=x.device)
    bits = _amax_buffer(x.device)
    if x.numel():
        grid = (triton.cdiv(m, TRANSPOSE_TILE), triton.cdiv(k, TRANSPOSE_TILE))
        _cast_transpose_kernel[grid](
            x, scale.reshape(1).float(), out, out_t, bits, m, k, x.stride(0), x.stride(1),
            **format_constants(dtype), RECORD_AMAX=record_amax, TILE=TRANSPOSE_TILE,
            num_warps=PER_TENSOR_NUM_WARPS,
        )
    return out, out_t, _bits_to_amax(bits)
