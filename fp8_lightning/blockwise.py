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

The design in full: ``docs/design/notes.md``, section ``fp8_lightning.blockwise``.
"""

from __future__ import annotations

import warnings

import torch

from fp8_lightning import cuda_rules
from fp8_lightning.formats import fp8_max
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
    spread = scale.unsqueeze(1).unsqueeze(3).expand(tiles_m, rows, tiles_k, cols)  # views: fake tensors take them
    spread = spread.reshape(tiles_m * rows, tiles_k * cols)
    return spread if spread.shape == data_shape else spread.narrow(0, 0, m).narrow(1, 0, k)


def dequantize_blockwise(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``data * (1 / scale)`` in float32, each factor repeated over its tile (the inverse of the cast)."""
    return fp8_to_float32(data) * per_element(scale.float().reciprocal(), data.shape)


# --------------------------------------------------------------------------------------------------------
# GEMMs
# --------------------------------------------------------------------------------------------------------


def _cuda_version() -> tuple[int, int] | None:
    """torch's CUDA version (major, minor), None for a build without CUDA."""
    version = torch.version.cuda
    if not version:
        return None
    major, minor = (int(p) for p in version.split(".")[:2])
    return major, minor


def _device_facts(device: torch.device) -> tuple[tuple[int, int], tuple[int, int] | None] | str:
    """(compute capability, CUDA version) of a CUDA ``device``, or why it has none."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"blockwise FP8 GEMMs need a CUDA device (got '{device.type}')"
    return tuple(torch.cuda.get_device_capability(device)), _cuda_version()


def blockwise_gemm_support(device: torch.device | str) -> tuple[bool, str]:
    """Whether cuBLAS runs 1x128 / 128x128 block-scaled FP8 GEMMs on ``device`` (sm90 with CUDA 12.9+), and why
    not."""
    facts = _device_facts(torch.device(device))
    if isinstance(facts, str):
        return False, facts
    capability, cuda = facts
    reason = cuda_rules.device_violation(capability, cuda)
    if reason is not None:
        return False, reason
    return True, f"compute capability {capability[0]}.{capability[1]}, CUDA {torch.version.cuda}"


def has_scaled_mm_v2() -> bool:
    """Whether this torch has ``torch.nn.functional.scaled_mm`` with the 1x128 / 128x128 scaling types (torch 2.10
    on; present in 2.11, see ``benchmarks/results/blockwise-cuda-rules-20261126.md``)."""
    scaling = getattr(torch.nn.functional, "ScalingType", None)
    return (
        hasattr(torch.nn.functional, "scaled_mm")
        and hasattr(scaling, "BlockWise1x128")
        and hasattr(scaling, "BlockWise128x128")
    )


def _block_operand(a: Quantized, b: Quantized) -> str | None:
    """Which operand of ``a @ b.T`` has 128x128 blocks: "a", "b" or None (both 1x128); two is an error."""
    a_rows, _ = tile_of(a.data.shape, a.scale.shape)
    b_rows, _ = tile_of(b.data.shape, b.scale.shape)
    if a_rows == b_rows == TILE:
        raise ValueError("a blockwise GEMM cannot multiply two 128x128-scaled operands; cast one in 1x128 tiles.")
    return "a" if a_rows == TILE else "b" if b_rows == TILE else None


def blockwise_gemm_path(a: Quantized, b: Quantized) -> tuple[str, str]:
    """``(path, reason)`` of :func:`fp8_lightning.cuda_rules.blockwise_gemm_plan` for ``a @ b.T`` on the device of
    ``a``: "v2", "v1" or "emulate"."""
    facts = _device_facts(a.data.device)
    if isinstance(facts, str):
        return cuda_rules.EMULATE, facts
    capability, cuda = facts
    (m, k), n = a.data.shape, b.data.shape[0]
    e4m3 = a.data.dtype == b.data.dtype == torch.float8_e4m3fn
    return cuda_rules.blockwise_gemm_plan(m, k, n, capability, has_scaled_mm_v2(), cuda, _block_operand(a, b), e4m3)


def _scale_layout(q: Quantized, rows: int) -> torch.Tensor:
    """``1 / scale`` of an operand with (rows x 128) tiles and K last, in the layout the v1 call takes: 1x128
    "outer-dim-major" (column-major, stride (1, M)); 128x128 "inner-dim-major" with the row stride padded to a multiple
    of 4 (16 bytes), as cuBLAS reads it. v1 accepts that padded stride only where it equals ceil(K/128) or there is
    one row of blocks, the shapes :func:`blockwise_gemm_path` sends to v1. The CUDA cast kernels write the operand's
    ``inverse`` in that layout: no copy then."""
    inverse = q.inverse_scale()
    if rows == 1:
        outer = row_major(inverse.t()).t()
        if outer.shape[0] == 1 and outer.stride(0) != 1:  # one row (M = 1): v2 checks stride(0) == 1 all the same
            outer = outer.reshape(-1).unsqueeze(1).t()  # strides (1, 1)
        return outer
    if inverse.stride(1) == 1 and inverse.stride(0) % 4 == 0:
        return inverse
    k_tiles = inverse.shape[1]
    return row_major(pad_dim(inverse, 1, 4)).narrow(1, 0, k_tiles)  # narrow: fake tensors refuse indexing


def _padded_block_scale(q: Quantized) -> torch.Tensor:
    """``1 / scale`` of a 128x128-scaled operand (blocks, ceil(K/128)) as the row-major (blocks, L4) tensor that
    v2 takes transposed, L4 = round_up(ceil(K/128), 4), padded with zeros (factors of K blocks that do not exist).
    One small copy: the cast's padded layout has no storage past the last row's K blocks."""
    return row_major(pad_dim(q.inverse_scale(), 1, cuda_rules.CUBLAS_SCALE_ROW_MULTIPLE))


def _gemm_operands(a: Quantized, b: Quantized) -> tuple[torch.Tensor, torch.Tensor, Quantized]:
    """mat1 (M, K) row-major, b's data (N, K) row-major with K and N padded to 16, and b with a factor 1 for each
    padded row when b has 1x128 tiles."""
    mat1, b_data = scaled_mm_layout(a.data, b.data)
    b_rows, _ = tile_of(b.data.shape, b.scale.shape)
    if b_rows == 1 and b_data.shape[0] != b.data.shape[0]:  # padded rows of b: one more factor each (value 1)
        ones = b.scale.new_ones((b_data.shape[0] - b.data.shape[0], b.scale.shape[1]))
        b = Quantized(b_data, torch.cat([b.scale.float(), ones]), BLOCK)
    return mat1, b_data, b


def blockwise_scaled_mm_args(
    a: Quantized, b: Quantized
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mat1, mat2, scale_a, scale_b)`` for v1 ``torch._scaled_mm`` computing ``a @ b.T`` with block scales: mat1
    (M, K) row-major and mat2 (K, N) column-major, K and N zero-padded to multiples of 16 (which adds no tile, 128
    being a multiple of 16; padded 1x128 rows of b get factor 1); scale_a in a's layout (:func:`_scale_layout`) and
    scale_b the transpose of b's. Supported pairs: (1x128, 128x128), (1x128, 1x128) and (128x128, 1x128)."""
    block = _block_operand(a, b)
    mat1, b_data, b_q = _gemm_operands(a, b)
    a_rows, b_rows = (TILE if block == "a" else 1), (TILE if block == "b" else 1)
    return mat1, b_data.t(), _scale_layout(a, a_rows), _scale_layout(b_q, b_rows).t()


def blockwise_scaled_mm_v2_args(a: Quantized, b: Quantized) -> tuple[torch.Tensor, ...]:
    """``(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b)`` for v2 ``torch.nn.functional.scaled_mm`` computing
    ``a @ b.T``: the operands as for v1; a 1x128 scale (rows, ceil(K/128)) with strides (1, rows) as for v1 (not
    transposed for b); a 128x128 scale as (L4, blocks) with strides (1, L4), L4 = round_up(ceil(K/128), 4): cuBLAS's
    padded layout (ScaledBlas.cpp ``_scaled_block1x128_block128x128`` / ``_scaled_block128x128_block1x128``)."""
    block = _block_operand(a, b)
    mat1, b_data, b_q = _gemm_operands(a, b)
    kinds = torch.nn.functional.ScalingType
    scale_a = _padded_block_scale(a).t() if block == "a" else _scale_layout(a, 1)
    scale_b = _padded_block_scale(b_q).t() if block == "b" else _scale_layout(b_q, 1)
    recipe_a = kinds.BlockWise128x128 if block == "a" else kinds.BlockWise1x128
    recipe_b = kinds.BlockWise128x128 if block == "b" else kinds.BlockWise1x128
    return mat1, b_data.t(), scale_a, recipe_a, scale_b, recipe_b


def dequantized_f32(q: Quantized) -> torch.Tensor:
    """A blockwise operand's dequantized float32 values, which the emulated GEMM multiplies: ``q.cache.f32`` where the
    cast made them (the CPU codec), else computed here."""
    return q.cache.f32 if q.cache.f32 is not None else dequantize_blockwise(q.data, q.scale)


def _emulated(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    return (dequantized_f32(a) @ dequantized_f32(b).t()).to(out_dtype)


_WARNED: set[str] = set()  # fallback reasons already warned about, once each per process


def _warn_fallback(a: Quantized, b: Quantized, reason: str) -> None:
    if reason in _WARNED:
        return
    _WARNED.add(reason)
    warnings.warn(
        f"BlockwiseScaling emulates the GEMM a {tuple(a.data.shape)} @ b.T {tuple(b.data.shape[::-1])} in float32 "
        f"on this device: {reason}. cuBLAS's block-scaled GEMM runs on sm_90 with CUDA 12.9+, and there only for "
        "the shapes fp8_lightning.cuda_rules.blockwise_gemm_plan allows. Results are right but slower; to run natively "
        "use such a GPU and shape (MXFP8BlockScaling on sm_100), or set FP8_LIGHTNING_EMULATE=1 to choose the "
        "emulation and silence this warning.",
        stacklevel=3,
    )


def blockwise_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype, emulate: bool = False) -> torch.Tensor:
    """``a @ b.T`` for block-scaled operands (M, K) and (N, K): the float32 emulation on CPU or with ``emulate``;
    elsewhere the path :func:`blockwise_gemm_path` picks from the shapes and the device (cuBLAS through v2 or v1, or
    the emulation with a warning once per reason), so that no shape raises in the middle of training."""
    if emulate or a.data.device.type == "cpu":
        return _emulated(a, b, out_dtype)
    path, reason = blockwise_gemm_path(a, b)
    if path == cuda_rules.EMULATE:
        _warn_fallback(a, b, reason)
        return _emulated(a, b, out_dtype)
    n = b.data.shape[0]
    mm_dtype = out_dtype if out_dtype in (torch.float32, torch.bfloat16) else torch.float32
    if path == cuda_rules.V2:
        mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b = blockwise_scaled_mm_v2_args(a, b)
        out = torch.nn.functional.scaled_mm(
            mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, output_dtype=mm_dtype
        )
    else:
        mat1, mat2, scale_a, scale_b = blockwise_scaled_mm_args(a, b)
        out = torch._scaled_mm(mat1, mat2, scale_a=scale_a, scale_b=scale_b, out_dtype=mm_dtype)
    return out.narrow(1, 0, n).to(out_dtype)  # narrow: fake tensors refuse indexing
