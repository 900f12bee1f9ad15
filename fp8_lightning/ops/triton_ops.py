"""The Triton kernels as declared hot operations: each op's argument checks, implementation, fake and result.

===================================  ==============================================  ================================
op (``torch.ops.fp8_lightning.*``)   what it does                                    pure-torch twin
===================================  ==============================================  ================================
``amax``                             max |x|, one read                               ``quantize.amax``
``tensorwise_cast``                  current scaling: amax pass + cast pass          ``quantize.quantize_tensorwise``
``tensorwise_operand_cast``          the same, with a scaling state's bookkeeping    ``scaling.OperandScaling``
``cast``                             delayed scaling: cast with a given scale and    ``quantize.quantize_with_scale``
                                     record the amax, one read, one write            + ``quantize.amax``
``delayed_operand_cast``             the same, booking the amax in a scaling state   ``scaling.OperandScaling``
``cast_transpose``                   the same, also writing the transposed copy      ``...`` + ``.t().contiguous()``
``mx_quantize``                      MXFP8 rowwise and/or columnwise from one read   ``mx.quantize_mxfp8``
``mx_gemm``                          block-scaled FP8 GEMM for MX operands           ``gemm`` emulation
``fine_cast``                        rowwise / blockwise copy, scales in cuBLAS's    ``rowwise.quantize_rowwise``,
                                     layout, one launch                              ``blockwise.quantize_blockwise``
``grouped_column_cast``              every group's columnwise copy, in one launch    ``grouped_columnwise``
``nvfp4_cast``                       NVFP4 codes + block scales, RHT, SR; one launch ``nvfp4.quantize_nvfp4``
===================================  ==============================================  ================================

The ``triton_*`` functions raise a clear error when the kernels cannot run (no Triton, no suitable GPU) instead of
falling back; :mod:`fp8_lightning.ops.dispatch` decides when the core uses them. The ops take and return plain tensors
(E8M0 scales as ``uint8``), wrapped in the core's types by the functions. Under ``TRITON_INTERPRET=1`` they run on CPU
tensors (how they are tested without a GPU). Registering them imports no Triton: ``kernels/`` loads on first call.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch

from fp8_lightning.fine_grained import tile_kind
from fp8_lightning.formats import fp8_dtype
from fp8_lightning.kernels.availability import (
    GEMM_OUT_DTYPES,
    MX_BLOCK_SIZES,
    MX_GEMM_BLOCK_SIZES,
    SUPPORTED_INPUT_DTYPES,
    require_triton,
)
from fp8_lightning.kernels.fine_grained_layout import BLOCKWISE_EDGE, TILES, output_layouts
from fp8_lightning.mx import E8M0_DTYPE
from fp8_lightning.ops.registry import hot_op
from fp8_lightning.quantize import MX, OperandCache, Quantized


def supports_input(x: torch.Tensor) -> bool:
    """Whether the cast kernels take ``x``'s dtype (float32, bfloat16, float16)."""
    return x.dtype in SUPPORTED_INPUT_DTYPES


def _launchers(module: str, x: torch.Tensor):
    """The Triton launchers, after checking that they can run on ``x``'s device (clear error otherwise). The check
    runs inside the op, which is opaque to ``torch.compile``: it happens when the traced graph runs."""
    require_triton(f"{module} kernels", x.device)
    return importlib.import_module(f"fp8_lightning.kernels.{module}")


def _check_input(x: torch.Tensor, what: str) -> None:
    if not torch.is_tensor(x) or not supports_input(x):
        got = x.dtype if torch.is_tensor(x) else type(x).__name__
        raise TypeError(
            f"fp8_lightning.ops.triton_ops.{what} takes float32, bfloat16 or float16 tensors; got {got}. Cast the "
            "input, or use the pure-torch twin in fp8_lightning.quantize (it also takes float64)."
        )


def _check_scale(scale: torch.Tensor, x: torch.Tensor, what: str) -> None:
    if scale.numel() != 1 or scale.device != x.device:
        raise ValueError(
            f"fp8_lightning.ops.triton_ops.{what} needs a one-element scale on {x.device}; got shape "
            f"{tuple(scale.shape)} on {scale.device}."
        )


def _check_transpose(x: torch.Tensor, transpose: bool, what: str) -> None:
    if transpose and x.dim() != 2:
        raise ValueError(
            f"fp8_lightning.ops.triton_ops.{what} writes a transposed copy of 2-D tensors only; got shape "
            f"{tuple(x.shape)}. Reshape to (-1, K) first."
        )


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _scalar(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((), dtype=torch.float32)


def _contiguous_like(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)


def _operand_cast_outputs(x: torch.Tensor, count: torch.Tensor, dtype: torch.dtype, transpose: bool) -> tuple:
    """Fake outputs of a scaling state's cast, both recipes: data, data_t (the transpose of a 2-D x, or empty),
    two float32 scalars, the count, and the inverse scale."""
    data_t = x.new_empty((x.shape[1], x.shape[0]) if transpose else (0,), dtype=dtype)
    return _contiguous_like(x, dtype), data_t, _scalar(x), _scalar(x), count.new_empty(()), _scalar(x)


# --------------------------------------------------------------------------------------------------------
# Per-tensor casts
# --------------------------------------------------------------------------------------------------------


@hot_op("amax", fake=lambda x: _scalar(x))
def _amax(x: torch.Tensor) -> torch.Tensor:
    return _launchers("per_tensor", x).launch_amax(x)


def triton_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a float32 scalar (NaN when x holds NaN), in one read."""
    _check_input(x, "triton_amax")
    return _amax.for_tensor(x)(x)


def _cast_fake(x, scale, dtype, record_amax):
    return _contiguous_like(x, dtype), _scalar(x)


@hot_op("cast", fake=_cast_fake)
def _cast(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, record_amax: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launchers("per_tensor", x).cast(x, scale, dtype, record_amax)


def triton_cast(
    x: torch.Tensor, scale: torch.Tensor, fp8_format="E4M3", record_amax: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(saturate(x * scale), max |x|)`` with one read and one write (delayed scaling); the amax is 0 when
    ``record_amax`` is False."""
    _check_input(x, "triton_cast")
    _check_scale(scale, x, "triton_cast")
    return _cast.for_tensor(x)(x, scale, fp8_dtype(fp8_format), record_amax)


def _cast_transpose_fake(x, scale, dtype, record_amax):
    m, k = x.shape
    return x.new_empty((m, k), dtype=dtype), x.new_empty((k, m), dtype=dtype), _scalar(x)


@hot_op("cast_transpose", fake=_cast_transpose_fake)
def _cast_transpose(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, record_amax: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _launchers("per_tensor", x).cast_transpose(x, scale, dtype, record_amax)


def triton_cast_transpose(
    x: torch.Tensor, scale: torch.Tensor, fp8_format="E4M3", record_amax: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For 2-D ``x`` (M, K): ``(data (M, K), data.T contiguous (K, M), max |x|)`` with one read."""
    _check_input(x, "triton_cast_transpose")
    _check_scale(scale, x, "triton_cast_transpose")
    _check_transpose(x, True, "triton_cast_transpose")
    return _cast_transpose.for_tensor(x)(x, scale, fp8_dtype(fp8_format), record_amax)


def _tensorwise_cast_fake(x, dtype, eps, power_of_2):
    return _contiguous_like(x, dtype), _scalar(x), _scalar(x)


@hot_op("tensorwise_cast", fake=_tensorwise_cast_fake)
def _tensorwise_cast(
    x: torch.Tensor, dtype: torch.dtype, eps: float, power_of_2: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    data, _, scale, amax, _, _ = _launchers("per_tensor", x).tensorwise_cast(x, dtype, eps, power_of_2)
    return data, scale, amax


def triton_tensorwise_cast(
    x: torch.Tensor, fp8_format="E4M3", eps: float = 1e-12, power_of_2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Current scaling in two passes: ``(data, scale)`` exactly as ``quantize.quantize_tensorwise``."""
    _check_input(x, "triton_tensorwise_cast")
    data, scale, _ = _tensorwise_cast.for_tensor(x)(x, fp8_dtype(fp8_format), float(eps), power_of_2)
    return data, scale


@hot_op(
    "tensorwise_operand_cast",
    fake=lambda x, prev_scale, count, dtype, eps, power_of_2, transpose: _operand_cast_outputs(
        x, count, dtype, transpose
    ),
)
def _tensorwise_operand_cast(
    x: torch.Tensor, prev_scale: torch.Tensor, count: torch.Tensor, dtype: torch.dtype, eps: float, power_of_2: bool,
    transpose: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    launchers = _launchers("per_tensor", x)
    return launchers.tensorwise_cast(x, dtype, eps, power_of_2, prev_scale.reshape(1).float(), count, transpose)


def triton_tensorwise_operand_cast(
    x: torch.Tensor, prev_scale: torch.Tensor, count: torch.Tensor, fp8_format="E4M3", eps: float = 1e-12,
    power_of_2: bool = False, transpose: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tensorwise scaling state's cast in the same two passes, bookkeeping included: ``(data, data_t, scale,
    amax, count, 1 / scale)``, where a zero or non-finite amax keeps ``prev_scale`` and the returned ``count`` is
    ``count`` + 1 when the amax is not finite (``scaling.OperandScaling`` for ``TensorwiseScaling``, bit for
    bit); the scale's inverse is what a scaled GEMM takes, and ``data_t`` the contiguous transpose of a 2-D x's
    data, written by the same pass, when ``transpose`` (else empty)."""
    _check_input(x, "triton_tensorwise_operand_cast")
    _check_scale(prev_scale, x, "triton_tensorwise_operand_cast")
    _check_transpose(x, transpose, "triton_tensorwise_operand_cast")
    op = _tensorwise_operand_cast.for_tensor(x)
    return op(x, prev_scale, count, fp8_dtype(fp8_format), float(eps), power_of_2, transpose)


@hot_op(
    "delayed_operand_cast",
    fake=lambda x, scale, pending, count, dtype, record, transpose: _operand_cast_outputs(x, count, dtype, transpose),
)
def _delayed_operand_cast(
    x: torch.Tensor, scale: torch.Tensor, pending: torch.Tensor, count: torch.Tensor, dtype: torch.dtype, record: bool,
    transpose: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _launchers("per_tensor", x).delayed_cast(x, scale, dtype, pending, count, record, transpose)


def triton_delayed_operand_cast(
    x: torch.Tensor, scale: torch.Tensor, pending: torch.Tensor, count: torch.Tensor, fp8_format="E4M3",
    record: bool = True, transpose: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A delayed-scaling state's cast with its bookkeeping, in one pass: ``(data, data_t, amax, pending, count,
    1 / scale)``: the pending amax folded with this cast's amax (when ``record``; a non-finite amax never enters
    it) and ``count`` + 1 when the amax is not finite (``scaling.OperandScaling`` for ``DelayedScaling``, bit for
    bit); ``data_t`` as in :func:`triton_tensorwise_operand_cast`."""
    _check_input(x, "triton_delayed_operand_cast")
    _check_scale(scale, x, "triton_delayed_operand_cast")
    _check_transpose(x, transpose, "triton_delayed_operand_cast")
    op = _delayed_operand_cast.for_tensor(x)
    return op(x, scale, pending, count, fp8_dtype(fp8_format), record, transpose)


# --------------------------------------------------------------------------------------------------------
# MXFP8
# --------------------------------------------------------------------------------------------------------


def _mx_quantize_fake(x, block_size, scale_rounding, dtype, rowwise, colwise):
    r, c = x.shape
    r_pad, c_pad = _round_up(r, block_size), _round_up(c, block_size)
    u8 = torch.uint8
    row = x.new_empty((r, c_pad), dtype=dtype) if rowwise else x.new_empty(0, dtype=dtype)
    row_scale = x.new_empty((r, c_pad // block_size), dtype=u8) if rowwise else x.new_empty(0, dtype=u8)
    col = x.new_empty((c, r_pad), dtype=dtype) if colwise else x.new_empty(0, dtype=dtype)
    col_scale = x.new_empty((c, r_pad // block_size), dtype=u8) if colwise else x.new_empty(0, dtype=u8)
    return row, row_scale, col, col_scale


@hot_op("mx_quantize", fake=_mx_quantize_fake)
def _mx_quantize(
    x: torch.Tensor, block_size: int, scale_rounding: str, dtype: torch.dtype, rowwise: bool, colwise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _launchers("mxfp8", x).launch_mx_quantize(x, block_size, scale_rounding, dtype, rowwise, colwise)


def triton_mx_quantize(
    x: torch.Tensor, block_size: int = 32, scale_rounding: str = "rceil", fp8_format="E4M3", rowwise: bool = True,
    columnwise: bool = False,
) -> tuple[Quantized | None, Quantized | None]:
    """MXFP8 copies of a 2-D ``x`` (R, C) from one read: ``(rowwise, columnwise)`` operands.

    ``rowwise``: blocks along C, data (R, C_pad). ``columnwise``: blocks along R, data (C, R_pad) = the operand
    of ``x.T``. ``X_pad`` is X rounded up to a whole number of blocks (zero padding, as ``gemm.pad_dim``).
    Each equals ``quantize_mx_operand`` of the (padded) tensor. Outputs not requested are None.
    """
    _check_input(x, "triton_mx_quantize")
    if x.dim() != 2:
        raise ValueError(
            f"fp8_lightning.ops.triton_ops.triton_mx_quantize needs a 2-D tensor; got shape {tuple(x.shape)}. "
            "Reshape to (-1, K) first."
        )
    if block_size not in MX_BLOCK_SIZES:
        raise ValueError(f"block_size={block_size} is not supported; allowed: {MX_BLOCK_SIZES}.")
    if scale_rounding not in ("rceil", "floor"):
        raise ValueError(f"scale_rounding={scale_rounding!r} is invalid; allowed: rceil or floor.")
    row, row_s, col, col_s = _mx_quantize.for_tensor(x)(
        x, block_size, scale_rounding, fp8_dtype(fp8_format), rowwise, columnwise
    )
    rows = Quantized(row, row_s.view(E8M0_DTYPE), MX) if rowwise else None
    cols = Quantized(col, col_s.view(E8M0_DTYPE), MX) if columnwise else None
    return rows, cols


def _mx_gemm_fake(a, a_scale, b, b_scale, out_dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@hot_op("mx_gemm", fake=_mx_gemm_fake)
def _mx_gemm(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    return _launchers("block_gemm", a).mx_gemm(a, a_scale, b, b_scale, out_dtype)


def mx_gemm_supported(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> tuple[bool, str]:
    """Whether :func:`triton_mx_gemm` takes these operands, and why not."""
    if a.scale.dtype != E8M0_DTYPE or b.scale.dtype != E8M0_DTYPE:
        return False, f"operands must carry E8M0 block scales (MX); got {a.scale.dtype} and {b.scale.dtype}"
    if a.data.dim() != 2 or b.data.dim() != 2 or a.data.shape[1] != b.data.shape[1]:
        return False, f"needs (M, K) and (N, K) operands; got {tuple(a.data.shape)} and {tuple(b.data.shape)}"
    k, blocks = a.data.shape[1], a.scale.shape[-1]
    if blocks == 0 or k % blocks or b.scale.shape != (b.data.shape[0], blocks) or a.scale.shape[0] != a.data.shape[0]:
        return False, f"scales {tuple(a.scale.shape)}, {tuple(b.scale.shape)} do not match data {tuple(a.data.shape)}"
    if k // blocks not in MX_GEMM_BLOCK_SIZES:
        return False, f"block size {k // blocks} is not supported; allowed: {MX_GEMM_BLOCK_SIZES}"
    if out_dtype not in GEMM_OUT_DTYPES:
        return False, f"out_dtype {out_dtype} is not supported; allowed: {GEMM_OUT_DTYPES}"
    return True, "supported"


def triton_mx_gemm(a: Quantized, b: Quantized, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``a @ b.T`` for MX operands with K last (a: (M, K), b: (N, K)) on the block-scaled Triton kernel."""
    ok, reason = mx_gemm_supported(a, b, out_dtype)
    if not ok:
        raise ValueError(
            f"fp8_lightning.ops.triton_ops.triton_mx_gemm: {reason}. Use fp8_lightning.fp8_mm (it emulates)."
        )
    dense = [t.contiguous() for t in (a.data, a.scale.view(torch.uint8), b.data, b.scale.view(torch.uint8))]
    return _mx_gemm.for_tensor(dense[0])(*dense, out_dtype)


# --------------------------------------------------------------------------------------------------------
# Rowwise and blockwise
# --------------------------------------------------------------------------------------------------------


def _fine_cast_fake(x, dtype, tile_rows, tile_cols, power_of_2, eps, transpose):
    layouts = output_layouts(tuple(x.shape), (tile_rows, tile_cols), transpose)
    f32 = torch.float32
    data, scale = x.new_empty_strided(*layouts["data"], dtype=dtype), x.new_empty_strided(*layouts["scale"], dtype=f32)
    inverse = x.new_empty_strided(*layouts["scale"], dtype=f32)
    if not transpose:
        return data, scale, inverse, x.new_empty(0, dtype=dtype), x.new_empty(0, dtype=f32), x.new_empty(0, dtype=f32)
    scale_t, inverse_t = (x.new_empty_strided(*layouts["scale_t"], dtype=f32) for _ in range(2))
    return data, scale, inverse, x.new_empty_strided(*layouts["data_t"], dtype=dtype), scale_t, inverse_t


@hot_op("fine_cast", fake=_fine_cast_fake)
def _fine_cast(
    x: torch.Tensor, dtype: torch.dtype, tile_rows: int, tile_cols: int, power_of_2: bool, eps: float,
    transpose: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _launchers("fine_grained_cast", x).fine_cast(x, dtype, (tile_rows, tile_cols), power_of_2, eps, transpose)


def triton_fine_cast(
    x: torch.Tensor, fp8_format="E4M3", tile: tuple[int, int] = (1, 0), power_of_2: bool = True, eps: float = 1e-12,
    transpose: bool = False,
) -> tuple[Quantized, Quantized | None]:
    """One rowwise or blockwise copy of a 2-D ``x`` (M, K) in one launch, and with ``transpose`` (128x128 blocks
    only) the copy of ``x.T`` from the same launch: operands of kind ``ROW`` or ``BLOCK`` whose scales and
    ``inverse`` (``1 / scale``) lie in cuBLAS's layouts (:mod:`~fp8_lightning.kernels.fine_grained_layout`).

    ``tile``: ``(1, 0)`` one scale per row, ``(0, 1)`` one per column (the operand of ``x.T``: codes (K, M)),
    ``(1, 128)``, ``(128, 1)`` (the operand of ``x.T``) or ``(128, 128)``. Values equal
    ``rowwise.quantize_rowwise`` (``eps``; rowwise tiles) and ``blockwise.quantize_blockwise`` bit for bit.
    """
    _check_input(x, "triton_fine_cast")
    if x.dim() != 2 or x.numel() == 0:
        raise ValueError(
            f"fp8_lightning.ops.triton_ops.triton_fine_cast needs a non-empty 2-D tensor; got shape {tuple(x.shape)}."
        )
    tile = tuple(tile)
    if tile not in TILES:
        raise ValueError(f"tile={tile} is not supported; allowed: {', '.join(map(str, TILES))}.")
    if transpose and tile != (BLOCKWISE_EDGE, BLOCKWISE_EDGE):
        raise ValueError(
            f"fine_cast writes a transposed copy for 128x128 blocks only (got tile={tile}): the scales of other tiles "
            "follow the reduction dimension, so cast the other direction's tile instead."
        )
    data, scale, inverse, data_t, scale_t, inverse_t = _fine_cast.for_tensor(x)(
        x, fp8_dtype(fp8_format), *tile, power_of_2, float(eps), transpose
    )
    kind = tile_kind(tile)
    row = Quantized(data, scale, kind, OperandCache(inverse=inverse))
    return row, (Quantized(data_t, scale_t, kind, OperandCache(inverse=inverse_t)) if transpose else None)


def _grouped_column_cast_fake(x, starts, rows, out_starts, out_numel, out_line_stride, dtype, power_of_2, eps, align):
    scale = x.new_empty(starts.numel(), x.shape[1], dtype=torch.float32)
    return x.new_empty(out_numel, dtype=dtype), scale, torch.empty_like(scale)


@hot_op("grouped_column_cast", fake=_grouped_column_cast_fake)
def _grouped_column_cast(
    x: torch.Tensor, starts: torch.Tensor, rows: torch.Tensor, out_starts: torch.Tensor, out_numel: int,
    out_line_stride: int, dtype: torch.dtype, power_of_2: bool, eps: float, align: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _launchers("grouped_cast", x).grouped_column_cast(
        x, starts, rows, out_starts, out_numel, out_line_stride, dtype, power_of_2, eps, align
    )


def triton_grouped_column_cast(
    x: torch.Tensor, starts: torch.Tensor, rows: torch.Tensor, out_starts: torch.Tensor, out_numel: int,
    out_line_stride: int, fp8_format="E4M3", power_of_2: bool = True, eps: float = 1e-12, align: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every group's columnwise rowwise-scaled copy of a 2-D ``x`` whose rows are sorted into groups, in one launch
    (:mod:`fp8_lightning.kernels.grouped_cast`): ``(data, scale, inverse)``, ``data`` the flat codes with group
    ``g``'s column ``k`` at ``out_starts[g] + k * out_line_stride``, each group zero-padded to a multiple of
    ``align`` positions; ``scale`` (groups, K) float32 by :func:`fp8_lightning.rowwise.rowwise_scale`.

    ``starts``, ``rows``: int32 (groups,), each group's first row and row count; ``out_starts``: int64 (groups,).
    The groups' padded extents must tile the ``out_numel`` codes. Values equal
    :func:`fp8_lightning.rowwise_grouped.grouped_columnwise` bit for bit."""
    _check_input(x, "triton_grouped_column_cast")
    if x.dim() != 2:
        raise ValueError(
            f"fp8_lightning.ops.triton_ops.triton_grouped_column_cast needs a 2-D tensor; got shape {tuple(x.shape)}."
        )
    bounds = {"starts": (starts, torch.int32), "rows": (rows, torch.int32), "out_starts": (out_starts, torch.int64)}
    for name, (t, dtype) in bounds.items():
        if t.dtype != dtype or t.dim() != 1 or t.numel() != starts.numel() or t.device != x.device:
            raise ValueError(
                f"triton_grouped_column_cast: {name} must be a 1-D {dtype} tensor with one entry per group on "
                f"{x.device}; got {t.dtype} of shape {tuple(t.shape)} on {t.device}."
            )
    if align < 1:
        raise ValueError(f"triton_grouped_column_cast: align must be a positive number of positions; got {align}.")
    return _grouped_column_cast.for_tensor(x)(
        x, starts, rows, out_starts, int(out_numel), int(out_line_stride), fp8_dtype(fp8_format), power_of_2,
        float(eps), int(align),
    )


# --------------------------------------------------------------------------------------------------------
# NVFP4
# --------------------------------------------------------------------------------------------------------


def _nvfp4_cast_fake(x, global_scale, tile_rows, signs, key):
    pr, pk = _round_up(x.shape[0], tile_rows), _round_up(x.shape[1], 16)
    return (x.new_empty((pr, pk // 2), dtype=torch.uint8),
            x.new_empty((pr // tile_rows, pk // 16), dtype=torch.float8_e4m3fn), _scalar(x))


@hot_op("nvfp4_cast", fake=_nvfp4_cast_fake)
def _nvfp4_cast(
    x: torch.Tensor, global_scale: Optional[torch.Tensor], tile_rows: int, signs: Optional[torch.Tensor],
    key: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    launchers = _launchers("nvfp4_cast", x)
    if global_scale is None:
        global_scale = launchers.device_global_scale(launchers.launch_nvfp4_amax(x, signs))
    else:
        global_scale = global_scale.float().reshape(()).clone()
    codes, scales = launchers.launch_nvfp4_cast(x, global_scale, tile_rows, signs, key)
    return codes, scales, global_scale


def triton_nvfp4_cast(
    x: torch.Tensor, global_scale: torch.Tensor | None = None, tile_rows: int = 1,
    rht_signs: torch.Tensor | None = None, sr_key: "int | torch.Tensor | None" = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``nvfp4.quantize_nvfp4(x, global_scale, tile_rows, rht_signs=..., sr_key=...)`` in one launch (two without a
    global scale: the first measures the amax): ``(codes, block_scales, global_scale)``, bit for bit
    (:mod:`fp8_lightning.kernels.nvfp4_cast`). ``x``: 2-D, K last, any strides; codes uint8 (padded rows, K_pad / 2),
    block scales float8_e4m3fn (padded rows / tile_rows, K_pad / 16), global scale a float32 scalar."""
    _check_input(x, "triton_nvfp4_cast")
    if x.dim() != 2:
        raise ValueError(f"fp8_lightning.ops.triton_ops.triton_nvfp4_cast needs a 2-D tensor (K last); got shape "
                         f"{tuple(x.shape)}. Reshape to (-1, K) first.")
    if tile_rows not in (1, 16):
        raise ValueError(f"tile_rows={tile_rows} is invalid; allowed: 1 (1x16 blocks) or 16 (16x16 tiles).")
    if global_scale is not None:
        _check_scale(global_scale, x, "triton_nvfp4_cast")
    if rht_signs is not None and (rht_signs.numel() != 16 or rht_signs.device != x.device):
        raise ValueError(f"triton_nvfp4_cast needs 16 RHT signs on {x.device}; got shape {tuple(rht_signs.shape)} on "
                         f"{rht_signs.device}. Use fp8_lightning.nvfp4.rht_signs(seed).to(x.device).")
    signs = None if rht_signs is None else rht_signs.float().reshape(16).contiguous()
    key = None if sr_key is None else torch.as_tensor(sr_key, dtype=torch.int64).to(x.device).reshape(1)
    return _nvfp4_cast.for_tensor(x)(x, global_scale, int(tile_rows), signs, key)


# the ops whose implementation is a Triton launch
TRITON_OPS = (_amax, _cast, _cast_transpose, _tensorwise_cast, _tensorwise_operand_cast, _delayed_operand_cast,
              _mx_quantize, _mx_gemm, _fine_cast, _grouped_column_cast, _nvfp4_cast)
