"""MXFP8 block scaling: quantize and dequantize, the reference implementations and the ground truth for
``kernels/``.

OCP Microscaling, blocks of ``block_size`` consecutive elements along the reduction dimension (the last one)::

    scale_block = 2**shared_exp             (stored as E8M0: the biased exponent byte)
    data        = saturate(x / scale_block)
    x          ~= data * scale_block

A GEMM operand needs its blocks along its own reduction dimension, so an operand used by two GEMMs has a rowwise
and a columnwise copy, both quantized from the high-precision tensor (:func:`quantize_mx_operands`).

Plain PyTorch with no device or backend branches: :mod:`fp8_lightning.ops.dispatch` runs the same operations on the
Triton ``mx_quantize`` kernel (CUDA) or the C codec (CPU), with the same bits, and is what the layer calls.
"""

from __future__ import annotations

import torch

from fp8_lightning.formats import Format, fp8_dtype, fp8_emax, fp8_max
from typing import Callable

from fp8_lightning.quantize import (
    MX,
    Quantized,
    _check_floating,
    fp8_to_float32,
    is_transposed_2d,
    pad_dim,
    to_fp8_saturated,
)

E8M0_DTYPE = torch.float8_e8m0fnu
E8M0_BIAS = 127
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127  # exponent byte 255 is NaN


def mx_shared_exponent(block_amax: torch.Tensor, dtype: torch.dtype, scale_rounding: str) -> torch.Tensor:
    """The E8M0 exponent of each block's scale (int32), clamped to [-127, 127].

    ``floor``: ``floor(log2(amax)) - emax`` (OCP MX v1.0); values up to ``2**(emax+1)`` then saturate.
    ``rceil``: the smallest ``e`` with ``amax / 2**e <= fp8_max`` (no value of the block saturates).
    A block whose amax is 0 gets the smallest scale, 2**-127; one whose amax is inf gets 2**0 (its infinities
    saturate to +-fp8_max, the rule of every scale whose amax is not finite); a NaN amax is marked by the caller.

    Both come exactly from ``frexp`` (amax = f * 2**E, f in [0.5, 1)): floor is ``E - 1 - emax``, and amax / 2**floor
    = 2f * 2**emax exceeds fp8_max exactly when f > fp8_max / 2**(emax+1) (0.875 for E4M3 and E5M2), where rceil
    takes the next binade.
    """
    if scale_rounding not in ("floor", "rceil"):
        raise ValueError(f"scale_rounding={scale_rounding!r} is invalid; allowed: rceil or floor.")
    # 0 and NaN become the smallest subnormal (fmax ignores NaN), whose exponent is clamped up to -127 below like
    # any tiny amax's.
    fraction, exponent = torch.frexp(torch.fmax(block_amax.float(), _smallest_subnormal(block_amax.device)))
    exp = exponent - (1 + fp8_emax(dtype))
    if scale_rounding == "rceil":
        exp += fraction > fp8_max(dtype) / 2.0 ** (fp8_emax(dtype) + 1)
    exp = torch.where(torch.isinf(block_amax), 0, exp)
    return exp.clamp_(E8M0_MIN_EXP, E8M0_MAX_EXP)


_SMALLEST_SUBNORMALS: dict[torch.device, torch.Tensor] = {}


def _smallest_subnormal(device: torch.device) -> torch.Tensor:
    if device not in _SMALLEST_SUBNORMALS:
        _SMALLEST_SUBNORMALS[device] = torch.tensor(2.0**-149, dtype=torch.float32, device=device)
    return _SMALLEST_SUBNORMALS[device]


def exponent_to_e8m0(exp: torch.Tensor) -> torch.Tensor:
    """Encode int exponents in [-127, 127] as E8M0 bytes (biased by 127)."""
    return (exp + E8M0_BIAS).to(torch.uint8).view(E8M0_DTYPE)


def mark_nan_blocks(scale: torch.Tensor, nan_mask: torch.Tensor) -> torch.Tensor:
    """E8M0 ``scale`` with the blocks of ``nan_mask`` set to the NaN byte (255)."""
    return scale.view(torch.uint8).masked_fill(nan_mask, 255).view(E8M0_DTYPE)


_E8M0_TABLES: dict[tuple[torch.device, int], torch.Tensor] = {}


def _e8m0_lookup(scale: torch.Tensor, sign: int) -> torch.Tensor:
    """``2**(sign * (byte - 127))`` for each E8M0 byte of ``scale``, exactly, from a 256-entry float32 table (byte
    255 is NaN). One gather instead of the handful of small operations the formula takes."""
    key = (scale.device, sign)
    if key not in _E8M0_TABLES:
        exponents = torch.arange(256, dtype=torch.float64) - E8M0_BIAS
        table = torch.pow(2.0, sign * exponents).float()  # exact: 2**-127 and 2**127 are float32 values
        table[255] = float("nan")
        _E8M0_TABLES[key] = table.to(scale.device)
    flat = scale.view(torch.uint8).reshape(-1).to(torch.int64)
    return _E8M0_TABLES[key].index_select(0, flat).view(scale.shape)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Decode E8M0 scales to float32 exactly (2**-127 included, byte 255 is NaN)."""
    return _e8m0_lookup(scale, 1)


def quantize_mxfp8(
    x: torch.Tensor,
    *,
    block_size: int = 32,
    scale_rounding: str = "rceil",
    fp8_format: "Format | str | torch.dtype" = Format.E4M3,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MX block quantization along the last dimension.

    Returns ``(data, scale)``: ``data`` in the float8 dtype with ``x``'s shape, ``scale`` in
    ``torch.float8_e8m0fnu`` with shape ``(..., K // block_size)``, such that ``x ~= data * scale`` per block.
    """
    k = check_mx_input(x, block_size, "quantize_mxfp8", scale_rounding)
    dtype = fp8_dtype(fp8_format)
    blocks = x.float().reshape(*x.shape[:-1], k // block_size, block_size)
    data, scale = _quantize_blocks(blocks, -1, scale_rounding, dtype)
    return data.reshape(x.shape), scale


def check_mx_input(x: torch.Tensor, block_size: int, what: str, scale_rounding: str = "rceil") -> int:
    """The size K of ``x``'s last dimension, after checking ``x`` is floating point with K a whole number of
    blocks, and ``scale_rounding`` is exactly ``"rceil"`` or ``"floor"`` (checked here, before any backend: the C
    codec and the Triton kernel would read anything but "rceil" as floor)."""
    _check_floating(x, what)
    if not isinstance(scale_rounding, str) or scale_rounding not in ("rceil", "floor"):
        raise ValueError(
            f"{what}: scale_rounding={scale_rounding!r} is invalid; allowed: rceil or floor, in lower case (rceil, "
            "the default, is cuBLAS's and TransformerEngine's rule; floor is OCP MX v1.0's). Pass one of them."
        )
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(
            f"{what}: block_size={block_size!r} is invalid; it must be a positive integer (MX uses 32): the number "
            "of consecutive elements that share one scale."
        )
    k = x.shape[-1] if x.dim() else 0
    if x.dim() == 0 or k % block_size != 0:
        raise ValueError(
            f"{what} needs the last dimension divisible by block_size={block_size}; got shape "
            f"{tuple(x.shape)}. Pad the last dimension or pick a block size that divides it."
        )
    return k


def _quantize_blocks(
    blocks: torch.Tensor, axis: int, scale_rounding: str, dtype: torch.dtype, magnitude: torch.Tensor | None = None
):
    """(data shaped like ``blocks``, E8M0 scales) for float32 ``blocks`` whose dimension ``axis`` holds one block;
    ``magnitude`` may carry ``blocks.abs()`` when the caller already has it."""
    block_amax = (blocks.abs() if magnitude is None else magnitude).amax(dim=axis)
    scale = exponent_to_e8m0(mx_shared_exponent(block_amax, dtype, scale_rounding))
    data = to_fp8_saturated(blocks * _e8m0_lookup(scale, -1).unsqueeze(axis), dtype)  # x / 2**e, exactly
    return data, mark_nan_blocks(scale, torch.isnan(block_amax))


def quantize_mx_operands(
    x: torch.Tensor,
    block_size: int,
    scale_rounding: str,
    dtype: torch.dtype,
    columnwise: bool = True,
) -> tuple[Quantized, Quantized | None]:
    """The MX operands of a 2-D ``x`` (M, K) from one read: rowwise (blocks along K; K must be a whole number of
    blocks) and, when ``columnwise``, the operand of ``x.T`` (see :func:`quantize_mx_columns`), else None."""
    x32 = x.detach().float()
    magnitude = x32.abs()  # shared by both block layouts
    (m, k), blocks = x32.shape, (x32.shape[0], x32.shape[1] // block_size, block_size)
    data, scale = _quantize_blocks(x32.reshape(blocks), 2, scale_rounding, dtype, magnitude.reshape(blocks))
    row = Quantized(data.reshape(m, k), scale, MX)
    return row, (_mx_columns(x32, magnitude, block_size, scale_rounding, dtype) if columnwise else None)


def quantize_mx_columns(x: torch.Tensor, block_size: int, scale_rounding: str, dtype: torch.dtype) -> Quantized:
    """The MX operand of ``x.T`` for a 2-D ``x`` (M, K): blocks run along M, which is zero-padded to whole blocks.

    Its data is (K, M_pad) and its scales (K, M_pad // block_size), transposed views of tensors quantized in
    ``x``'s own layout (no transposed copy of ``x`` is made; the Triton kernel writes them contiguous); the GEMMs
    read them as they are or copy them where a layout demands it.
    """
    return _mx_columns(x.detach().float(), None, block_size, scale_rounding, dtype)


def _mx_columns(x32, magnitude, block_size: int, scale_rounding: str, dtype: torch.dtype) -> Quantized:
    padded = pad_dim(x32, 0, block_size)
    (m, k), blocks = padded.shape, (padded.shape[0] // block_size, block_size, padded.shape[1])
    magnitude = None if magnitude is None else pad_dim(magnitude, 0, block_size).reshape(blocks)
    data, scale = _quantize_blocks(padded.reshape(blocks), 1, scale_rounding, dtype, magnitude)
    return Quantized(data.reshape(m, k).t(), scale.t(), MX)


def check_mx_scales(data: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    """(K, blocks per row) of MX ``data`` and ``scale``, after checking that they belong together."""
    k, n_blocks = data.shape[-1], scale.shape[-1]
    blocks_fit = k % n_blocks == 0 if n_blocks else k == 0  # an empty last dimension has no blocks
    if not blocks_fit or scale.shape[:-1] != data.shape[:-1]:
        raise ValueError(
            f"dequantize_mxfp8: scale shape {tuple(scale.shape)} does not match data shape {tuple(data.shape)}: "
            "data (..., K) needs scales (..., K // block_size), one per block of the last dimension. Pass the "
            "scale that quantize_mxfp8 returned with this data."
        )
    return k, n_blocks


def dequantize_mxfp8(
    data: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32,
    decode: Callable[[torch.Tensor], torch.Tensor] = fp8_to_float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize_mxfp8`: ``data * scale`` with each scale repeated over its block (along the last
    dimension). The transposed views made by :func:`quantize_mx_columns` are decoded in their base layout.
    ``decode`` turns float8 codes into float32 (any exact decoder)."""
    k, n_blocks = check_mx_scales(data, scale)
    if n_blocks == 0:  # K = 0: nothing to scale
        return decode(data).to(out_dtype)
    block_size = k // n_blocks
    if is_transposed_2d(data):  # blocks down base rows
        base = data.t()
        blocks = decode(base).view(n_blocks, block_size, base.shape[1])
        values = blocks * e8m0_to_float(scale.t()).unsqueeze(1)
        return values.view(base.shape).to(out_dtype).t()
    blocks = decode(data).reshape(*data.shape[:-1], n_blocks, block_size)
    return (blocks * e8m0_to_float(scale).unsqueeze(-1)).reshape(data.shape).to(out_dtype)


def quantize_mx_operand(x: torch.Tensor, block_size: int, scale_rounding: str, dtype: torch.dtype) -> Quantized:
    data, scale = quantize_mxfp8(x, block_size=block_size, scale_rounding=scale_rounding, fp8_format=dtype)
    return Quantized(data, scale, MX)
