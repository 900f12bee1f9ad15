"""Rowwise and blockwise FP8 casts in Triton: codes, scales and ``1 / scale`` in cuBLAS's layouts, one launch a copy.

The pure-torch twins are :func:`fp8_lightning.rowwise.quantize_rowwise` and
:func:`fp8_lightning.blockwise.quantize_blockwise`; on CUDA they are a chain of torch operations (abs, amax, the
scale math, a multiply, a clamp, a cast) followed, in the GEMM, by the copies that put the codes and the scales in
the layout ``torch._scaled_mm`` reads. Here every copy a layer needs is one launch that writes:

* the **codes** of the operand (its reduction dimension last, row-major): for a copy scaled down the source's
  columns (the wgrad operands ``x.T`` and ``g.T``) that is the transposed matrix, written directly instead of a
  view that the GEMM would copy;
* the float32 **scales** and their inverses (what ``_scaled_mm`` multiplies by) in cuBLAS's layout: one per row
  ``(M, 1)``; 1x128 tiles "outer-dim-major" (column-major, strides ``(1, M)``); 128x128 blocks "inner-dim-major"
  with the row stride rounded up to 4 floats (16 bytes);
* for a weight's 128x128 blocks, also ``W.T``'s codes and block scales (dgrad's operand) from the same registers.

The design in full: ``docs/design/notes.md``, section ``kernels.fine_grained_cast``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8_lightning.kernels.fine_grained_layout import (
    BLOCKWISE_EDGE,
    along_rows,
    ceil_div,
    output_layouts,
    piece,
    window_length,
)
from fp8_lightning.kernels.per_tensor import (
    FLOAT32_MAX_CONSTEXPR,
    _abs_bits,
    _reduce_max,
    _to_fp8_values,
    format_constants,
)

NUM_WARPS = 8  # 16 elements of a 4,096-element piece per thread (per_tensor.PER_TENSOR_NUM_WARPS)


@triton.jit
def _window_scale(amax_bits, eps, FP8_MAX: tl.constexpr, POWER_OF_2: tl.constexpr, BLOCKWISE: tl.constexpr):
    """The scale of each window from its amax bits (the rules in the module docstring)."""
    amax = amax_bits.to(tl.float32, bitcast=True)
    usable = amax_bits < 0x7F800000  # finite
    if BLOCKWISE:
        usable = usable & (amax_bits > 0)
    else:
        amax = tl.where(amax < eps, eps, amax)
    scale = tl.math.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), amax)
    scale = tl.where(scale > FLOAT32_MAX_CONSTEXPR, FLOAT32_MAX_CONSTEXPR, scale)
    if POWER_OF_2:
        scale = (scale.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)
    return tl.where(usable, scale, 1.0)


@triton.jit
def _fine_cast_kernel(
    x_ptr, data_ptr, data_t_ptr, scale_ptr, inverse_ptr, scale_t_ptr, inverse_t_ptr,
    LINES, LENGTH, WINDOW, stride_line, stride_pos, stride_scale_line, stride_scale_window, stride_scale_t_window,
    stride_scale_t_line, eps,
    FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, NAN_BITS: tl.constexpr,
    EXPLICIT_ROUNDING: tl.constexpr, POWER_OF_2: tl.constexpr, BLOCKWISE: tl.constexpr, SQUARE: tl.constexpr,
    TRANSPOSE: tl.constexpr, BLOCK_LINES: tl.constexpr, CHUNK: tl.constexpr,
):
    """Cast lines [pid0 * BLOCK_LINES, +BLOCK_LINES) of x, window pid1: codes into data (LINES, LENGTH), and into
    data_t (LENGTH, LINES) when ``TRANSPOSE``; the scales and their inverses at the given strides (one per line, or
    one per program when ``SQUARE``, also transposed into scale_t / inverse_t when ``TRANSPOSE``)."""
    lines = (tl.program_id(0) * BLOCK_LINES + tl.arange(0, BLOCK_LINES)).to(tl.int64)
    window = tl.program_id(1).to(tl.int64)
    start = window * WINDOW
    end = tl.minimum(start + WINDOW, LENGTH)
    in_lines = lines < LINES
    bits = tl.full((BLOCK_LINES,), 0, tl.int32)
    for offset in range(0, WINDOW, CHUNK):
        pos = start + offset + tl.arange(0, CHUNK)
        mask = in_lines[:, None] & (pos[None, :] < end)
        x = tl.load(x_ptr + lines[:, None] * stride_line + pos[None, :] * stride_pos, mask=mask, other=0.0)
        bits = tl.maximum(bits, _reduce_max(_abs_bits(x), 1))
    if SQUARE:
        bits = tl.full((BLOCK_LINES,), 0, tl.int32) + _reduce_max(bits, 0)
    scale = _window_scale(bits, eps, FP8_MAX, POWER_OF_2, BLOCKWISE)
    for offset in range(0, WINDOW, CHUNK):
        pos = start + offset + tl.arange(0, CHUNK)
        mask = in_lines[:, None] & (pos[None, :] < end)
        x = tl.load(x_ptr + lines[:, None] * stride_line + pos[None, :] * stride_pos, mask=mask, other=0.0)
        y = _to_fp8_values(
            x.to(tl.float32) * scale[:, None], FP8_MAX, MANTISSA_BITS, MIN_NORMAL_EXP, NAN_BITS, EXPLICIT_ROUNDING
        )
        q = y.to(data_ptr.dtype.element_ty)
        tl.store(data_ptr + lines[:, None] * LENGTH + pos[None, :], q, mask=mask)
        if TRANSPOSE:
            tl.store(data_t_ptr + pos[:, None] * LINES + lines[None, :], tl.trans(q), mask=tl.trans(mask))
    inverse = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    if SQUARE:  # one value per program, stored by its first lane
        first = tl.arange(0, BLOCK_LINES) == 0
        block = tl.program_id(0).to(tl.int64) + tl.full((BLOCK_LINES,), 0, tl.int64)
        at = block * stride_scale_line + window * stride_scale_window
        tl.store(scale_ptr + at, scale, mask=first)
        tl.store(inverse_ptr + at, inverse, mask=first)
        if TRANSPOSE:
            at_t = window * stride_scale_t_window + block * stride_scale_t_line
            tl.store(scale_t_ptr + at_t, scale, mask=first)
            tl.store(inverse_t_ptr + at_t, inverse, mask=first)
    else:
        at = lines * stride_scale_line + window * stride_scale_window
        tl.store(scale_ptr + at, scale, mask=in_lines)
        tl.store(inverse_ptr + at, inverse, mask=in_lines)


# --------------------------------------------------------------------------------------------------------
# Launcher (inputs validated by fp8_lightning.kernels)
# --------------------------------------------------------------------------------------------------------


def _empty(layout, dtype, device) -> torch.Tensor:
    return torch.empty_strided(*layout, dtype=dtype, device=device)


def fine_cast(
    x: torch.Tensor, dtype: torch.dtype, tile: tuple[int, int], power_of_2: bool, eps: float, transpose: bool
) -> tuple[torch.Tensor, ...]:
    """Cast a non-empty 2-D ``x`` in ``tile`` windows (one of :data:`TILES`) in one launch: ``(data, scale,
    inverse, data_t, scale_t, inverse_t)`` in the layouts of :func:`output_layouts` (the last three empty unless
    ``transpose``, which only 128x128 blocks take)."""
    layouts = output_layouts(tuple(x.shape), tile, transpose)
    dev = x.device
    data, scale = _empty(layouts["data"], dtype, dev), _empty(layouts["scale"], torch.float32, dev)
    inverse = _empty(layouts["scale"], torch.float32, dev)
    if transpose:
        data_t, scale_t = _empty(layouts["data_t"], dtype, dev), _empty(layouts["scale_t"], torch.float32, dev)
        inverse_t = _empty(layouts["scale_t"], torch.float32, dev)
    else:
        data_t, scale_t, inverse_t = (
            torch.empty(0, dtype=d, device=dev) for d in (dtype, torch.float32, torch.float32)
        )
    lines, length = data.shape
    stride_line, stride_pos = x.stride() if along_rows(tile) else x.stride()[::-1]
    window = window_length(tile, length)
    block_lines, chunk = piece(tile, along_rows(tile))
    t_strides = scale_t.stride() if transpose else (0, 0)
    grid = (ceil_div(lines, block_lines), ceil_div(length, window))
    _fine_cast_kernel[grid](
        x, data, data_t, scale, inverse, scale_t, inverse_t, lines, length, window, stride_line, stride_pos,
        *scale.stride(), *t_strides, float(eps), **format_constants(dtype), POWER_OF_2=power_of_2,
        BLOCKWISE=BLOCKWISE_EDGE in tile, SQUARE=tile == (BLOCKWISE_EDGE, BLOCKWISE_EDGE), TRANSPOSE=transpose,
        BLOCK_LINES=block_lines, CHUNK=chunk, num_warps=NUM_WARPS,
    )  # fmt: skip
    return data, scale, inverse, data_t, scale_t, inverse_t
