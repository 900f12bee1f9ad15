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

from typing import NamedTuple

import torch

from fp8_lightning.fine_grained import (
    FineCastPlan,
    fine_cast_plan,
    is_fine_grained,
    operand_kind,
    traced_fine_cast,
    wgrad_kind,
)
from fp8_lightning.formats import fp8_max
from fp8_lightning.gemm import per_tensor_scaled_mm, scaled_mm
from fp8_lightning.layer_ops import mx_operand_cast, scaled_gemm
from fp8_lightning.quantize import amax, tensorwise_scale, to_fp8_saturated, wide
from fp8_lightning.recipes import DelayedScaling, Recipe
from fp8_lightning.scaling import OperandScaling, delayed_scale, finite_or_zero


class TracedPlan(NamedTuple):
    """What the traced step needs besides tensors, in plain values: hashable, a constant to the compiler."""

    kind: str  # "tensor" (per-tensor recipes) or "mx"
    delayed: bool
    margin: int  # delayed only
    power_of_2: bool  # per-tensor: scales rounded down to powers of two
    eps: float  # tensorwise only
    block_size: int  # MX only
    scale_rounding: str  # MX only
    forward_dtype: torch.dtype
    backward_dtype: torch.dtype
    out_dtype: torch.dtype
    emulate: bool
    transpose: bool  # the cast kernels write the transposed copies the backward GEMMs read (CUDA)
    scaled_mm: bool  # per-tensor GEMMs are torch._scaled_mm itself in the graph (CUDA, or FP8_LIGHTNING_GEMM=scaled_mm)
    fprop_fast_accum: bool
    grad_fast_accum: bool
    fine: FineCastPlan | None = None  # rowwise / blockwise recipes (fp8_lightning.fine_grained)
    wgrad_kind: str = ""  # the weight-gradient GEMM's operand kind: ``kind``, or "hp" for a high-precision wgrad


def make_plan(recipe: Recipe, device: torch.device, out_dtype: torch.dtype, emulate: bool) -> TracedPlan:
    """The plan of one call, from the recipe's fields."""
    fmt = recipe.fp8_format
    kind = "tensor" if recipe.per_tensor else "mx"
    fine = None
    if is_fine_grained(recipe):
        kind, fine = operand_kind(recipe), fine_cast_plan(recipe)
    delayed = isinstance(recipe, DelayedScaling)
    scaled_mm = kind == "tensor" and per_tensor_scaled_mm(device, emulate)
    return TracedPlan(
        kind, delayed, getattr(recipe, "margin", 0), getattr(recipe, "power_of_2_scales", False),
        getattr(recipe, "eps", 0.0), getattr(recipe, "block_size", 0), getattr(recipe, "scale_rounding", ""),
        fmt.forward_dtype, fmt.backward_dtype, out_dtype, emulate, device.type == "cuda", scaled_mm,
        recipe.fprop_fast_accum, recipe.grad_fast_accum, fine, wgrad_kind(recipe) if fine else kind,
    )


def _gemm(plan: TracedPlan, a, a_scale, b, b_scale, bias, out_dtype: torch.dtype, fast_accum: bool, kind: str = ""):
    """``a @ b.T (+ bias)`` of FP8 operands of ``kind`` (default: the plan's): ``torch._scaled_mm`` in the graph for
    per-tensor operands where it is the GEMM, else the custom op (the eager layer's GEMM: CPU float GEMM, MX,
    rowwise and blockwise GEMMs)."""
    kind = kind or plan.kind
    if plan.scaled_mm and kind == "tensor":
        return scaled_mm(a, a_scale.reciprocal(), b, b_scale.reciprocal(), out_dtype, bias, fast_accum)
    return scaled_gemm(a, a_scale, b, b_scale, bias, kind, out_dtype, plan.emulate, fast_accum)


def _state_tensors(state: OperandScaling) -> tuple[torch.Tensor, ...]:
    return state.scale, state.pending_amax, state.last_amax, state.nonfinite_count, state.flags


def traced_cast(x: torch.Tensor, state_tensors, plan: TracedPlan, dtype: torch.dtype, record: bool):
    """(operand (K last), operand of x.T, their scale) of a 2-D ``x`` under a per-tensor recipe: the reference
    math in plain tensor operations, which the compiler fuses (amax, scale and cast in one or two kernels), with
    the scaling state updated in place as :meth:`fp8_lightning.scaling.OperandScaling.quantize` updates it."""
    scale, pending, last_amax, count, flags = state_tensors
    x_amax = amax(x)
    clean = finite_or_zero(x_amax)
    max_value = fp8_max(dtype)
    if plan.delayed:  # the stored scale; the first use scales just in time
        fresh = delayed_scale(clean.reshape(1), scale, max_value, plan.margin, "max", plan.power_of_2)
        used = torch.where(flags[0] > 0, scale, fresh)
    else:  # the current scale; an all-zero or non-finite tensor keeps the previous one
        used = torch.where(clean > 0, tensorwise_scale(clean, dtype, plan.eps, plan.power_of_2), scale)
    data = to_fp8_saturated(wide(x) * used, dtype)
    if not record:  # evaluation leaves the state as training left it
        return data, (data.t().contiguous() if plan.transpose else data.t()), used
    with torch.no_grad():
        scale.copy_(used)
        last_amax.copy_(x_amax)
        count.add_((clean != x_amax).to(count.dtype))
        flags[0] = 1.0
        if plan.delayed:
            pending.copy_(torch.maximum(pending, clean))
            flags[1] = 1.0
    return data, (data.t().contiguous() if plan.transpose else data.t()), used


def _mx_cast(x: torch.Tensor, plan: TracedPlan, role: str, dtype: torch.dtype, columnwise: bool):
    """(rowwise data, scales, columnwise data, scales) of a 2-D ``x`` under MXFP8, rowwise or blockwise scaling."""
    if plan.fine is not None:
        return traced_fine_cast(x, plan.fine, role, dtype, columnwise)
    return mx_operand_cast(x, plan.block_size, plan.scale_rounding, dtype, columnwise)


def traced_linear(
    x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: TracedPlan,
    states: dict[str, OperandScaling], record: bool,
) -> torch.Tensor:
    """``x2d @ weight.T + bias`` with the three GEMMs in FP8; casts the input and the weight here (their states
    updated in place) and hands the FP8 operands to the autograd Function."""
    x, w = x2d.detach(), weight.detach()
    if plan.kind == "tensor":
        x_row, x_col, x_scale = traced_cast(x, _state_tensors(states["input"]), plan, plan.forward_dtype, record)
        w_row, w_col, w_scale = traced_cast(w, _state_tensors(states["weight"]), plan, plan.forward_dtype, record)
        x_col_scale = w_col_scale = None  # the same scales (a tensor may enter the Function only once)
        grad_state = _state_tensors(states["grad_output"])
    else:
        x_row, x_scale, x_col, x_col_scale = _mx_cast(x, plan, "input", plan.forward_dtype, True)
        w_row, w_scale, w_col, w_col_scale = _mx_cast(w, plan, "weight", plan.forward_dtype, True)
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
        if plan.kind == "tensor":
            g_row, g_col, g_scale = traced_cast(g, grad_state, plan, plan.backward_dtype, True)
            g_col_scale = g_scale
        else:
            g_row, g_scale, g_col, g_col_scale = _mx_cast(
                g, plan, "grad_output", plan.backward_dtype, ctx.needs_input_grad[1]
            )
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
