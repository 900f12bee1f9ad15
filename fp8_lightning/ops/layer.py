"""The traced layer step's opaque hot operations, declared as ops (:func:`~fp8_lightning.ops.registry.hot_op`).

    torch.ops.fp8_lightning.mx_operand_cast(x, block_size, scale_rounding, dtype, columnwise)
                                         -> (row, row_scale, col, col_scale)
        MXFP8 rowwise and (optionally) columnwise copies of a 2-D tensor from one read
    torch.ops.fp8_lightning.fine_tile_cast(x, dtype, tile_rows, tile_cols, power_of_2, eps) -> (data, scale, inverse)
        one rowwise or blockwise copy of a 2-D tensor with its 1 / scale, in the cast's (cuBLAS's) layouts
    torch.ops.fp8_lightning.block_cast_transposed(x, dtype, power_of_2, eps) -> (data, scale, inverse, data_t, ...)
        on CUDA, the 128x128 copy and the copy of x.T from the same blocks, from one launch
    torch.ops.fp8_lightning.operand_values(data, scale, kind) -> float32 values
        an operand's codes times its scales
    torch.ops.fp8_lightning.scaled_gemm(a, a_scale, a_inverse, b, b_scale, b_inverse, bias, kind, out_dtype,
                                        emulate, fast_accum) -> out
        ``a @ b.T (+ bias)`` for FP8 operands with K last (the CPU float GEMM, MX, rowwise and blockwise GEMMs)

Why ops: ``torch.compile`` traces a call to each as one opaque node with a fake (meta) implementation that gives
its output shapes, so the layer step stays one graph. The dispatcher runs the op's implementation for the tensor's
device, and each implementation is the eager layer's own code (:func:`fp8_lightning.ops.dispatch.fast_fine_operands`,
:func:`~fp8_lightning.ops.dispatch.fast_quantize_mx_operands`, :func:`fp8_lightning.gemm.fp8_mm`): on CPU the C codec
and the float GEMM, on CUDA the Triton casts, cuBLAS or the Triton MX GEMM. A compiled step computes the eager bits.

Per-tensor casts are not ops: the traced step writes them as plain tensor operations (the per-tensor recipes'
``traced_cast``), which the compiler fuses with their neighbours. Nor is the per-tensor GEMM where it is
``torch._scaled_mm`` (CUDA): the graph holds that aten op itself (:func:`fp8_lightning.gemm.scaled_mm`).
"""

from __future__ import annotations

from typing import Optional

import torch

from fp8_lightning.fine_grained import reference_fine_cast, tile_kind
from fp8_lightning.gemm import fp8_mm
from fp8_lightning.kernels.fine_grained_layout import BLOCKWISE_EDGE, output_layouts
from fp8_lightning.mx import E8M0_DTYPE
from fp8_lightning.ops.dispatch import dequantize_operand, fast_quantize_mx_operands, fine_caster
from fp8_lightning.ops.registry import hot_op
from fp8_lightning.quantize import OperandCache, OperandKind, Quantized, is_transposed_2d


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


def _kernel_layouts(x: torch.Tensor) -> bool:
    """Whether the copies of ``x`` lie in the CUDA cast kernel's layouts (cuBLAS's, with the 128x128 blocks'
    transposed copy written by the same launch); elsewhere they are contiguous and a transpose is made of views."""
    return x.device.type == "cuda"


def _fine_layouts(x: torch.Tensor, tile: tuple[int, int], transpose: bool) -> dict:
    """(shape, strides) of each output of :func:`fine_tile_cast` on ``x``'s device: ``data``, ``scale`` (its inverse
    alike) and, where the kernel writes the transposed copy, ``data_t`` and ``scale_t``."""
    if _kernel_layouts(x):
        return output_layouts(tuple(x.shape), tile, transpose and tile == (BLOCKWISE_EDGE, BLOCKWISE_EDGE))
    shape, scale_shape = _tile_layout(*x.shape, tile)
    return {"data": (shape, (shape[1], 1)), "scale": (scale_shape, (scale_shape[1], 1))}


def _fine_tile_cast_fake(x, dtype, tile_rows, tile_cols, power_of_2, eps):
    layouts, f32 = _fine_layouts(x, (tile_rows, tile_cols), False), torch.float32
    data = x.new_empty_strided(*layouts["data"], dtype=dtype)
    return data, x.new_empty_strided(*layouts["scale"], dtype=f32), x.new_empty_strided(*layouts["scale"], dtype=f32)


def _laid_out(t: torch.Tensor, layout: tuple) -> torch.Tensor:
    """``t`` with the (shape, strides) ``layout``: itself where it has them, else a copy."""
    shape, strides = layout
    if tuple(t.shape) == tuple(shape) and all(n == 1 or a == b for n, a, b in zip(shape, t.stride(), strides)):
        return t
    return t.new_empty_strided(*layout).copy_(t)


def _cast_copies(x, dtype, tile, power_of_2, eps, transpose) -> list[torch.Tensor]:
    """(data, scale, inverse) of the copy and, with ``transpose``, of the operand of ``x.T``, in the layouts the
    fakes declare: the CUDA kernel's as they are, another cast's copied into them (contiguous off CUDA)."""
    cast = fine_caster(x) or reference_fine_cast
    copies = [q for q in cast(x, dtype, tile, power_of_2, eps, transpose=transpose) if q is not None]
    if not _kernel_layouts(x):
        return [t.contiguous() for q in copies for t in (q.data, q.scale, q.inverse_scale())]
    layouts = _fine_layouts(x, tile, transpose)
    out = []
    for q, data_at, scale_at in zip(copies, ("data", "data_t"), ("scale", "scale_t")):
        out += [_laid_out(q.data, layouts[data_at]), _laid_out(q.scale, layouts[scale_at]),
                _laid_out(q.inverse_scale(), layouts[scale_at])]  # fmt: skip
    return out


@hot_op("fine_tile_cast", fake=_fine_tile_cast_fake)
def fine_tile_cast(
    x: torch.Tensor, dtype: torch.dtype, tile_rows: int, tile_cols: int, power_of_2: bool, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(_cast_copies(x, dtype, (tile_rows, tile_cols), power_of_2, eps, False))


def _block_cast_transposed_fake(x, dtype, power_of_2, eps):
    layouts, f32 = _fine_layouts(x, (BLOCKWISE_EDGE, BLOCKWISE_EDGE), True), torch.float32
    out = []
    for data_at, scale_at in (("data", "scale"), ("data_t", "scale_t")):
        out += [x.new_empty_strided(*layouts[data_at], dtype=dtype)]
        out += [x.new_empty_strided(*layouts[scale_at], dtype=f32) for _ in range(2)]
    return tuple(out)


@hot_op("block_cast_transposed", fake=_block_cast_transposed_fake)
def block_cast_transposed(
    x: torch.Tensor, dtype: torch.dtype, power_of_2: bool, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """On CUDA: the 128x128 copy of ``x`` and the operand of ``x.T`` from the same blocks, both written by one launch
    of the kernel (each as (data, scale, inverse))."""
    return tuple(_cast_copies(x, dtype, (BLOCKWISE_EDGE, BLOCKWISE_EDGE), power_of_2, eps, True))


def traced_tile_cast(
    x: torch.Tensor, dtype: torch.dtype, tile: tuple[int, int], power_of_2: bool, eps: float = 1e-12,
    transpose: bool = False,
) -> tuple[Quantized, Quantized | None]:
    """``kernels.fine_cast`` as traceable code: one copy through the custom op (the eager layer's own cast behind
    it: Triton, the C codec or the reference) with its ``1 / scale``, both in the layouts the cast wrote (on CUDA
    cuBLAS's, which the GEMM then takes as they are), and with ``transpose`` the operand of ``x.T`` from the same
    blocks: on CUDA the kernel's transposed copy from the same launch, elsewhere views made here (an op's outputs may
    not alias each other)."""
    kind = tile_kind(tile)
    if transpose and _kernel_layouts(x):
        data, scale, inverse, data_t, scale_t, inverse_t = block_cast_transposed(x, dtype, power_of_2, eps)
        return _with_inverse(data, scale, kind, inverse), _with_inverse(data_t, scale_t, kind, inverse_t)
    data, scale, inverse = fine_tile_cast(x, dtype, tile[0], tile[1], power_of_2, eps)
    row = _with_inverse(data, scale, kind, inverse)
    return row, (_with_inverse(data.t(), scale.t(), kind, inverse.t()) if transpose else None)


def _with_inverse(data, scale, kind, inverse) -> Quantized:
    return Quantized(data, scale, kind, OperandCache(inverse=inverse))


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


def _scaled_gemm_fake(a, a_scale, a_inverse, b, b_scale, b_inverse, bias, kind, out_dtype, emulate, fast_accum):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@hot_op("scaled_gemm", fake=_scaled_gemm_fake)
def scaled_gemm(
    a: torch.Tensor, a_scale: torch.Tensor, a_inverse: Optional[torch.Tensor], b: torch.Tensor,
    b_scale: torch.Tensor, b_inverse: Optional[torch.Tensor], bias: Optional[torch.Tensor], kind: str,
    out_dtype: torch.dtype, emulate: bool, fast_accum: bool,
) -> torch.Tensor:
    """``a @ b.T (+ bias)``; ``a_inverse``, ``b_inverse``: what the operands' casts handed out besides data and scale
    for the GEMM, else None: their ``1 / scale`` (in the layout the GEMM reads), or what the kind's
    ``traced_cache`` makes of it (NVFP4: the GEMM scales)."""
    operand_kind = OperandKind.named(kind)
    a_q = Quantized(a, a_scale, operand_kind, operand_kind.traced_cache(a_inverse))
    b_q = Quantized(b, b_scale, operand_kind, operand_kind.traced_cache(b_inverse))
    return fp8_mm(a_q, b_q, out_dtype, emulate, bias, fast_accum)
