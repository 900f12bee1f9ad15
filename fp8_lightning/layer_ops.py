"""The FP8 layer's opaque hot operations as ``torch.library`` custom ops: the seam a traced layer step calls.

    torch.ops.fp8_lightning.mx_operand_cast(x, block_size, scale_rounding, dtype, columnwise)
                                         -> (row, row_scale, col, col_scale)
        MXFP8 rowwise and (optionally) columnwise copies of a 2-D tensor from one read
    torch.ops.fp8_lightning.scaled_gemm(a, a_scale, b, b_scale, bias, kind, out_dtype, emulate, fast_accum) -> out
        ``a @ b.T (+ bias)`` for FP8 operands with K last (the CPU float GEMM, MX GEMMs)

Why ops: ``torch.compile`` traces a call to each as one opaque node with a fake (meta) implementation that gives
its output shapes, so the layer step stays one graph. The dispatcher runs the op's implementation for the tensor's
device, and each implementation is the eager layer's own code (:func:`fp8_lightning.backends.quantize_mx_operands`,
:func:`fp8_lightning.gemm.fp8_mm`): on CPU the C codec and the float GEMM, on CUDA the Triton MX kernel, cuBLAS
``_scaled_mm`` or the Triton MX GEMM. A compiled step therefore computes the same bits as an eager one.

Per-tensor casts are not ops: the traced step writes them as plain tensor operations
(:func:`fp8_lightning.traced.traced_cast`), which the compiler fuses with their neighbours. Nor is the per-tensor
GEMM where it is ``torch._scaled_mm`` (CUDA): the graph holds that aten op itself
(:func:`fp8_lightning.gemm.scaled_mm`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.library import custom_op

from fp8_lightning.gemm import fp8_mm
from fp8_lightning.backends import quantize_mx_operands
from fp8_lightning.mx import E8M0_DTYPE
from fp8_lightning.quantize import Quantized, is_transposed_2d

NAMESPACE = "fp8_lightning"


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


@custom_op(f"{NAMESPACE}::mx_operand_cast", mutates_args=())
def mx_operand_cast(
    x: torch.Tensor, block_size: int, scale_rounding: str, dtype: torch.dtype, columnwise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    row, col = quantize_mx_operands(x, block_size, scale_rounding, dtype, columnwise, columnwise_f32=False)
    if col is None:
        return row.data, row.scale, _empty(x, dtype), _empty(x, row.scale.dtype)
    return row.data, row.scale, _in_layout(x, col.data), _in_layout(x, col.scale)


def _in_layout(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` in the layout :func:`_columns_layout` promises for ``x``'s device (a copy only where it differs)."""
    want_transposed = x.device.type == "cpu"
    if want_transposed == is_transposed_2d(t):
        return t
    return t.t().contiguous().t() if want_transposed else t.contiguous()


@mx_operand_cast.register_fake
def _(x, block_size, scale_rounding, dtype, columnwise):
    m, k = x.shape
    row, row_scale = x.new_empty((m, k), dtype=dtype), x.new_empty((m, k // block_size), dtype=E8M0_DTYPE)
    if not columnwise:
        return row, row_scale, _empty(x, dtype), _empty(x, E8M0_DTYPE)
    m_pad = -(-m // block_size) * block_size
    col = _columns_layout(x, (k, m_pad), dtype)
    col_scale = _columns_layout(x, (k, m_pad // block_size), E8M0_DTYPE)
    return row, row_scale, col, col_scale


# --------------------------------------------------------------------------------------------------------
# The scaled GEMM
# --------------------------------------------------------------------------------------------------------


@custom_op(f"{NAMESPACE}::scaled_gemm", mutates_args=())
def scaled_gemm(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, bias: Optional[torch.Tensor],
    kind: str, out_dtype: torch.dtype, emulate: bool, fast_accum: bool,
) -> torch.Tensor:
    return fp8_mm(Quantized(a, a_scale, kind), Quantized(b, b_scale, kind), out_dtype, emulate, bias, fast_accum)


@scaled_gemm.register_fake
def _(a, a_scale, b, b_scale, bias, kind, out_dtype, emulate, fast_accum):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)
