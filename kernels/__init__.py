"""Triton kernels for the FP8 hot paths (``fp8_lightning.kernels``), each with a pure-torch twin in the core.

===========================  ==============================================  ======================================
kernel                       what it does                                    pure-torch twin
===========================  ==============================================  ======================================
``amax``                     max |x|, one read                               ``quantize.amax``
``tensorwise_cast``          current scaling: amax pass + cast pass          ``quantize.quantize_tensorwise``
``tensorwise_operand_cast``  the same, with a scaling state's bookkeeping    ``scaling.OperandScaling.quantize``
                             (zero/non-finite amax keeps the last scale)
``cast``                     delayed scaling: cast with a given scale and    ``quantize.quantize_with_scale``
                             record the amax, one read, one write            + ``quantize.amax``
``delayed_operand_cast``     the same, booking the amax in a scaling state   ``scaling.OperandScaling.quantize``
``cast_transpose``           the same, also writing the transposed copy      ``...`` + ``.t().contiguous()``
``mx_quantize``              MXFP8 rowwise and/or columnwise from one read   ``mx.quantize_mxfp8``
``mx_gemm``                  block-scaled FP8 GEMM for MX operands (sm8x/9x)  ``gemm`` emulation
``fine_cast``                rowwise / blockwise copy, scales in cuBLAS's    ``rowwise.quantize_rowwise``,
                             layout, one launch                              ``blockwise.quantize_blockwise``
===========================  ==============================================  ======================================

How the library uses them: the core (``quantize.py``, ``mx.py``, ``scaling.py``, ``gemm.py``) asks
:func:`~fp8_lightning.kernels.availability.kernels_usable` for CUDA tensors only; it uses this package when Triton
is importable, the GPU has FP8 conversions (sm89+) and ``FP8_LIGHTNING_DISABLE_TRITON`` is not set, and falls
back to its pure-torch code otherwise. CPU tensors never reach the Triton kernels from the core.

Calling a kernel here directly is an explicit request: it raises a clear error when it cannot run (no Triton,
no suitable GPU) instead of falling back silently. Under ``TRITON_INTERPRET=1`` (set before the kernel modules
are first used, and while they run) the kernels run on CPU tensors, which is how they are tested without a GPU.

Modules: ``availability`` (can they run here; no Triton import), ``per_tensor`` (amax and per-tensor casts),
``mxfp8`` (MX quantization), ``fine_grained_cast`` (rowwise and blockwise casts; their output layouts in
``fine_grained_layout``), ``block_gemm`` (MX GEMM and its autotune configs; ``block_gemm_gluon``: its opt-in Hopper
form in Gluon, whose wgmma overlaps the scale math), ``ops`` (``torch.library``), and
``cpu_codec`` (not Triton: the CPU casts and MX (de)quantization fused in C, built with the machine's C compiler
on first use, which the core uses for CPU tensors; same bits as the core's pure-torch code).

Importing this package never imports Triton; the kernels are compiled on first use. Every kernel is also a
``torch.library`` custom op (``torch.ops.fp8_lightning.*``, see :mod:`~fp8_lightning.kernels.ops`) with a fake
implementation, so ``torch.compile`` traces through calls to them.
"""

from __future__ import annotations

import torch

from fp8_lightning.formats import fp8_dtype
from fp8_lightning.kernels.fine_grained_layout import TILE, TILES
from fp8_lightning.kernels.availability import (
    DISABLE_ENV,
    device_status,
    disabled_by_env,
    kernels_usable,
    triton_status,
)
from fp8_lightning.mx import E8M0_DTYPE
from fp8_lightning.quantize import BLOCK, MX, Quantized, ROW

SUPPORTED_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MX_BLOCK_SIZES = (16, 32, 64, 128)
MX_GEMM_BLOCK_SIZES = (32, 64, 128)
GEMM_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

__all__ = [
    "DISABLE_ENV",
    "amax",
    "cast",
    "cast_transpose",
    "delayed_operand_cast",
    "device_status",
    "disabled_by_env",
    "fine_cast",
    "kernels_usable",
    "mx_gemm",
    "mx_gemm_supported",
    "mx_quantize",
    "supports_input",
    "tensorwise_cast",
    "tensorwise_operand_cast",
    "triton_status",
]


def _ops(x: torch.Tensor):
    """The kernels for a call on ``x``: their implementations called directly in eager code on plain tensors (a
    custom op's dispatch costs more host time than the launch it wraps), the custom ops ``torch.ops.fp8_lightning``
    where they must be seen: while a compiler traces, under a dispatch mode (fake tensors, operation counters) and
    for tensor subclasses."""
    from fp8_lightning.kernels import ops  # registers torch.ops.fp8_lightning.* on first use

    if type(x) is torch.Tensor and not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0:
        return ops.EAGER
    return torch.ops.fp8_lightning


def supports_input(x: torch.Tensor) -> bool:
    """Whether the cast kernels take ``x``'s dtype (float32, bfloat16, float16)."""
    return x.dtype in SUPPORTED_INPUT_DTYPES


def _check_input(x: torch.Tensor, what: str) -> None:
    """Dtype checks here; whether Triton can run on the device is checked inside the ops (see ``ops``)."""
    if not torch.is_tensor(x) or not supports_input(x):
        got = x.dtype if torch.is_tensor(x) else type(x).__name__
        raise TypeError(
            f"fp8_lightning.kernels.{what} takes float32, bfloat16 or float16 tensors; got {got}. Cast the input, "
            "or use the pure-torch twin in fp8_lightning.quantize (it also takes float64)."
        )


def _check_scale(scale: torch.Tensor, x: torch.Tensor, what: str) -> None:
    if scale.numel() != 1 or scale.device != x.device:
        raise ValueError(
            f"fp8_lightning.kernels.{what} needs a one-element scale on {x.device}; got shape {tuple(scale.shape)} "
            f"on {scale.device}."
        )


def _check_transpose(x: torch.Tensor, transpose: bool, what: str) -> None:
    """A transposed copy is written for 2-D tensors only."""
    if transpose and x.dim() != 2:
        raise ValueError(
            f"fp8_lightning.kernels.{what} writes a transposed copy of 2-D tensors only; got shape "
            f"{tuple(x.shape)}. Reshape to (-1, K) first."
        )


# --------------------------------------------------------------------------------------------------------
# Per-tensor casts
# --------------------------------------------------------------------------------------------------------


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a float32 scalar (NaN when x holds NaN), in one read."""
    _check_input(x, "amax")
    return _ops(x).amax(x)


def cast(
    x: torch.Tensor, scale: torch.Tensor, fp8_format="E4M3", record_amax: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(saturate(x * scale), max |x|)`` with one read and one write (delayed scaling)."""
    _check_input(x, "cast")
    _check_scale(scale, x, "cast")
    return _ops(x).cast(x, scale, fp8_dtype(fp8_format), record_amax)


def cast_transpose(
    x: torch.Tensor, scale: torch.Tensor, fp8_format="E4M3", record_amax: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For 2-D ``x`` (M, K): ``(data (M, K), data.T contiguous (K, M), max |x|)`` with one read."""
    _check_input(x, "cast_transpose")
    _check_scale(scale, x, "cast_transpose")
    _check_transpose(x, True, "cast_transpose")
    return _ops(x).cast_transpose(x, scale, fp8_dtype(fp8_format), record_amax)


def tensorwise_cast(
    x: torch.Tensor, fp8_format="E4M3", eps: float = 1e-12, power_of_2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Current scaling in two passes: ``(data, scale)`` exactly as ``quantize.quantize_tensorwise``."""
    _check_input(x, "tensorwise_cast")
    data, scale, _ = _ops(x).tensorwise_cast(x, fp8_dtype(fp8_format), float(eps), power_of_2)
    return data, scale


def tensorwise_operand_cast(
    x: torch.Tensor, prev_scale: torch.Tensor, count: torch.Tensor, fp8_format="E4M3", eps: float = 1e-12,
    power_of_2: bool = False, transpose: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tensorwise scaling state's cast in the same two passes, bookkeeping included: ``(data, data_t, scale,
    amax, count, 1 / scale)``, where a zero or non-finite amax keeps ``prev_scale`` and the returned ``count`` is
    ``count`` + 1 when the amax is not finite (``scaling.OperandScaling`` for ``TensorwiseScaling``, bit for
    bit); the scale's inverse is what a scaled GEMM takes, and ``data_t`` the contiguous transpose of a 2-D x's
    data, written by the same pass, when ``transpose`` (else empty)."""
    _check_input(x, "tensorwise_operand_cast")
    _check_scale(prev_scale, x, "tensorwise_operand_cast")
    _check_transpose(x, transpose, "tensorwise_operand_cast")
    dtype = fp8_dtype(fp8_format)
    return _ops(x).tensorwise_operand_cast(x, prev_scale, count, dtype, float(eps), power_of_2, transpose)


def delayed_operand_cast(
    x: torch.Tensor, scale: torch.Tensor, pending: torch.Tensor, count: torch.Tensor, fp8_format="E4M3",
    record: bool = True, transpose: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A delayed-scaling state's cast with its bookkeeping, in one pass: ``(data, data_t, amax, pending, count,
    1 / scale)``: the pending amax folded with this cast's amax (when ``record``; a non-finite amax never enters
    it) and ``count`` + 1 when the amax is not finite (``scaling.OperandScaling`` for ``DelayedScaling``, bit for
    bit); ``data_t`` as in :func:`tensorwise_operand_cast`."""
    _check_input(x, "delayed_operand_cast")
    _check_scale(scale, x, "delayed_operand_cast")
    _check_transpose(x, transpose, "delayed_operand_cast")
    return _ops(x).delayed_operand_cast(x, scale, pending, count, fp8_dtype(fp8_format), record, transpose)


# --------------------------------------------------------------------------------------------------------
# MXFP8
# --------------------------------------------------------------------------------------------------------


def mx_quantize(
    x: torch.Tensor,
    block_size: int = 32,
    scale_rounding: str = "rceil",
    fp8_format="E4M3",
    rowwise: bool = True,
    columnwise: bool = False,
) -> tuple[Quantized | None, Quantized | None]:
    """MXFP8 copies of a 2-D ``x`` (R, C) from one read: ``(rowwise, columnwise)`` operands.

    ``rowwise``: blocks along C, data (R, C_pad). ``columnwise``: blocks along R, data (C, R_pad) = the operand
    of ``x.T``. ``X_pad`` is X rounded up to a whole number of blocks (zero padding, as ``gemm.pad_dim``).
    Each equals ``quantize_mx_operand`` of the (padded) tensor. Outputs not requested are None.
    """
    _check_input(x, "mx_quantize")
    if x.dim() != 2:
        raise ValueError(
            f"fp8_lightning.kernels.mx_quantize needs a 2-D tensor; got shape {tuple(x.shape)}. Reshape to "
            "(-1, K) first."
        )
    if block_size not in MX_BLOCK_SIZES:
        raise ValueError(f"block_size={block_size} is not supported; allowed: {MX_BLOCK_SIZES}.")
    if scale_rounding not in ("rceil", "floor"):
        raise ValueError(f"scale_rounding={scale_rounding!r} is invalid; allowed: rceil or floor.")
    row, row_s, col, col_s = _ops(x).mx_quantize(
        x, block_size, scale_rounding, fp8_dtype(fp8_format), rowwise, columnwise
    )
    rows = Quantized(row, row_s.view(E8M0_DTYPE), MX) if rowwise else None
    cols = Quantized(col, col_s.view(E8M0_DTYPE), MX) if columnwise else None
    return rows, cols


def mx_gemm_supported(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> tuple[bool, str]:
    """Whether :func:`mx_gemm` takes these operands, and why not."""
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


def mx_gemm(a: Quantized, b: Quantized, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``a @ b.T`` for MX operands with K last (a: (M, K), b: (N, K)) on the block-scaled Triton kernel."""
    ok, reason = mx_gemm_supported(a, b, out_dtype)
    if not ok:
        raise ValueError(f"fp8_lightning.kernels.mx_gemm: {reason}. Use fp8_lightning.fp8_mm (it emulates).")
    dense = [t.contiguous() for t in (a.data, a.scale.view(torch.uint8), b.data, b.scale.view(torch.uint8))]
    return _ops(dense[0]).mx_gemm(*dense, out_dtype)


# --------------------------------------------------------------------------------------------------------
# Rowwise and blockwise
# --------------------------------------------------------------------------------------------------------


def fine_cast(
    x: torch.Tensor, fp8_format="E4M3", tile: tuple[int, int] = (1, 0), power_of_2: bool = True, eps: float = 1e-12,
    transpose: bool = False,
) -> tuple[Quantized, Quantized | None]:
    """One rowwise or blockwise copy of a 2-D ``x`` (M, K) in one launch, and with ``transpose`` (128x128 blocks
    only) the copy of ``x.T`` from the same launch: operands of kind ``"row"`` or ``"block"`` whose scales and
    ``inverse`` (``1 / scale``) lie in cuBLAS's layouts (:mod:`~fp8_lightning.kernels.fine_grained_layout`).

    ``tile``: ``(1, 0)`` one scale per row, ``(0, 1)`` one per column (the operand of ``x.T``: codes (K, M)),
    ``(1, 128)``, ``(128, 1)`` (the operand of ``x.T``) or ``(128, 128)``. Values equal
    ``rowwise.quantize_rowwise`` (``eps``; rowwise tiles) and ``blockwise.quantize_blockwise`` bit for bit.
    """
    _check_input(x, "fine_cast")
    if x.dim() != 2 or x.numel() == 0:
        raise ValueError(f"fp8_lightning.kernels.fine_cast needs a non-empty 2-D tensor; got shape {tuple(x.shape)}.")
    tile = tuple(tile)
    if tile not in TILES:
        raise ValueError(f"tile={tile} is not supported; allowed: {', '.join(map(str, TILES))}.")
    if transpose and tile != (TILE, TILE):
        raise ValueError(
            f"fine_cast writes a transposed copy for 128x128 blocks only (got tile={tile}): the scales of other tiles "
            "follow the reduction dimension, so cast the other direction's tile instead."
        )
    data, scale, inverse, data_t, scale_t, inverse_t = _ops(x).fine_cast(
        x, fp8_dtype(fp8_format), *tile, power_of_2, float(eps), transpose
    )
    kind = BLOCK if TILE in tile else ROW
    row = Quantized(data, scale, kind, inverse=inverse)
    return row, (Quantized(data_t, scale_t, kind, inverse=inverse_t) if transpose else None)
