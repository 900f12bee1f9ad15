"""The FP8 layer step as code ``torch.compile`` traces into one graph, for every recipe.

:class:`~fp8_lightning.linear.FP8Linear` runs this path while it is being compiled (``torch.compile(model)``, with
``fullgraph=True`` too), and its tuned eager path otherwise. Both compute the same bits: the casts and GEMMs here
are the eager layer's math: plain tensor operations for per-tensor casts, and custom ops whose implementations are
the eager layer's own code for MX casts and GEMMs.

What makes it traceable:

* **State as tensors.** The operand scaling states' tensors (scale, pending amax, last amax, non-finite count and
  the ``[initialized, observed]`` flags) enter the graph as inputs and are updated in place by
  :func:`traced_cast` (plain tensor operations, the reference math of ``quantize`` and ``scaling``, which the
  compiler fuses with the layer's neighbours; it functionalizes the in-place updates). Nothing is assigned to a
  Python object inside the graph, so the step compiles once and is never recompiled as scales move. Per-tensor
  GEMMs on CUDA are ``torch._scaled_mm`` in the graph (bias in its epilogue, fast accumulation per GEMM as the
  recipe says); MX casts and the other GEMMs are the custom ops of :mod:`fp8_lightning.layer_ops` (the C codec,
  the CPU float GEMM, Triton or cuBLAS behind them).
* **A frozen plan.** The autograd Function gets tensors and a hashable :class:`TracedPlan` (recipe, formats,
  output dtype), never a module or a state object. The output gradient's state is among its tensor inputs and
  is updated in backward (delayed scaling books the gradient amax there).
* **No cache.** The weight is cast at every forward (under eager mode it is cast once per optimizer step and kept).

Between graphs, eagerly: ``sync_scales`` / the Lightning plugin advance the delayed histories once per optimizer
step (in eager mode a layer without them advances its own at the next training forward; compiled layers need
them). The stats monitor and the divergence guard observe each cast in Python, so a layer with an observer
attached runs its eager path as an island in the graph (one break per layer while observed).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fp8_lightning.gemm import scaled_mm
from fp8_lightning.layer_ops import scaled_gemm
from fp8_lightning.quantize import OperandKind
from fp8_lightning.scaling import OperandScaling


class TracedPlan(NamedTuple):
    """What the traced step needs besides tensors: hashable, a constant to the compiler."""

    recipe: Any  # the frozen recipe: its traced_cast makes the operands
    kind: OperandKind  # the kind of the operands its casts make
    wgrad_kind: OperandKind  # the weight-gradient GEMM's operand kind (``kind``, or high precision)
    forward_dtype: torch.dtype
    backward_dtype: torch.dtype
    out_dtype: torch.dtype
    emulate: bool
    transpose: bool  # the cast kernels write the transposed copies the backward GEMMs read (CUDA)
    scaled_mm: bool  # the GEMMs are torch._scaled_mm itself in the graph (per-tensor on CUDA)
    fprop_fast_accum: bool
    grad_fast_accum: bool


def plan_for(
    recipe: Any, device: torch.device, out_dtype: torch.dtype, emulate: bool, scaled_mm: bool = False,
    wgrad_kind: OperandKind | None = None,
) -> TracedPlan:
    """The plan of one call of ``recipe`` (its ``traced_plan`` fills in what is its own)."""
    fmt = recipe.fp8_format
    return TracedPlan(
        recipe, recipe.operand_kind, wgrad_kind or recipe.operand_kind, fmt.forward_dtype, fmt.backward_dtype,
        out_dtype, emulate, device.type == "cuda", scaled_mm, recipe.fprop_fast_accum, recipe.grad_fast_accum,
    )


def make_plan(recipe: Any, device: torch.device, out_dtype: torch.dtype, emulate: bool) -> TracedPlan:
    """The plan of one call, from the recipe (:meth:`~fp8_lightning.recipes.base.Recipe.traced_plan`)."""
    return recipe.traced_plan(device, out_dtype, emulate)


def _gemm(plan: TracedPlan, a, a_scale, b, b_scale, bias, out_dtype: torch.dtype, fast_accum: bool, kind=None):
    """``a @ b.T (+ bias)`` of FP8 operands of ``kind`` (default: the plan's): ``torch._scaled_mm`` in the graph
    where it is the GEMM, else the custom op (the eager layer's GEMM: CPU float GEMM, MX, rowwise and blockwise)."""
    if plan.scaled_mm:
        return scaled_mm(a, a_scale.reciprocal(), b, b_scale.reciprocal(), out_dtype, bias, fast_accum)
    return scaled_gemm(a, a_scale, b, b_scale, bias, kind or plan.kind, out_dtype, plan.emulate, fast_accum)


def _state_tensors(state: OperandScaling | None) -> tuple[torch.Tensor, ...]:
    if state is None:
        return ()
    return state.scale, state.pending_amax, state.last_amax, state.nonfinite_count, state.flags


def traced_linear(
    x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: TracedPlan,
    states: dict[str, OperandScaling], record: bool,
) -> torch.Tensor:
    """``x2d @ weight.T + bias`` with the three GEMMs in FP8; casts the input and the weight here (their states
    updated in place) and hands the FP8 operands to the autograd Function."""
    x, w = x2d.detach(), weight.detach()
    cast = plan.recipe.traced_cast
    x_row, x_scale, x_col, x_col_scale = cast(
        x, _state_tensors(states.get("input")), plan, "input", plan.forward_dtype, True, record
    )
    w_row, w_scale, w_col, w_col_scale = cast(
        w, _state_tensors(states.get("weight")), plan, "weight", plan.forward_dtype, True, record
    )
    grad_state = _state_tensors(states.get("grad_output"))
    return _TracedFP8Function.apply(
        x2d, weight, bias, plan, x_row, x_scale, w_row, w_scale, x_col, x_col_scale, w_col, w_col_scale, *grad_state
    )


class _TracedFP8Function(torch.autograd.Function):
    """y = x @ W.T + b from FP8 operands cast outside; x and W come in for their gradient edges only. A columnwise
    scale of None means the rowwise one (a per-tensor operand's transpose; a tensor may enter only once)."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, plan, x_row, x_scale, w_row, w_scale, x_col, x_col_scale, w_col,
                w_col_scale, *grad_state):
        # ------------------------------------------------ fprop ------------------------------------------------
        y = _gemm(plan, x_row, x_scale, w_row, w_scale, bias, plan.out_dtype, plan.fprop_fast_accum)
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
        g_row, g_scale, g_col, g_col_scale = plan.recipe.traced_cast(
            g, tuple(grad_state), plan, "grad_output", plan.backward_dtype, ctx.needs_input_grad[1], True
        )
        g_col_scale = g_scale if g_col_scale is None else g_col_scale
        grad_x = grad_w = grad_bias = None
        # ------------------------------------------------ dgrad ------------------------------------------------
        if ctx.needs_input_grad[0]:
            grad_x = _gemm(plan, g_row, g_scale, w_col, w_col_scale, None, x_dtype, plan.grad_fast_accum)
        # ------------------------------------------------ wgrad ------------------------------------------------
        if ctx.needs_input_grad[1]:
            grad_w = _gemm(
                plan, g_col, g_col_scale, x_col, x_col_scale, None, w_dtype, plan.grad_fast_accum, plan.wgrad_kind
            )
        if ctx.needs_input_grad[2]:
            grad_bias = g.sum(0, dtype=bias_dtype)  # one reduction, accumulated in the bias dtype or wider
        return (grad_x, grad_w, grad_bias) + (None,) * (9 + len(grad_state))
