"""The FP8 experts' grouped GEMMs as code ``torch.compile`` traces into one graph (``fullgraph=True``).

A converted experts module runs this path while it is being compiled, and :func:`~fp8_lightning.grouped.gemm.
fp8_grouped_mm` otherwise; both compute the same bits. The eager path reads the groups on the host (their bounds
pick each group's rows); here the graph never does:

* the casts of the input, of each expert's weight and of the output gradient are the recipes' traced casts
  (:meth:`~fp8_lightning.recipes.base.Recipe.traced_cast`), with delayed scaling's state updated in place;
* the grouped products take ``offs`` as a device tensor: three custom ops (:func:`~fp8_lightning.ops.registry.
  hot_op`) with fakes whose shapes never depend on the group sizes: ``grouped_values_mm`` (the float32 grouped
  GEMM of the operands' exact values, the eager emulated GEMM), ``operand_values`` (an operand's float32 values)
  and ``grouped_column_values`` (each group's ``x.T`` operand quantized along that group's tokens, as (M, K)
  values, for the weight gradient). Per-tensor recipes need no per-group cast: each group's ``x.T`` is a view of
  the rowwise codes (:meth:`~fp8_lightning.recipes.base.Recipe.grouped_columns_from_rows`); rowwise, MXFP8 and
  blockwise make the per-group copies on the device (:meth:`~fp8_lightning.recipes.base.Recipe.
  traced_grouped_columns`); ``grouped_column_values`` serves a recipe that does not.

What the graph does not see is host work inside an op: on the CPU none (``torch._grouped_mm`` takes ``offs`` on
the device); the grouped products on CUDA read the group bounds inside their op, one host wait per op, as the
eager path does. The traced path emulates the grouped
GEMMs (float32 products of the FP8 values), the eager path's CPU route; it saves float32 values for backward.
"""

from __future__ import annotations

import json

import torch

from fp8_lightning.grouped.gemm import GroupedScaling, grouped_product
from fp8_lightning.ops.dispatch import dequantize_operand
from fp8_lightning.ops.layer import operand_values
from fp8_lightning.ops.registry import hot_op
from fp8_lightning.recipes import Recipe, recipe_from
from fp8_lightning.traced import TracedPlan, make_plan


def _host_bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()
    return list(zip([0, *ends[:-1]], ends))


# --------------------------------------------------------------------------------------------------------
# The ops
# --------------------------------------------------------------------------------------------------------


def _values_mm_fake(a, b, offs):
    if b.dim() == 3:
        return a.new_empty((a.shape[0], b.shape[2]))
    return a.new_empty((offs.shape[0], a.shape[0], b.shape[1]))


@hot_op("grouped_values_mm", fake=_values_mm_fake)
def grouped_values_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The eager path's float32 grouped product: 2-D x 3-D (E, K, N) per group of rows, or 2-D (K, M) x 2-D (M, N)
    reduced over each group's tokens (E, K, N). The CPU takes ``offs`` on the device; elsewhere the bounds are read
    here."""
    return grouped_product(a, b, offs, [] if a.is_cpu else _host_bounds(offs))


def _column_values_fake(x, offs, recipe, role, dtype):
    return x.new_empty(x.shape, dtype=torch.float32)


@hot_op("grouped_column_values", fake=_column_values_fake)
def grouped_column_values(
    x: torch.Tensor, offs: torch.Tensor, recipe: str, role: str, dtype: torch.dtype
) -> torch.Tensor:
    """(M, K) float32: row ``i`` of group ``e`` holds the values of group ``e``'s ``x.T`` operand (the recipe's
    :meth:`~fp8_lightning.recipes.base.Recipe.grouped_operands`, quantized along the group's tokens) at token
    ``i``. ``recipe``: the recipe's ``to_dict()`` as JSON."""
    bounds = _host_bounds(offs)
    columns = recipe_from(json.loads(recipe)).grouped_operands(role, x, bounds, dtype, True, None, True)[1]
    parts = [dequantize_operand(q, torch.float32)[:, : end - start]
             for q, (start, end) in zip(columns, bounds) if q is not None]  # fmt: skip
    if not parts:
        return x.new_zeros(x.shape, dtype=torch.float32)
    return torch.cat(parts, dim=1).t().contiguous()


# --------------------------------------------------------------------------------------------------------
# The step
# --------------------------------------------------------------------------------------------------------


def _columns(plan: TracedPlan, key: str, x: torch.Tensor, offs: torch.Tensor, rows: torch.Tensor, dtype, role: str):
    """Each group's ``x.T`` operand values, (M, K): the rowwise values where they are the same codes. ``key``: the
    recipe as :func:`recipe_key` gives it."""
    if plan.recipe.grouped_columns_from_rows():
        return rows
    made = plan.recipe.traced_grouped_columns(x, offs, dtype, role)
    return grouped_column_values(x, offs, key, role, dtype) if made is None else made


def recipe_key(recipe: Recipe) -> str:
    """The recipe as the ops take it (JSON of ``to_dict()``); made outside any trace (the compiler cannot trace
    ``json``)."""
    return json.dumps(recipe.to_dict())


class TracedGroupedFunction(torch.autograd.Function):
    """``y = grouped(a @ W_e.T)`` from the float32 values of FP8 operands cast before it (the graph's inputs);
    the output gradient is cast in backward, by the recipe's traced cast."""

    @staticmethod
    def forward(ctx, a, weight, offs, plan, key, x_rows, x_columns, w_kn, w_nk, *grad_state):
        y = grouped_values_mm(x_rows, w_kn, offs)
        x_columns = x_rows if x_columns is None else x_columns  # None: the same values (a tensor enters once)
        ctx.save_for_backward(offs, x_columns, w_nk, *grad_state)
        ctx.plan, ctx.key, ctx.dtypes, ctx.inputs = plan, key, (a.dtype, weight.dtype), len(grad_state)
        return y.to(plan.out_dtype)

    @staticmethod
    def backward(ctx, grad_y):
        offs, x_columns, w_nk, *grad_state = ctx.saved_tensors
        plan, (a_dtype, w_dtype) = ctx.plan, ctx.dtypes
        needs_a, needs_w = ctx.needs_input_grad[:2]
        g = grad_y.contiguous()
        data, scale = plan.recipe.traced_cast(
            g, tuple(grad_state), plan, "grad_output", plan.backward_dtype, False, True
        )[:2]  # a plan with inverses also hands out the copies' 1 / scale
        g_rows = operand_values(data, scale, plan.kind)
        grad_a = grad_w = None
        # ------------------------------------------------ dgrad ------------------------------------------------
        if needs_a:
            grad_a = grouped_values_mm(g_rows, w_nk, offs).to(a_dtype)
        # ------------------------------------------------ wgrad ------------------------------------------------
        if needs_w:
            g_columns = _columns(plan, ctx.key, g, offs, g_rows, plan.backward_dtype, "grad_output")
            grad_w = grouped_values_mm(g_columns.t().contiguous(), x_columns, offs).to(w_dtype)
        return (grad_a, grad_w) + (None,) * (7 + ctx.inputs)


def _state(state) -> tuple[torch.Tensor, ...]:
    return () if state is None else state.traced_tensors()


def traced_grouped_mm(
    a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, scaling: GroupedScaling, out_dtype: torch.dtype,
    record: bool, key: str,
) -> torch.Tensor:
    """:func:`~fp8_lightning.grouped.gemm.fp8_grouped_mm` (``a`` (M, K), ``b`` (E, K, N)) as traceable code; ``key``:
    :func:`recipe_key` of ``scaling``'s recipe."""
    recipe: Recipe = scaling.recipe
    plan = make_plan(recipe, a.device, out_dtype, False)
    weight = b.transpose(1, 2)  # (E, N, K): each expert's weight as a linear layer holds it
    x = a.detach()
    cast = recipe.traced_cast
    data, scale = cast(x, _state(scaling.operands.get("input")), plan, "input", plan.forward_dtype, False,
                       record)[:2]  # fmt: skip
    x_rows = operand_values(data, scale, plan.kind)
    x_columns = None
    if not recipe.grouped_columns_from_rows():
        x_columns = _columns(plan, key, x, offs, x_rows, plan.forward_dtype, "input")
    w_kn, w_nk = [], []
    for expert, state in zip(weight.detach(), scaling.expert_states):
        row, row_scale, col, col_scale = cast(expert, _state(state), plan, "weight", plan.forward_dtype, True,
                                              record)[:4]  # fmt: skip
        w_kn.append(operand_values(row, row_scale, plan.kind).t())
        w_nk.append(operand_values(col, row_scale if col_scale is None else col_scale, plan.kind).t())
    grad_state = _state(scaling.operands.get("grad_output"))
    return TracedGroupedFunction.apply(
        a, weight, offs, plan, key, x_rows, x_columns, torch.stack(w_kn), torch.stack(w_nk), *grad_state
    )


__all__ = ["TracedGroupedFunction", "grouped_column_values", "grouped_values_mm", "recipe_key", "traced_grouped_mm"]
