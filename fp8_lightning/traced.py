"""The FP8 layer step as code ``torch.compile`` traces into one graph, for every recipe.

:class:`~fp8_lightning.linear.FP8Linear` runs this path while it is being compiled (``torch.compile(model)``, with
``fullgraph=True`` too), and its tuned eager path otherwise. Both compute the same bits: the casts and GEMMs here
are the eager layer's math: plain tensor operations for per-tensor casts, and custom ops whose implementations are
the eager layer's own code for MX casts and GEMMs.

The design in full: ``docs/design/notes.md``, section ``fp8_lightning.traced``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fp8_lightning.gemm import scaled_mm
from fp8_lightning.layer_step import FP8LinearFunction
from fp8_lightning.ops.layer import scaled_gemm
from fp8_lightning.quantize import OperandKind
from fp8_lightning.scaling import OperandScaling


class TracedPlan(NamedTuple):
    """What the traced step needs besides tensors: hashable, a constant to the compiler."""

    recipe: Any  # the frozen recipe: its traced_cast makes the operands
    # The kinds as plain names (``OperandKind`` is a str subclass, which torch 2.11's compiler cannot put in a graph):
    kind: str  # the kind of the operands its casts make
    wgrad_kind: str  # the weight-gradient GEMM's operand kind (``kind``, or high precision)
    forward_dtype: torch.dtype
    backward_dtype: torch.dtype
    out_dtype: torch.dtype
    emulate: bool
    transpose: bool  # the cast kernels write the transposed copies the backward GEMMs read (CUDA)
    scaled_mm: bool  # the GEMMs are torch._scaled_mm itself in the graph (per-tensor on CUDA)
    fprop_fast_accum: bool
    grad_fast_accum: bool
    inverses: bool = False  # each cast also hands out its copies' 1 / scale, in the layout the GEMM reads

    # -- the step of fp8_lightning.layer_step.FP8LinearFunction: operands are (data, scale, kind, inverse) tuples

    def forward_operands(self, tensors: tuple):
        """The Function's tensor inputs: each cast's (data, scale, columnwise data, columnwise scale) and, where the
        plan has ``inverses``, (inverse, columnwise inverse), input then weight, then the output gradient's state
        tensors. A columnwise scale of None is the rowwise one (a per-tensor operand's transpose; a tensor may enter
        the Function only once). Operands are (data, scale, kind, inverse or None) tuples."""
        width = 6 if self.inverses else 4
        x_ops, w_ops, grad_state = tensors[:width], tensors[width:2 * width], tensors[2 * width:]
        (x_row, x_t), (w_row, w_t) = self._operands(x_ops, self.wgrad_kind), self._operands(w_ops, self.kind)
        return x_row, x_t, w_row, w_t, grad_state

    def _operands(self, cast: tuple, column_kind: str) -> tuple[tuple, tuple]:
        row, scale, col, col_scale, row_inverse, col_inverse = (*cast, None, None)[:6]
        return (row, scale, self.kind, row_inverse), (col, scale if col_scale is None else col_scale, column_kind,
                                                      col_inverse)  # fmt: skip

    def gemm(self, a: tuple, b: tuple, out_dtype: torch.dtype, bias, fast_accum: bool) -> torch.Tensor:
        """``a @ b.T (+ bias)``: ``torch._scaled_mm`` in the graph where it is the GEMM, else the custom op (the
        eager layer's GEMM: CPU float GEMM, MX, rowwise and blockwise), which takes the casts' inverse scales."""
        (a_data, a_scale, kind, a_inverse), (b_data, b_scale, _, b_inverse) = a, b
        if self.scaled_mm:
            return scaled_mm(a_data, a_scale.reciprocal(), b_data, b_scale.reciprocal(), out_dtype, bias, fast_accum)
        return scaled_gemm(a_data, a_scale, a_inverse, b_data, b_scale, b_inverse, bias, kind, out_dtype,
                           self.emulate, fast_accum)  # fmt: skip

    def pack(self, x_t: tuple, w_t: tuple):
        inverses = (x_t[3], w_t[3]) if self.inverses else ()
        return (x_t[0], x_t[1], w_t[0], w_t[1], *inverses), None

    def unpack(self, meta, saved: tuple):
        """(x.T's operand, W.T's operand, the output gradient's state tensors) from what :meth:`pack` saved."""
        x_data, x_scale, w_data, w_scale, *rest = saved
        x_inverse, w_inverse = rest[:2] if self.inverses else (None, None)
        grad_state = rest[2:] if self.inverses else rest
        return (x_data, x_scale, self.wgrad_kind, x_inverse), (w_data, w_scale, self.kind, w_inverse), grad_state

    def grad_operands(self, g: torch.Tensor, grad_state: list, columnwise: bool):
        """The output gradient cast by the recipe's traced cast (delayed scaling books its amax here)."""
        cast = self.recipe.traced_cast(g, tuple(grad_state), self, "grad_output", self.backward_dtype, columnwise, True)
        return self._operands(cast, self.wgrad_kind)


def plan_for(
    recipe: Any, device: torch.device, out_dtype: torch.dtype, emulate: bool, scaled_mm: bool = False,
    wgrad_kind: OperandKind | None = None, inverses: bool = False,
) -> TracedPlan:
    """The plan of one call of ``recipe`` (its ``traced_plan`` fills in what is its own; ``inverses``: its
    ``traced_cast`` returns six tensors, the last two the copies' inverse scales)."""
    fmt, kind = recipe.fp8_format, recipe.operand_kind
    return TracedPlan(
        recipe, kind.name, (wgrad_kind or kind).name, fmt.forward_dtype, fmt.backward_dtype,
        out_dtype, emulate, device.type == "cuda", scaled_mm, recipe.fprop_fast_accum, recipe.grad_fast_accum,
        inverses,
    )


def make_plan(recipe: Any, device: torch.device, out_dtype: torch.dtype, emulate: bool) -> TracedPlan:
    """The plan of one call, from the recipe (:meth:`~fp8_lightning.recipes.base.Recipe.traced_plan`)."""
    return recipe.traced_plan(device, out_dtype, emulate)


def _state_tensors(state: OperandScaling | None) -> tuple[torch.Tensor, ...]:
    return () if state is None else state.traced_tensors()


def traced_linear(
    x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: TracedPlan,
    states: dict[str, OperandScaling], record: bool,
) -> torch.Tensor:
    """``x2d @ weight.T + bias`` with the three GEMMs in FP8; casts the input and the weight here (their states
    updated in place) and hands the casts' tensors to the layer's autograd Function, with the plan as its step."""
    x, w = x2d.detach(), weight.detach().contiguous()  # row-major codes however the weight is stored (Conv1D)
    cast = plan.recipe.traced_cast
    x_ops = cast(x, _state_tensors(states.get("input")), plan, "input", plan.forward_dtype, True, record)
    w_ops = cast(w, _state_tensors(states.get("weight")), plan, "weight", plan.forward_dtype, True, record)
    grad_state = _state_tensors(states.get("grad_output"))
    return FP8LinearFunction.apply(x2d, weight, bias, plan, *x_ops, *w_ops, *grad_state)
