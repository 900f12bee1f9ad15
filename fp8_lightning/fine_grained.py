"""The rowwise and blockwise recipes behind the layer's three seams: operand casts, the GEMM, the traced cast op.

Their math is in :mod:`fp8_lightning.rowwise` and :mod:`fp8_lightning.blockwise`; this module routes to it by recipe
(for casts) and by operand kind (for GEMMs), so that the layer (:mod:`fp8_lightning.linear`), the GEMM dispatch
(:mod:`fp8_lightning.gemm`) and the traced step (:mod:`fp8_lightning.traced`) each need one call:

* :func:`fine_operands`: the operand of a 2-D tensor reducing over its last dimension, and the operand of its
  transpose, as :class:`~fp8_lightning.quantize.Quantized` of kind ``"row"``, ``"block"`` or, for a weight gradient
  kept in high precision, ``"hp"``.
* :func:`fine_mm`: ``a @ b.T (+ bias)`` for two operands of one of those kinds.
* ``torch.ops.fp8_lightning.fine_operand_cast``: the casts as a ``torch.library`` custom op with a fake
  implementation, so that ``torch.compile`` traces the layer step as one graph (:func:`traced_fine_cast`).

Like per-tensor current scaling these recipes keep no state between steps: every scale comes from the tensor
being cast, so there is nothing to synchronise across ranks or to checkpoint beyond the recipe itself.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.library import custom_op

from fp8_lightning.blockwise import (
    COLUMN_TILE,
    ROW_TILE,
    TILE,
    WEIGHT_BLOCK,
    blockwise_mm,
    dequantize_blockwise,
    quantize_blockwise,
)
from fp8_lightning.kernels.fine_grained_layout import ROWWISE_TILES
from fp8_lightning.quantize import Quantized
from fp8_lightning.recipes import BlockwiseScaling, Recipe, RowwiseScaling
from fp8_lightning.rowwise import (
    dequantize_rowwise,
    high_precision_mm,
    high_precision_operand,
    quantize_rowwise,
    rowwise_mm,
    tensorwise_column_operand,
)

FINE_KINDS = ("row", "block", "hp")


def is_fine_grained(recipe: Recipe) -> bool:
    return isinstance(recipe, (RowwiseScaling, BlockwiseScaling))


def operand_kind(recipe: Recipe) -> str:
    """The kind of the operands a recipe's casts make (the weight gradient's may be ``"hp"``, see
    :func:`wgrad_kind`)."""
    return "row" if isinstance(recipe, RowwiseScaling) else "block"


def wgrad_kind(recipe: Recipe) -> str:
    """The kind of the weight-gradient GEMM's operands: ``"hp"`` when it runs in high precision."""
    return "hp" if getattr(recipe, "high_precision_wgrad", False) else operand_kind(recipe)


def fine_operands(
    recipe: Recipe, role: str, x: torch.Tensor, dtype: torch.dtype, columnwise: bool, cast=None
) -> tuple[Quantized, Quantized | None]:
    """(operand of ``x``, operand of ``x.T`` when ``columnwise``) of a 2-D ``x`` in GEMM role ``role``
    (``"input"``, ``"weight"`` or ``"grad_output"``) under a rowwise or blockwise recipe: which copies each role
    gets (see the modules :mod:`~fp8_lightning.rowwise` and :mod:`~fp8_lightning.blockwise`), each made by ``cast``,
    a function with ``kernels.fine_cast``'s signature (default :func:`reference_fine_cast`; the Triton kernel and
    the C codec in :func:`fp8_lightning.backends.fine_operands`). A high-precision weight gradient's copies (``x.T``
    itself, ``W.T`` with one scale) are made by the reference."""
    cast = cast or reference_fine_cast
    power_of_2 = recipe.power_of_2_scales
    if isinstance(recipe, BlockwiseScaling):
        if role == "weight":  # 128x128 blocks: W.T's operand is the same blocks, transposed
            return cast(x, dtype, WEIGHT_BLOCK, power_of_2, transpose=columnwise)
        row = cast(x, dtype, ROW_TILE, power_of_2)[0]
        return row, (cast(x, dtype, COLUMN_TILE, power_of_2)[0] if columnwise else None)
    per_row, per_column = ROWWISE_TILES
    row = cast(x, dtype, per_row, power_of_2, recipe.eps)[0]
    if not columnwise:
        return row, None
    if not recipe.high_precision_wgrad:
        return row, cast(x, dtype, per_column, power_of_2, recipe.eps)[0]
    if role == "weight":
        return row, tensorwise_column_operand(x, dtype, recipe.eps, power_of_2)
    return row, high_precision_operand(x)


def reference_fine_cast(
    x: torch.Tensor, dtype: torch.dtype, tile: tuple[int, int], power_of_2: bool, eps: float = 1e-12,
    transpose: bool = False,
) -> tuple[Quantized, Quantized | None]:
    """``kernels.fine_cast`` from the reference casts (:func:`fine_cast_twin`): the operand of one copy, and with
    ``transpose`` (128x128 blocks) the operand of ``x.T`` from the same blocks."""
    data, scale = fine_cast_twin(x, tile, dtype, power_of_2, eps)
    kind = "row" if 0 in tile else "block"
    return Quantized(data, scale, kind), (Quantized(data.t(), scale.t(), kind) if transpose else None)


def fine_cast_twin(
    x: torch.Tensor, tile: tuple[int, int], dtype: torch.dtype, power_of_2: bool, eps: float = 1e-12
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale)`` of one copy as ``kernels.fine_cast`` makes it, from the reference casts: ``tile`` (1, 0) or
    (0, 1) one scale per row or per column (rowwise, ``eps``), else a blockwise tile; the copies scaled down x's
    columns ((0, 1), (128, 1)) are the operand of ``x.T`` (transposed views here)."""
    if tile in ROWWISE_TILES:
        data, scale = quantize_rowwise(x, dtype, -1 if tile == ROWWISE_TILES[0] else 0, eps, power_of_2)
    else:
        data, scale = quantize_blockwise(x, tile, dtype, power_of_2)
    return (data.t(), scale.t()) if tile in (ROWWISE_TILES[1], COLUMN_TILE) else (data, scale)


def fine_dequantize(q: Quantized) -> torch.Tensor:
    """The float32 values an operand of a fine-grained kind stands for."""
    if q.kind == "row":
        return dequantize_rowwise(q.data, q.scale)
    if q.kind == "block":
        return dequantize_blockwise(q.data, q.scale)
    return q.data.float()


def fine_mm(
    a: Quantized, b: Quantized, out_dtype: torch.dtype, emulate: bool = False, bias: torch.Tensor | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``a @ b.T (+ bias)`` for rowwise, blockwise or high-precision operands with K last. ``emulate``: multiply the
    dequantized operands in float32 (GPUs without the scaled GEMM). ``fast_accum``: the recipe's fast accumulation
    for this GEMM, which cuBLAS's rowwise GEMM takes; its 1x128 / 128x128 block-scaled GEMM is left to its own
    accumulation (it promotes the partial sums of every 128-long slice of K to float32 with that slice's scales,
    the precision block scaling is chosen for), and the CPU GEMMs accumulate in float32."""
    if a.kind == "hp":
        out = high_precision_mm(a, b, out_dtype)
    elif a.kind == "block":
        out = blockwise_mm(a, b, out_dtype, emulate)
    elif emulate:
        out = (fine_dequantize(a) @ fine_dequantize(b).t()).to(out_dtype)
    else:
        out = rowwise_mm(a, b, out_dtype, fast_accum)
    return out if bias is None else out + bias.to(out.dtype)


# --------------------------------------------------------------------------------------------------------
# The traced cast
# --------------------------------------------------------------------------------------------------------


class FineCastPlan(NamedTuple):
    """The recipe fields a traced cast needs, in plain values (a constant to the compiler)."""

    blockwise: bool
    power_of_2: bool
    eps: float
    high_precision_wgrad: bool


def fine_cast_plan(recipe: Recipe) -> FineCastPlan:
    return FineCastPlan(
        isinstance(recipe, BlockwiseScaling), recipe.power_of_2_scales, getattr(recipe, "eps", 0.0),
        getattr(recipe, "high_precision_wgrad", False),
    )


def _recipe(blockwise: bool, power_of_2: bool, eps: float, high_precision_wgrad: bool) -> Recipe:
    if blockwise:
        return BlockwiseScaling(power_of_2_scales=power_of_2)
    return RowwiseScaling(power_of_2_scales=power_of_2, eps=eps, high_precision_wgrad=high_precision_wgrad)


def _column_source(plan: FineCastPlan, role: str) -> str:
    """How the operand of ``x.T`` is made: ``"cast"`` (quantized down x's columns, by the op), ``"transpose"``
    (the weight's 128x128 blocks) or ``"hp"`` (x itself, for a high-precision weight gradient)."""
    if plan.blockwise and role == "weight":
        return "transpose"
    if plan.high_precision_wgrad and role != "weight":
        return "hp"
    return "cast"


@custom_op("fp8_lightning::fine_operand_cast", mutates_args=())
def fine_operand_cast(
    x: torch.Tensor, role: str, dtype: torch.dtype, blockwise: bool, power_of_2: bool, eps: float,
    high_precision_wgrad: bool, columnwise: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from fp8_lightning.backends import fine_operands as cast  # the CUDA branch (backends imports this module)

    recipe = _recipe(blockwise, power_of_2, eps, high_precision_wgrad)
    row, col = cast(recipe, role, x, dtype, columnwise)
    if col is None:
        return row.data, row.scale.contiguous(), x.new_empty((0,), dtype=dtype), x.new_empty((0,), dtype=torch.float32)
    return row.data, row.scale.contiguous(), col.data.contiguous(), col.scale.contiguous()  # the fake's layouts


@fine_operand_cast.register_fake
def _(x, role, dtype, blockwise, power_of_2, eps, high_precision_wgrad, columnwise):
    m, k = x.shape
    if blockwise:
        rows = TILE if role == "weight" else 1
        row_scale = x.new_empty((-(-m // rows), -(-k // TILE)), dtype=torch.float32)
        col_scale = (k, -(-m // TILE))
    else:
        row_scale, col_scale = x.new_empty((m, 1), dtype=torch.float32), (k, 1)
    row = x.new_empty((m, k), dtype=dtype)
    if not columnwise:
        return row, row_scale, x.new_empty((0,), dtype=dtype), x.new_empty((0,), dtype=torch.float32)
    return row, row_scale, x.new_empty((k, m), dtype=dtype), x.new_empty(col_scale, dtype=torch.float32)


def traced_fine_cast(
    x: torch.Tensor, plan: FineCastPlan, role: str, dtype: torch.dtype, columnwise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data, scale, columnwise data, columnwise scale) of a 2-D ``x``, as :func:`fine_operands` makes them, through
    the custom op; the copies that are views (the weight's transposed blocks, a high-precision ``x.T``) are made
    here, outside the op, whose outputs may not alias its input or each other."""
    source = _column_source(plan, role) if columnwise else "cast"
    row, row_scale, col, col_scale = fine_operand_cast(
        x, role, dtype, plan.blockwise, plan.power_of_2, plan.eps, plan.high_precision_wgrad,
        columnwise and source == "cast",
    )
    if source == "transpose":
        col, col_scale = row.t(), row_scale.t()
    elif source == "hp":
        col, col_scale = x.t(), x.new_empty((0,), dtype=torch.float32)
    return row, row_scale, col, col_scale
