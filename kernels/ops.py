"""The kernels as ``torch.library`` custom ops, so that ``torch.compile`` can trace code that calls them.

Each op has a real implementation (the Triton launcher, imported on first call, so registering the ops needs no
Triton) and a fake implementation that only describes output shapes and dtypes (what Dynamo/AOTAutograd see
while tracing). Ops are functional: they allocate their outputs and mutate nothing. The ops take and return
plain tensors (E8M0 scales as ``uint8``); :mod:`fp8_lightning.kernels` wraps them in the library's types.

    torch.ops.fp8_lightning.amax(x)                                     -> amax
    torch.ops.fp8_lightning.cast(x, scale, dtype, record_amax)          -> (data, amax)
    torch.ops.fp8_lightning.cast_transpose(x, scale, dtype, record_amax) -> (data, data_t, amax)
    torch.ops.fp8_lightning.tensorwise_cast(x, dtype, eps, power_of_2)  -> (data, scale, amax)
    torch.ops.fp8_lightning.tensorwise_operand_cast(x, prev_scale, count, dtype, eps, power_of_2, transpose)
                                                                -> (data, data_t, scale, amax, count, 1 / scale)
    torch.ops.fp8_lightning.delayed_operand_cast(x, scale, pending, count, dtype, record, transpose)
                                                                -> (data, data_t, amax, pending, count, 1 / scale)
    torch.ops.fp8_lightning.mx_quantize(x, block_size, scale_rounding, dtype, rowwise, colwise)
                                                                        -> (row, row_scale, col, col_scale)
    torch.ops.fp8_lightning.mx_gemm(a, a_scale, b, b_scale, out_dtype)  -> out
    torch.ops.fp8_lightning.fine_cast(x, dtype, tile_rows, tile_cols, power_of_2, eps, transpose)
                                                -> (data, scale, inverse, data_t, scale_t, inverse_t)

``amax`` outputs are float32 scalars; when ``record_amax`` is False the ``amax`` output is 0.

``EAGER`` holds the same implementations as plain functions: eager code calls them directly, since a custom op's
dispatch (schema checks, the autograd and dispatcher layers) costs more host time than the launch it wraps.
"""

from __future__ import annotations

import importlib
import types

import torch
from torch.library import custom_op

from fp8_lightning.kernels.availability import require_triton

NAMESPACE = "fp8_lightning"
EAGER = types.SimpleNamespace()  # name -> the op's implementation, a plain function (see the module docstring)


def _op(name: str):
    """``@custom_op`` for ``NAMESPACE::name`` (functional: mutates nothing), the function also kept in ``EAGER``."""

    def register(fn):
        setattr(EAGER, name, fn)
        return custom_op(f"{NAMESPACE}::{name}", fn, mutates_args=())

    return register


def _implementation(module: str, x: torch.Tensor):
    """The Triton launchers, after checking that they can run on ``x``'s device (clear error otherwise).

    The check runs here, inside the op, because the op is opaque to ``torch.compile``: the traced graph holds
    the op, and the check happens when the graph runs.
    """
    require_triton(f"{module} kernels", x.device)
    return importlib.import_module(f"fp8_lightning.kernels.{module}")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _scalar(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((), dtype=torch.float32)


# --------------------------------------------------------------------------------------------------------
# Per-tensor casts
# --------------------------------------------------------------------------------------------------------


@_op("amax")
def amax(x: torch.Tensor) -> torch.Tensor:
    impl = _implementation("per_tensor", x)

    return impl.amax(x)


@amax.register_fake
def _(x):
    return _scalar(x)


@_op("cast")
def cast(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, record_amax: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    impl = _implementation("per_tensor", x)

    return impl.cast(x, scale, dtype, record_amax)


@cast.register_fake
def _(x, scale, dtype, record_amax):
    return torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format), _scalar(x)


@_op("cast_transpose")
def cast_transpose(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, record_amax: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    impl = _implementation("per_tensor", x)

    return impl.cast_transpose(x, scale, dtype, record_amax)


@cast_transpose.register_fake
def _(x, scale, dtype, record_amax):
    m, k = x.shape
    return x.new_empty((m, k), dtype=dtype), x.new_empty((k, m), dtype=dtype), _scalar(x)


@_op("tensorwise_cast")
def tensorwise_cast(
    x: torch.Tensor, dtype: torch.dtype, eps: float, power_of_2: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    impl = _implementation("per_tensor", x)

    data, _, scale, amax, _, _ = impl.tensorwise_cast(x, dtype, eps, power_of_2)
    return data, scale, amax


@tensorwise_cast.register_fake
def _(x, dtype, eps, power_of_2):
    return torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format), _scalar(x), _scalar(x)


@_op("delayed_operand_cast")
def delayed_operand_cast(
    x: torch.Tensor, scale: torch.Tensor, pending: torch.Tensor, count: torch.Tensor, dtype: torch.dtype, record: bool,
    transpose: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    impl = _implementation("per_tensor", x)

    return impl.delayed_cast(x, scale, dtype, pending, count, record, transpose)


def _operand_cast_outputs(x: torch.Tensor, count: torch.Tensor, dtype: torch.dtype, transpose: bool) -> tuple:
    """Fake outputs of a scaling state's cast, both recipes: data, data_t (the transpose of a 2-D x, or empty),
    two float32 scalars, the count, and the inverse scale."""
    data = torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)
    data_t = x.new_empty((x.shape[1], x.shape[0]) if transpose else (0,), dtype=dtype)
    return data, data_t, _scalar(x), _scalar(x), count.new_empty(()), _scalar(x)


@delayed_operand_cast.register_fake
def _(x, scale, pending, count, dtype, record, transpose):
    return _operand_cast_outputs(x, count, dtype, transpose)


@_op("tensorwise_operand_cast")
def tensorwise_operand_cast(
    x: torch.Tensor, prev_scale: torch.Tensor, count: torch.Tensor, dtype: torch.dtype, eps: float, power_of_2: bool,
    transpose: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    impl = _implementation("per_tensor", x)

    return impl.tensorwise_cast(x, dtype, eps, power_of_2, prev_scale.reshape(1).float(), count, transpose)


@tensorwise_operand_cast.register_fake
def _(x, prev_scale, count, dtype, eps, power_of_2, transpose):
    return _operand_cast_outputs(x, count, dtype, transpose)


# --------------------------------------------------------------------------------------------------------
# MXFP8
# --------------------------------------------------------------------------------------------------------


@_op("mx_quantize")
def mx_quantize(
    x: torch.Tensor, block_size: int, scale_rounding: str, dtype: torch.dtype, rowwise: bool, colwise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    impl = _implementation("mxfp8", x)

    return impl.mx_quantize(x, block_size, scale_rounding, dtype, rowwise, colwise)


@mx_quantize.register_fake
def _(x, block_size, scale_rounding, dtype, rowwise, colwise):
    r, c = x.shape
    r_pad, c_pad = _round_up(r, block_size), _round_up(c, block_size)
    u8 = torch.uint8
    row = x.new_empty((r, c_pad), dtype=dtype) if rowwise else x.new_empty(0, dtype=dtype)
    row_scale = x.new_empty((r, c_pad // block_size), dtype=u8) if rowwise else x.new_empty(0, dtype=u8)
    col = x.new_empty((c, r_pad), dtype=dtype) if colwise else x.new_empty(0, dtype=dtype)
    col_scale = x.new_empty((c, r_pad // block_size), dtype=u8) if colwise else x.new_empty(0, dtype=u8)
    return row, row_scale, col, col_scale


@_op("mx_gemm")
def mx_gemm(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    impl = _implementation("block_gemm", a)

    return impl.mx_gemm(a, a_scale, b, b_scale, out_dtype)


@mx_gemm.register_fake
def _(a, a_scale, b, b_scale, out_dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


# --------------------------------------------------------------------------------------------------------
# Rowwise and blockwise
# --------------------------------------------------------------------------------------------------------


@_op("fine_cast")
def fine_cast(
    x: torch.Tensor, dtype: torch.dtype, tile_rows: int, tile_cols: int, power_of_2: bool, eps: float,
    transpose: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    impl = _implementation("fine_grained_cast", x)

    return impl.fine_cast(x, dtype, (tile_rows, tile_cols), power_of_2, eps, transpose)


@fine_cast.register_fake
def _(x, dtype, tile_rows, tile_cols, power_of_2, eps, transpose):
    from fp8_lightning.kernels.fine_grained_layout import output_layouts

    layouts = output_layouts(tuple(x.shape), (tile_rows, tile_cols), transpose)
    f32 = torch.float32
    data, scale = x.new_empty_strided(*layouts["data"], dtype=dtype), x.new_empty_strided(*layouts["scale"], dtype=f32)
    inverse = x.new_empty_strided(*layouts["scale"], dtype=f32)
    if not transpose:
        return data, scale, inverse, x.new_empty(0, dtype=dtype), x.new_empty(0, dtype=f32), x.new_empty(0, dtype=f32)
    scale_t, inverse_t = (x.new_empty_strided(*layouts["scale_t"], dtype=f32) for _ in range(2))
    return data, scale, inverse, x.new_empty_strided(*layouts["data_t"], dtype=dtype), scale_t, inverse_t
