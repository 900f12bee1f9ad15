"""The FP8 layer step as code ``torch.compile`` traces into one graph, for every recipe.

:class:`~fp8_lightning.linear.FP8Linear` runs this path while it is being compiled (``torch.compile(model)``, with
``fullgraph=True`` too), and its tuned eager path otherwise. Both compute the same bits: the casts and GEMMs here
are the custom ops of :mod:`fp8_lightning.layer_ops`, whose implementations are the eager layer's own code.

What makes it traceable:

* **State as tensors.** The operand scaling states' tensors (scale, pending amax, last amax, non-finite count and
  the ``[initialized, observed]`` flags) enter the graph as inputs and are updated in place by the cast op, which
  declares them mutated; the compiler functionalizes that. Nothing is assigned to a Python object inside the
  graph, so the step compiles once and is never recompiled as scales move.
* **A frozen plan.** The autograd Function gets tensors and a hashable :class:`TracedPlan` (recipe, formats,
  output dtype), never a module or a state object. The output gradient's state is among its tensor inputs and
  its cast op updates it in backward (delayed scaling books the gradient amax there).
* **No cache.** The weight is cast at every forward (under eager mode it is cast once per optimizer step and kept).

Between graphs, eagerly: ``sync_scales`` / the Lightning plugin advance the delayed histories once per optimizer
step (in eager mode a layer without them advances its own at the next training forward; compiled layers need
them). The stats monitor and the divergence guard observe each cast in Python, so a layer with an observer
attached runs its eager path as an island in the graph (one break per layer while observed).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fp8_lightning.layer_ops import mx_operand_cast, operand_cast, scaled_gemm
from fp8_lightning.recipes import Recipe
from fp8_lightning.scaling import OperandScaling


class TracedPlan(NamedTuple):
    """What the traced step needs besides tensors, in plain values: hashable, a constant to the compiler."""

    kind: str  # "tensor" (per-tensor recipes) or "mx"
    recipe_json: str  # the recipe, for the cast op (ops take strings, not objects)
    block_size: int  # MX only
    scale_rounding: str  # MX only
    forward_dtype: torch.dtype
    backward_dtype: torch.dtype
    out_dtype: torch.dtype
    emulate: bool
    transpose: bool  # the cast kernels write the transposed copies the backward GEMMs read (CUDA)


def make_plan(
    recipe: Recipe, recipe_json: str, device: torch.device, out_dtype: torch.dtype, emulate: bool
) -> TracedPlan:
    """The plan of one call; ``recipe_json`` (:func:`fp8_lightning.layer_ops.recipe_json`) is made eagerly."""
    fmt = recipe.fp8_format
    kind = "tensor" if recipe.per_tensor else "mx"
    block, rounding = (0, "") if recipe.per_tensor else (recipe.block_size, recipe.scale_rounding)
    return TracedPlan(
        kind, recipe_json, block, rounding, fmt.forward_dtype, fmt.backward_dtype, out_dtype, emulate,
        device.type == "cuda",
    )


def _state_tensors(state: OperandScaling) -> tuple[torch.Tensor, ...]:
    return state.scale, state.pending_amax, state.last_amax, state.nonfinite_count, state.flags


def _cast(x: torch.Tensor, state_tensors, plan: TracedPlan, dtype: torch.dtype, record: bool):
    """(operand (K last), operand of x.T, their scale) of a 2-D ``x`` under a per-tensor recipe."""
    data, data_t, scale = operand_cast(x, *state_tensors, plan.recipe_json, dtype, record, plan.transpose)
    return data, (data_t if plan.transpose else data.t()), scale


def _mx_cast(x: torch.Tensor, plan: TracedPlan, dtype: torch.dtype, columnwise: bool):
    """(rowwise data, scales, columnwise data, scales) of a 2-D ``x`` under MXFP8."""
    return mx_operand_cast(x, plan.block_size, plan.scale_rounding, dtype, columnwise)


def traced_linear(
    x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: TracedPlan,
    states: dict[str, OperandScaling], record: bool,
) -> torch.Tensor:
    """``x2d @ weight.T + bias`` with the three GEMMs in FP8; casts the input and the weight here (their states
    updated in place) and hands the FP8 operands to the autograd Function."""
    x, w = x2d.detach(), weight.detach()
    if plan.kind == "tensor":
        x_row, x_col, x_scale = _cast(x, _state_tensors(states["input"]), plan, plan.forward_dtype, record)
        w_row, w_col, w_scale = _cast(w, _state_tensors(states["weight"]), plan, plan.forward_dtype, record)
        x_col_scale = w_col_scale = None  # the same scales (a tensor may enter the Function only once)
        grad_state = _state_tensors(states["grad_output"])
    else:
        x_row, x_scale, x_col, x_col_scale = _mx_cast(x, plan, plan.forward_dtype, True)
        w_row, w_scale, w_col, w_col_scale = _mx_cast(w, plan, plan.forward_dtype, True)
        grad_state = ()
    return _TracedFP8Function.apply(
        x2d, weight, bias, plan, x_row, x_scale, w_row, w_scale, x_col, x_col_scale, w_col, w_col_scale, *grad_state
    )


class _TracedFP8Function(torch.autograd.Function):
    """y = x @ W.T + b from FP8 operands cast outside; x and W come in for their gradient edges only."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, plan, x_row, x_scale, w_row, w_scale, x_col, x_col_scale, w_col,
                w_col_scale, *grad_state):
        # ------------------------------------------------ fprop ------------------------------------------------
        y = scaled_gemm(x_row, x_scale, w_row, w_scale, bias, plan.kind, plan.out_dtype, plan.emulate)
        x_col_scale = x_scale if x_col_scale is None else x_col_scale
        w_col_scale = w_scale if w_col_scale is None else w_col_scale
        ctx.save_for_backward(x_col, x_col_scale, w_col, w_col_scale, *grad_state)
        ctx.plan = plan
        ctx.dtypes = (x2d.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x_col, x_col_scale, w_col, w_col_scale, *grad_state = ctx.saved_tensors
        plan, (x_dtype, w_dtype, bias_dtype) = ctx.plan, ctx.dtypes
        g = grad_y.contiguous()
        if plan.kind == "tensor":
            g_row, g_col, g_scale = _cast(g, grad_state, plan, plan.backward_dtype, True)
            g_col_scale = g_scale
        else:
            g_row, g_scale, g_col, g_col_scale = _mx_cast(g, plan, plan.backward_dtype, ctx.needs_input_grad[1])
        grad_x = grad_w = grad_bias = None
        # ------------------------------------------------ dgrad ------------------------------------------------
        if ctx.needs_input_grad[0]:
            grad_x = scaled_gemm(g_row, g_scale, w_col, w_col_scale, None, plan.kind, x_dtype, plan.emulate)
        # ------------------------------------------------ wgrad ------------------------------------------------
        if ctx.needs_input_grad[1]:
            grad_w = scaled_gemm(g_col, g_col_scale, x_col, x_col_scale, None, plan.kind, w_dtype, plan.emulate)
        if ctx.needs_input_grad[2]:
            grad_bias = g.sum(0).to(bias_dtype)
        return (grad_x, grad_w, grad_bias) + (None,) * (9 + len(grad_state))
