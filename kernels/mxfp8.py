"""MXFP8 quantization in Triton: rowwise and columnwise copies from one read of the high-precision tensor.

The pure-torch twin is :func:`fp8_lightning.mx.quantize_mxfp8` (and ``mx_shared_exponent`` for the
exponent rules). A program loads one (BLOCK_R, BLOCK_C) tile of the 2-D source ``x`` (R, C), and from the same
registers writes

* the **rowwise** copy: blocks of ``BLOCK_SIZE`` consecutive elements along C, data (R, C_pad) and E8M0 scales
  (R, C_pad / BLOCK_SIZE): the operand whose reduction dimension is C;
* the **columnwise** copy: blocks along R, stored transposed as data (C, R_pad) and scales (C, R_pad / BLOCK_SIZE):
  the operand whose reduction dimension is R (the wgrad GEMM's), quantized from the high-precision values, as
  MX requires (re-quantizing the rowwise FP8 copy would compound two roundings).

``X_pad`` is X rounded up to a whole number of blocks: missing elements are zeros, exactly what
``pad_dim`` + ``quantize_mxfp8`` produce. ``x`` may have any strides (a transposed view is read as it lies).

The design in full: ``docs/design/notes.md``, section ``kernels.mxfp8``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8_lightning.formats import fp8_emax
from fp8_lightning.kernels.per_tensor import _abs_bits, _reduce_max, _to_fp8_values, format_constants

@triton.jit
def _mx_tile(
    x, ROWS: tl.constexpr, COLS: tl.constexpr, BLOCK_SIZE: tl.constexpr, EMAX: tl.constexpr, RCEIL: tl.constexpr,
    FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, NAN_BITS: tl.constexpr,
    EXPLICIT_ROUNDING: tl.constexpr,
):
    """Quantize a (ROWS, COLS) float32 tile in blocks along COLS.

    Returns the saturated, scaled values (ROWS, COLS) in float32 (exact in the target format after rounding)
    and the E8M0 bytes (ROWS, COLS // BLOCK_SIZE) as int32.
    """
    N_BLOCKS: tl.constexpr = COLS // BLOCK_SIZE
    blocks = tl.reshape(x, (ROWS, N_BLOCKS, BLOCK_SIZE))
    amax_bits = _reduce_max(_abs_bits(blocks), 2)
    is_nan = amax_bits > 0x7F800000
    is_inf = amax_bits == 0x7F800000
    e = ((amax_bits >> 23) & 0xFF) - 127 - EMAX
    if RCEIL:
        e += ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -127), 127)
    e = tl.where(is_nan, -127, tl.where(is_inf, 0, e))  # an inf block: scale 1 (its infinities saturate)
    multiplier = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2**-e, e in [-127, 119]: a normal float
    y = _to_fp8_values(
        blocks * multiplier[:, :, None], FP8_MAX, MANTISSA_BITS, MIN_NORMAL_EXP, NAN_BITS, EXPLICIT_ROUNDING
    )
    return tl.reshape(y, (ROWS, COLS)), tl.where(is_nan, 255, e + 127)


@triton.jit
def _mx_quantize_kernel(
    x_ptr, row_ptr, row_scale_ptr, col_ptr, col_scale_ptr,
    R, C, R_PAD, C_PAD, stride_r, stride_c,
    BLOCK_SIZE: tl.constexpr, EMAX: tl.constexpr, RCEIL: tl.constexpr,
    FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, NAN_BITS: tl.constexpr,
    EXPLICIT_ROUNDING: tl.constexpr, ROWWISE: tl.constexpr, COLWISE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rr = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    rc = (pid_c * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    in_bounds = (rr[:, None] < R) & (rc[None, :] < C)
    x = tl.load(x_ptr + rr[:, None] * stride_r + rc[None, :] * stride_c, mask=in_bounds, other=0.0)
    x = x.to(tl.float32)
    if ROWWISE:
        y, byte = _mx_tile(
            x, BLOCK_R, BLOCK_C, BLOCK_SIZE, EMAX, RCEIL, FP8_MAX, MANTISSA_BITS, MIN_NORMAL_EXP, NAN_BITS,
            EXPLICIT_ROUNDING,
        )
        mask = (rr[:, None] < R) & (rc[None, :] < C_PAD)
        tl.store(row_ptr + rr[:, None] * C_PAD + rc[None, :], y.to(row_ptr.dtype.element_ty), mask=mask)
        sc = (pid_c * (BLOCK_C // BLOCK_SIZE) + tl.arange(0, BLOCK_C // BLOCK_SIZE)).to(tl.int64)
        n_sc = C_PAD // BLOCK_SIZE
        s_mask = (rr[:, None] < R) & (sc[None, :] < n_sc)
        tl.store(row_scale_ptr + rr[:, None] * n_sc + sc[None, :], byte.to(tl.uint8), mask=s_mask)
    if COLWISE:
        yt, byte_t = _mx_tile(
            tl.trans(x), BLOCK_C, BLOCK_R, BLOCK_SIZE, EMAX, RCEIL, FP8_MAX, MANTISSA_BITS, MIN_NORMAL_EXP,
            NAN_BITS, EXPLICIT_ROUNDING,
        )
        mask_t = (rc[:, None] < C) & (rr[None, :] < R_PAD)
        tl.store(col_ptr + rc[:, None] * R_PAD + rr[None, :], yt.to(col_ptr.dtype.element_ty), mask=mask_t)
        sr = (pid_r * (BLOCK_R // BLOCK_SIZE) + tl.arange(0, BLOCK_R // BLOCK_SIZE)).to(tl.int64)
        n_sr = R_PAD // BLOCK_SIZE
        s_mask_t = (rc[:, None] < C) & (sr[None, :] < n_sr)
        tl.store(col_scale_ptr + rc[:, None] * n_sr + sr[None, :], byte_t.to(tl.uint8), mask=s_mask_t)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def tile_shape(block_size: int, rowwise: bool, colwise: bool) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C): a whole number of blocks along each direction that is quantized, at least 64 each."""
    edge = max(64, block_size)
    return (edge if colwise else 64, edge if rowwise else 64)


def quantize_num_warps(tile: tuple[int, int]) -> int:
    """Warps per program: 4 for a (64, 64) tile, 8 above (32 and more elements per thread spill at 4 warps)."""
    return 4 if tile[0] * tile[1] <= 64 * 64 else 8


def launches(block_size: int, rowwise: bool, colwise: bool) -> list[tuple[bool, bool]]:
    """The (rowwise, colwise) kernel launches for a request: one, except both directions at a block size above 64,
    whose (128, 128) float32 tile spills registers even at 8 warps (``benchmarks/aot_compile.py``): one launch per
    direction then, which reads ``x`` twice."""
    if rowwise and colwise and block_size > 64:
        return [(True, False), (False, True)]
    return [(rowwise, colwise)] if rowwise or colwise else []


def launch_mx_quantize(
    x: torch.Tensor, block_size: int, scale_rounding: str, dtype: torch.dtype, rowwise: bool, colwise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize the 2-D ``x`` (R, C) with one read (two at block sizes above 64 with both copies, see
    :func:`launches`).

    Returns ``(row_data (R, C_pad), row_scale (R, C_pad/bs), col_data (C, R_pad), col_scale (C, R_pad/bs))``;
    scales are uint8 E8M0 bytes; an output that was not requested is an empty tensor.
    """
    r, c = x.shape
    r_pad, c_pad = _round_up(r, block_size), _round_up(c, block_size)
    dev = x.device
    empty8 = torch.empty(0, dtype=dtype, device=dev)
    empty_u8 = torch.empty(0, dtype=torch.uint8, device=dev)
    row = torch.empty((r, c_pad), dtype=dtype, device=dev) if rowwise else empty8
    row_scale = torch.empty((r, c_pad // block_size), dtype=torch.uint8, device=dev) if rowwise else empty_u8
    col = torch.empty((c, r_pad), dtype=dtype, device=dev) if colwise else empty8
    col_scale = torch.empty((c, r_pad // block_size), dtype=torch.uint8, device=dev) if colwise else empty_u8
    for row_pass, col_pass in launches(block_size, rowwise, colwise) if x.numel() else []:
        tile = tile_shape(block_size, row_pass, col_pass)
        grid = (triton.cdiv(r, tile[0]), triton.cdiv(c, tile[1]))
        _mx_quantize_kernel[grid](
            x, row if row_pass else col, row_scale if row_pass else col_scale,
            col if col_pass else row, col_scale if col_pass else row_scale,
            r, c, r_pad, c_pad, x.stride(0), x.stride(1),
            BLOCK_SIZE=block_size, EMAX=fp8_emax(dtype), RCEIL=scale_rounding == "rceil", **format_constants(dtype),
            ROWWISE=row_pass, COLWISE=col_pass, BLOCK_R=tile[0], BLOCK_C=tile[1], num_warps=quantize_num_warps(tile),
        )
    return row, row_scale, col, col_scale
