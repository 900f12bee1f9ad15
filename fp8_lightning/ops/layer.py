"""The traced layer step's opaque hot operations, declared as ops (:func:`~fp8_lightning.ops.registry.hot_op`).

    torch.ops.fp8_lightning.mx_operand_cast(x, block_size, scale_rounding, dtype, columnwise)
                                         -> (row, row_scale, col, col_scale)
        MXFP8 rowwise and (optionally) columnwise copies of a 2-D tensor from one read
    torch.ops.fp8_lightning.fine_tile_cast(x, dtype, tile_rows, tile_cols, power_of_2, eps) -> (data, scale)
        one rowwise or blockwise copy of a 2-D tensor
    torch.ops.fp8_lightning.operand_values(data, scale, kind) -> float32 values
        an operand's codes times its scales
    torch.ops.fp8_lightning.scaled_gemm(a, a_scale, b, b_scale, bias, kind, out_dtype, emulate, fast_accum) -> out
        ``a @ b.T (+ bias)`` for FP8 operands with K last (the CPU float GEMM, MX GEMMs)

Why ops: ``torch.compile`` traces a call to each as one opaque node with a fake (meta) implementation that gives
its output shapes, so the layer step stays one graph. The dispatcher runs the op's implementation for the tensor's
device, and each implementation is the eager layer's own code
(:func:`fp8_lightning.ops.dispatch.fast_quantize_mx_operands`,
:func:`fp8_lightning.gemm.fp8_mm`): on CPU the C codec and the float GEMM, on CUDA the Triton MX kernel, cuBLAS
``_scaled_mm`` or the Triton MX GEMM. A compiled step therefore computes the same bits as an eager one.

Per-tensor casts are not ops: the traced step writes them as plain tensor operations
(the per-tensor recipes' ``traced_cast``), which the compiler fuses with their neighbours. Nor is the per-tensor
GEMM where it is ``torch._scaled_mm`` (CUDA): the graph holds that aten op itself
(:func:`fp8_lightning.gemm.scaled_mm`).
"""

from __future__ import annotations

from typing import Optional

import torch

from fp8_lightning.fine_grained import reference_fine_cast, tile_kind
from fp8_lightning.gemm import fp8_mm
from fp8_lightning.mx import E8M0_DTYPE
from fp8_lightning.ops.dispatch import dequantize_operand, fast_quantize_mx_operands, fine_caster
from fp8_lightning.ops.registry import hot_op
from fp8_lightning.quantize import Quantized, is_transposed_2d


def _empty(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.new_empty((0,), dtype=dtype)


# --------------------------------------------------------------------------------------------------------
# MXFP8 casts
# --------------------------------------------------------------------------------------------------------


def _columns_layout(x: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The columnwise copy's layout: CPU quantizes it in x's own layout and hands out a transposed view; the CUDA
    kernel writes it contiguous. The fake and the real op agree on it."""
    if x.device.type == "cpu":
        return x.new_empty((shape[1], shape[0]), dtype=dtype).t()
    return x.new_empty(shape, dtype=dtype)


def _mx_operand_cast_fake(x, block_size, scale_rounding, dtype, columnwise):
    m, k = x.shape
    row, row_scale = x.new_empty((m, k), dtype=dtype), x.new_empty((m, k // block_size), dtype=E8M0_DTYPE)
    if not columnwise:
        return row, row_scale, _empty(x, dtype), _empty(x, E8M0_DTYPE)
    m_pad = -(-m // block_size) * block_size
    col = _columns_layout(x, (k, m_pad), dtype)
    col_scale = _columns_layout(x, (k, m_pad // block_size), E8M0_DTYPE)
    return row, row_scale, col, col_scale


@hot_op("mx_operand_cast", fake=_mx_operand_cast_fake)
def mx_operand_cast(
    x: torch.Tensor, block_size: int, scale_rounding: str, dtype: torch.dtype, columnwise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    row, col = fast_quantize_mx_operands(x, block_size, scale_rounding, dtype, columnwise, columnwise_f32=False)
    if col is None:
        return row.data, row.scale, _empty(x, dtype), _empty(x, row.scale.dtype)
    return row.data, row.scale, _in_layout(x, col.data), _in_layout(x, col.scale)


def _in_layout(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` in the layout :func:`_columns_layout` promises for ``x``'s device (a copy only where it differs)."""
    want_transposed = x.device.type == "cpu"
    if want_transposed == is_transposed_2d(t):
        return t
    return t.t().contiguous().t() if want_transposed else t.contiguous()


# --------------------------------------------------------------------------------------------------------
# Rowwise and blockwise casts
# --------------------------------------------------------------------------------------------------------


def _tile_layout(m: int, k: int, tile: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """(its codes' shape, its scales' shape) of one copy ``kernels.fine_cast`` makes: tiles (0, 1) and (128, 1)
    reduce down x's columns (the operand of x.T); 0 means the whole dimension."""
    along_m = 1 if tile[0] == 0 else -(-m // tile[0])
    along_k = 1 if tile[1] == 0 else -(-k // tile[1])
    if tile[1] == 1 and tile[0] != 1:
        return (k, m), (k, along_m)
    return (m, k), (along_m, along_k)


def _fine_tile_cast_fake(x, dtype, tile_rows, tile_cols, power_of_2, eps):
    shape, scale_shape = _tile_layout(*x.shape, (tile_rows, tile_cols))
    return x.new_empty(shape, dtype=dtype), x.new_empty(scale_shape, dtype=torch.float32)


@hot_op("fine_tile_cast", fake=_fine_tile_cast_fake)
def fine_tile_cast(
    x: torch.Tensor, dtype: torch.dtype, tile_rows: int, tile_cols: int, power_of_2: bool, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    cast = fine_caster(x) or reference_fine_cast
    q = cast(x, dtype, (tile_rows, tile_cols), power_of_2, eps)[0]
    return q.data.contiguous(), q.scale.contiguous()  # the fake's layouts


def traced_tile_cast(
    x: torch.Tensor, dtype: torch.dtype, tile: tuple[int, int], power_of_2: bool, eps: float = 1e-12,
    transpose: bool = False,
) -> tuple[Quantized, Quantized | None]:
    """``kernels.fine_cast`` as traceable code: one copy through the custom op (the eager layer's own cast behind
    it: Triton, the C codec or the reference), and with ``transpose`` the operand of ``x.T`` from the same blocks
    (views, made here: an op's outputs may not alias each other)."""
    data, scale = fine_tile_cast(x, dtype, tile[0], tile[1], power_of_2, eps)
    kind = tile_kind(tile)
    return Quantized(data, scale, kind), (Quantized(data.t(), scale.t(), kind) if transpose else None)


# --------------------------------------------------------------------------------------------------------
# An operand's values
# --------------------------------------------------------------------------------------------------------


def _operand_values_fake(data, scale, kind):
    return data.new_empty(data.shape, dtype=torch.float32)


@hot_op("operand_values", fake=_operand_values_fake)
def operand_values(data: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    """The float32 values of an operand (codes times scales), as the emulated GEMMs multiply them."""
    return dequantize_operand(Quantized(data, scale, kind), torch.float32).contiguous()


# --------------------------------------------------------------------------------------------------------
# The scaled GEMM
# --------------------------------------------------------------------------------------------------------


def _scaled_gemm_fake(a, a_scale, b, b_scale, bias, kind, out_dtype, emulate, fast_accum):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@hot_op("scaled_gemm", fake=_scaled_gemm_fake)
def scaled_gemm(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, bias: Optional[torch.Tensor],
    kind: str, out_dtype: torch.dtype, emulate: bool, fast_accum: bool,
) -> torch.Tensor:
    return fp8_mm(Quantized(a, a_scale, kind), Quantized(b, b_scale, kind), out_dtype, emulate, bias, fast_accum)
