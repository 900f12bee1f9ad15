"""The FP8 layer's three hot operations as ``torch.library`` custom ops: the seam a traced layer step calls.

    torch.ops.fp8_lightning.operand_cast(x, scale, pending, last_amax, count, flags, recipe, dtype, record,
                                         transpose) -> (data, data_t, scale_used)
        a per-tensor (delayed or tensorwise) cast with its scaling state's bookkeeping, the state updated in place
    torch.ops.fp8_lightning.mx_operand_cast(x, block_size, scale_rounding, dtype, columnwise)
                                         -> (row, row_scale, col, col_scale)
        MXFP8 rowwise and (optionally) columnwise copies of a 2-D tensor from one read
    torch.ops.fp8_lightning.scaled_gemm(a, a_scale, b, b_scale, bias, kind, out_dtype, emulate) -> out
        ``a @ b.T (+ bias)`` for FP8 operands with K last

Why ops: ``torch.compile`` traces a call to each as one opaque node with a fake (meta) implementation that gives
its output shapes, so the layer step becomes one graph, and the scaling state, held in tensors the op updates in
place (declared in ``mutates_args``), is functionalized by the compiler instead of being a Python side effect it
refuses. The dispatcher runs the op's implementation for the tensor's device, and each implementation is the eager
layer's own code (:meth:`fp8_lightning.scaling.OperandScaling.quantize`,
:func:`fp8_lightning.mx.quantize_mx_operands`, :func:`fp8_lightning.gemm.fp8_mm`): on CPU the C codec and the
float GEMM, on CUDA the Triton casts and cuBLAS ``_scaled_mm``. A compiled step therefore computes the same bits
as an eager one.

One difference on CUDA: a delayed cast's first use scales just in time from the tensor's own amax, and whether
the state was initialized is a flag on the GPU. Reading it would synchronize, so the op computes the amax, picks
the scale on the device and then casts: two reads of the tensor per delayed cast inside a compiled graph on
CUDA, one in eager mode. Tensorwise scaling reads twice in both modes.
"""

from __future__ import annotations

import functools
import json
from typing import Optional

import torch
from torch.library import custom_op

from fp8_lightning.formats import fp8_max
from fp8_lightning.mx import quantize_mx_operands
from fp8_lightning.quantize import Quantized, amax
from fp8_lightning.recipes import DelayedScaling, Recipe, recipe_from
from fp8_lightning.scaling import OperandScaling, delayed_scale, finite_or_zero
from fp8_lightning.gemm import fp8_mm

NAMESPACE = "fp8_lightning"


@functools.lru_cache(maxsize=None)
def recipe_of(recipe_json: str) -> Recipe:
    """The recipe an op was given as JSON (ops take strings, not Python objects); parsed once per recipe."""
    return recipe_from(json.loads(recipe_json))


def recipe_json(recipe: Recipe) -> str:
    return json.dumps(recipe.to_dict(), sort_keys=True)


def _scalar(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((), dtype=torch.float32)


# --------------------------------------------------------------------------------------------------------
# Per-tensor casts with their scaling state
# --------------------------------------------------------------------------------------------------------


@custom_op(f"{NAMESPACE}::operand_cast", mutates_args=("scale", "pending", "last_amax", "count", "flags"))
def operand_cast(
    x: torch.Tensor, scale: torch.Tensor, pending: torch.Tensor, last_amax: torch.Tensor, count: torch.Tensor,
    flags: torch.Tensor, recipe: str, dtype: torch.dtype, record: bool, transpose: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    state = OperandScaling.over_tensors(recipe_of(recipe), dtype, scale, pending, last_amax, count, flags)
    if state.delayed and x.is_cuda:
        _initialize_on_device(state, x)
    q = state.quantize(x, record, transpose)
    state.write_back()
    data_t = q.transposed if q.transposed is not None else q.data.t().contiguous() if transpose else _empty(x, dtype)
    return q.data, data_t, q.scale.clone()


def _initialize_on_device(state: OperandScaling, x: torch.Tensor) -> None:
    """The just-in-time first scale of a delayed state, chosen on the device (see the module docstring)."""
    r, clean = state.recipe, finite_or_zero(amax(x))
    assert isinstance(r, DelayedScaling)
    fresh = delayed_scale(clean.reshape(1), state.scale, fp8_max(state.dtype), r.margin, "max", r.power_of_2_scales)
    state.scale.copy_(torch.where(state.flags[0] > 0, state.scale, fresh))
    state.flags[0] = 1.0
    state.mark_initialized()


def _empty(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.new_empty((0,), dtype=dtype)


@operand_cast.register_fake
def _(x, scale, pending, last_amax, count, flags, recipe, dtype, record, transpose):
    data = torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)
    data_t = x.new_empty((x.shape[1], x.shape[0]), dtype=dtype) if transpose else _empty(x, dtype)
    return data, data_t, _scalar(x)


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
    is_transposed = not t.is_contiguous() and t.t().is_contiguous()
    if want_transposed == is_transposed:
        return t
    return t.t().contiguous().t() if want_transposed else t.contiguous()


@mx_operand_cast.register_fake
def _(x, block_size, scale_rounding, dtype, columnwise):
    from fp8_lightning.mx import E8M0_DTYPE

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
    kind: str, out_dtype: torch.dtype, emulate: bool,
) -> torch.Tensor:
    return fp8_mm(Quantized(a, a_scale, kind), Quantized(b, b_scale, kind), out_dtype, emulate, bias)


@scaled_gemm.register_fake
def _(a, a_scale, b, b_scale, bias, kind, out_dtype, emulate):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)
