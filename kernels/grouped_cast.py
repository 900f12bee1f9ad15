"""The columnwise FP8 casts of grouped (mixture-of-experts) GEMMs in Triton: every group in one launch.

A grouped GEMM's rows are sorted into groups (an expert's tokens, or an expert's weight rows). The operand that runs
down the columns of one group (the wgrad copies ``x_e.T``, ``g_e.T``; dgrad's ``W_e.T``) has one scale per
(group, column), taken over that group's rows only. In pure torch that is a scattered amax, a gathered multiply,
a cast, a copy into the padded layout and a transpose: five passes over the tokens. Here one launch reads each
group's rows twice (amax, then cast) and writes the codes transposed, where the grouped GEMM reads them:

* ``data[out_start[g] + column * out_line_stride + position]`` for the group's ``position`` along its rows, each
  group zero-padded to a multiple of ``ALIGN`` positions (an empty group to ``ALIGN`` zeros);
* ``scale[g, column]`` and ``inverse[g, column]`` (float32, ``1 / scale``), by the rowwise scale rule of
  :func:`fp8_lightning.rowwise.rowwise_scale` (``fine_grained_cast._window_scale``).

The group bounds are read on the device: no host synchronisation. The pure-torch twin is
:func:`fp8_lightning.rowwise_grouped.grouped_columnwise`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8_lightning.kernels.fine_grained_cast import NUM_WARPS, _window_scale
from fp8_lightning.kernels.per_tensor import _abs_bits, _reduce_max, _to_fp8_values, format_constants

BLOCK_COLUMNS = 64  # columns of x per program: its contiguous dimension
CHUNK = 64  # positions along a group's rows per step (a 64 x 64 piece, as the fine casts' columnwise tiles)


@triton.jit
def _grouped_column_cast_kernel(
    x_ptr, data_ptr, scale_ptr, inverse_ptr, starts_ptr, rows_ptr, out_starts_ptr,
    COLUMNS, stride_row, stride_column, out_line_stride, eps,
    FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, NAN_BITS: tl.constexpr,
    EXPLICIT_ROUNDING: tl.constexpr, POWER_OF_2: tl.constexpr, ALIGN: tl.constexpr, BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Columns [pid0 * BLOCK, +BLOCK) of group pid1: the amax of each over the group's rows, then the codes of the
    group's rows, written transposed and zero-padded to a multiple of ALIGN positions."""
    columns = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    group = tl.program_id(1)
    start = tl.load(starts_ptr + group).to(tl.int64)
    rows = tl.load(rows_ptr + group)
    out_start = tl.load(out_starts_ptr + group).to(tl.int64)
    padded = (tl.maximum(rows, 1) + ALIGN - 1) // ALIGN * ALIGN
    in_columns = columns < COLUMNS
    bits = tl.full((BLOCK,), 0, tl.int32)
    for offset in range(0, rows, CHUNK):
        pos = offset + tl.arange(0, CHUNK)
        mask = in_columns[:, None] & (pos[None, :] < rows)
        x = tl.load(x_ptr + (start + pos[None, :]) * stride_row + columns[:, None] * stride_column, mask=mask,
                    other=0.0)  # fmt: skip
        bits = tl.maximum(bits, _reduce_max(_abs_bits(x), 1))
    scale = _window_scale(bits, eps, FP8_MAX, POWER_OF_2, False)
    for offset in range(0, padded, CHUNK):
        pos = offset + tl.arange(0, CHUNK)
        load_mask = in_columns[:, None] & (pos[None, :] < rows)
        x = tl.load(x_ptr + (start + pos[None, :]) * stride_row + columns[:, None] * stride_column, mask=load_mask,
                    other=0.0)  # fmt: skip
        y = _to_fp8_values(
            x.to(tl.float32) * scale[:, None], FP8_MAX, MANTISSA_BITS, MIN_NORMAL_EXP, NAN_BITS, EXPLICIT_ROUNDING
        )
        store_mask = in_columns[:, None] & (pos[None, :] < padded)
        tl.store(data_ptr + out_start + columns[:, None] * out_line_stride + pos[None, :],
                 y.to(data_ptr.dtype.element_ty), mask=store_mask)  # fmt: skip
    inverse = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    at = group.to(tl.int64) * COLUMNS + columns
    tl.store(scale_ptr + at, scale, mask=in_columns)
    tl.store(inverse_ptr + at, inverse, mask=in_columns)


# --------------------------------------------------------------------------------------------------------
# Launcher (inputs validated by fp8_lightning.ops.triton_ops)
# --------------------------------------------------------------------------------------------------------


def grouped_column_cast(
    x: torch.Tensor, starts: torch.Tensor, rows: torch.Tensor, out_starts: torch.Tensor, out_numel: int,
    out_line_stride: int, dtype: torch.dtype, power_of_2: bool, eps: float, align: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cast every group of a 2-D ``x`` (rows sorted into groups: ``starts``, ``rows`` int32 per group) down its
    columns in one launch: ``(data, scale, inverse)``, ``data`` flat (``out_numel`` codes, which the groups' padded
    extents tile) with group ``g``'s column ``k`` at ``out_starts[g] + k * out_line_stride`` (int64 offsets),
    ``scale`` and ``inverse`` (groups, K) float32."""
    groups, columns = starts.numel(), x.shape[1]
    data = torch.empty(out_numel, dtype=dtype, device=x.device)
    scale = torch.empty(groups, columns, dtype=torch.float32, device=x.device)
    inverse = torch.empty_like(scale)
    if groups == 0 or columns == 0:
        return data, scale, inverse
    grid = (triton.cdiv(columns, BLOCK_COLUMNS), groups)
    _grouped_column_cast_kernel[grid](
        x, data, scale, inverse, starts, rows, out_starts, columns, x.stride(0), x.stride(1), out_line_stride,
        float(eps), **format_constants(dtype), POWER_OF_2=power_of_2, ALIGN=align, BLOCK=BLOCK_COLUMNS, CHUNK=CHUNK,
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return data, scale, inverse
