"""Blockwise scaling (DeepSeek-V3): 1x128 tiles for activations and gradients, 128x128 blocks for weights.

The reference math, and the ground truth for accelerated casts. A tile (or block) is a (rows, cols) window of a 2-D
tensor; ragged edges form smaller tiles (the tensor is zero-padded, which changes no amax)::

    amax_t  = max |x[t]|                             one per tile
    scale_t = fp8_max / amax_t                       divided in float64, rounded once to float32 (capped at its max)
    scale_t = 2**floor(log2(scale_t))                with power-of-two scales (the default, as TransformerEngine's)
    scale_t = 1                                      where amax_t is 0 (an all-zero tile), inf or NaN
    data    = saturate(x * scale_t)                  x ~= data * (1 / scale_t), 1 / scale_t rounded to float32

The dequantization factor ``1 / scale_t`` in float32 is what a scaled GEMM receives (cuBLAS's ``scale_inv``).

Which copies the three GEMMs use (every tile runs along the GEMM's reduction dimension)::

    fprop   y  = x @ W.T     x: 1x128 tiles along K            W: 128x128 blocks
    dgrad   dx = g @ W       g: 1x128 tiles along N            W.T: the same blocks, transposed (no new cast)
    wgrad   dW = g.T @ x     g.T: 1x128 tiles along M          x.T: 1x128 tiles along M

The input and the output gradient are each cast twice from high precision: along their last dimension (1x128)
and down their columns (128x1 tiles in their own layout, handed out transposed). A 128x128 block has the same amax
in W and W.T, so the weight is cast once and its data and scales are transposed for dgrad.

GEMMs (:func:`blockwise_mm`): on CUDA sm90 with CUDA 12.9+, ``torch._scaled_mm`` with 1x128 / 128x128 float32
scales in cuBLAS's layouts (:func:`blockwise_scaled_mm_args`): every 128-long slice of K is multiplied, scaled by
``scale_inv_a * scale_inv_b`` and accumulated in float32. Elsewhere the operands are dequantized to float32 and
multiplied (the emulation), which computes the same sum up to float32 rounding order.
"""

from __future__ import annotations

import torch

from fp8_lightning.formats import BLOCKWISE_CAPABILITY_MAJOR, fp8_max
from fp8_lightning.quantize import (
    BLOCK,
    Quantized,
    fp8_to_float32,
    max_over_amax,
    pad_2d,
    pad_dim,
    round_scale_to_power_of_2,
    row_major,
    scaled_mm_layout,
    to_fp8_saturated,
    wide,
)

TILE = 128
ROW_TILE, COLUMN_TILE, WEIGHT_BLOCK = (1, TILE), (TILE, 1), (TILE, TILE)
EMULATE_HINT = "pass emulate=True (or set FP8_LIGHTNING_EMULATE=1) to emulate the blockwise GEMMs in float32"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def block_scale(block_amax: torch.Tensor, dtype: torch.dtype, power_of_2: bool) -> torch.Tensor:
    """The float32 scale of each tile from its amax (see the module docstring); 1 where the amax is 0, inf or NaN."""
    scale = max_over_amax(fp8_max(dtype), block_amax.float())
    if power_of_2:
        scale = round_scale_to_power_of_2(scale)
    usable = torch.isfinite(block_amax) & (block_amax > 0)
    return torch.where(usable, scale, torch.ones_like(scale))


def quantize_blockwise(
    x: torch.Tensor, tile: tuple[int, int], dtype: torch.dtype, power_of_2: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale)`` of a 2-D ``x`` (M, K) in ``tile`` windows: data (M, K) in ``dtype``, scale
    (ceil(M / rows), ceil(K / cols)) float32 with ``data = saturate(x * scale)`` in each tile."""
    if x.dim() != 2 or x.numel() == 0:
        raise ValueError(f"quantize_blockwise expects a non-empty 2-D tensor; got shape {tuple(x.shape)}.")
    if tile not in (ROW_TILE, COLUMN_TILE, WEIGHT_BLOCK):
        raise ValueError(f"tile={tile} is invalid; allowed: {ROW_TILE}, {COLUMN_TILE}, {WEIGHT_BLOCK}.")
    rows, cols = tile
    (m, k), padded = x.shape, pad_2d(wide(x.detach()), rows, cols)
    tiles = padded.view(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)
    scale = block_scale(tiles.abs().amax(dim=(1, 3)), dtype, power_of_2)
    data = to_fp8_saturated(tiles * scale[:, None, :, None], dtype).view(padded.shape)
    return (data if data.shape == x.shape else data[:m, :k].contiguous()), scale


def tile_of(data_shape: torch.Size, scale_shape: torch.Size) -> tuple[int, int]:
    """The tile a (data, scale) pair was quantized with, from their shapes; an error when they do not fit."""
    (m, k), (sm, sk) = data_shape, scale_shape
    rows = 1 if sm == m else TILE
    cols = 1 if sk == k else TILE
    if (sm, sk) != (_ceil_div(m, rows), _ceil_div(k, cols)):
        raise ValueError(f"block scales of shape {tuple(scale_shape)} do not fit data of shape {tuple(data_shape)}.")
    return rows, cols


def per_element(scale: torch.Tensor, data_shape: torch.Size) -> torch.Tensor:
    """Tile values (one per tile of data of ``data_shape``) repeated over their tiles: one per element."""
    (m, k), (rows, cols) = data_shape, tile_of(data_shape, scale.shape)
    (tiles_m, tiles_k) = scale.shape
    spread = scale[:, None, :, None].expand(tiles_m, rows, tiles_k, cols).reshape(tiles_m * rows, tiles_k * cols)
    return spread if spread.shape == data_shape else spread[:m, :k]


def dequantize_blockwise(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``data * (1 / scale)`` in float32, each factor repeated over its tile (the inverse of the cast)."""
    return fp8_to_float32(data) * per_element(scale.float().reciprocal(), data.shape)


# --------------------------------------------------------------------------------------------------------
# GEMMs
# --------------------------------------------------------------------------------------------------------


def blockwise_gemm_support(device: torch.device | str) -> tuple[bool, str]:
    """Whether cuBLAS runs 1x128 / 128x128 block-scaled FP8 GEMMs on ``device`` (sm90 with CUDA 12.9+), and why
    not."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False, f"blockwise FP8 GEMMs need a CUDA device (got '{device.type}')"
    major, minor = torch.cuda.get_device_capability(device)
    if major != BLOCKWISE_CAPABILITY_MAJOR:
        return False, f"compute capability {major}.{minor} has no 1x128/128x128 block-scaled GEMM (cuBLAS: 9.x only)"
    cuda = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
    if cuda < (12, 9):
        return False, f"CUDA {torch.version.cuda} has no block-scaled GEMM (needs CUDA 12.9+)"
    return True, f"compute capability {major}.{minor}, CUDA {torch.version.cuda}"


def _scale_layout(q: Quantized, rows: int) -> torch.Tensor:
    """``1 / scale`` of an operand with (rows x 128) tiles and K last, in the layout cuBLAS reads for it:
    1x128 "outer-dim-major" (column-major, stride (1, M)); 128x128 "inner-dim-major" with the row stride padded to a
    multiple of 4 (16 bytes). The CUDA cast kernels write the operand's ``inverse`` in that layout: no copy then."""
    inverse = q.inverse_scale()
    if rows == 1:
        return row_major(inverse.t()).t()
    if inverse.stride(1) == 1 and inverse.stride(0) % 4 == 0:
        return inverse
    k_tiles = inverse.shape[1]
    return row_major(pad_dim(inverse, 1, 4)).narrow(1, 0, k_tiles)  # narrow: fake tensors refuse indexing


def blockwise_scaled_mm_args(
    a: Quantized, b: Quantized
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mat1, mat2, scale_a, scale_b)`` for ``torch._scaled_mm`` computing ``a @ b.T`` with block scales: mat1
    (M, K) row-major and mat2 (K, N) column-major, K and N zero-padded to multiples of 16 (which adds no tile, 128
    being a multiple of 16; padded 1x128 rows of b get factor 1); scale_a in a's layout (:func:`_scale_layout`) and
    scale_b the transpose of b's. Supported pairs: (1x128, 128x128), (1x128, 1x128) and (128x128, 1x128)."""
    a_rows, _ = tile_of(a.data.shape, a.scale.shape)
    b_rows, _ = tile_of(b.data.shape, b.scale.shape)
    if a_rows == b_rows == TILE:
        raise ValueError("a blockwise GEMM cannot multiply two 128x128-scaled operands; cast one in 1x128 tiles.")
    mat1, b_data = scaled_mm_layout(a.data, b.data)
    b_q = b
    if b_rows == 1 and b_data.shape[0] != b.data.shape[0]:  # padded rows of b: one more factor each (value 1)
        ones = b.scale.new_ones((b_data.shape[0] - b.data.shape[0], b.scale.shape[1]))
        b_q = Quantized(b_data, torch.cat([b.scale.float(), ones]), BLOCK)
    return mat1, b_data.t(), _scale_layout(a, a_rows), _scale_layout(b_q, b_rows).t()


def dequantized_f32(q: Quantized) -> torch.Tensor:
    """A blockwise operand's dequantized float32 values, which the emulated GEMM multiplies: ``q.f32`` where the
    cast made them (the CPU codec), else computed here."""
    return q.f32 if q.f32 is not None else dequantize_blockwise(q.data, q.scale)


def _emulated(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    return (dequantized_f32(a) @ dequantized_f32(b).t()).to(out_dtype)


def blockwise_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype, emulate: bool = False) -> torch.Tensor:
    """``a @ b.T`` for block-scaled operands (M, K) and (N, K): cuBLAS where it runs them, the float32 emulation on
    CPU or with ``emulate``; elsewhere an error that says why and how to emulate."""
    device = a.data.device
    if emulate or device.type == "cpu":
        return _emulated(a, b, out_dtype)
    ok, reason = blockwise_gemm_support(device)
    if not ok:
        raise RuntimeError(f"BlockwiseScaling cannot run its FP8 GEMMs here: {reason}; {EMULATE_HINT}.")
    n = b.data.shape[0]
    mat1, mat2, scale_a, scale_b = blockwise_scaled_mm_args(a, b)
    mm_dtype = out_dtype if out_dtype in (torch.float32, torch.bfloat16) else torch.float32
    out = torch._scaled_mm(mat1, mat2, scale_a=scale_a, scale_b=scale_b, out_dtype=mm_dtype)
    return out[:, :n].to(out_dtype)
