"""Machinery the rowwise and blockwise recipes share: the copies' casts, their GEMMs per operand kind, the FSDP2
wire format.

Their math is in :mod:`fp8_lightning.rowwise` and :mod:`fp8_lightning.blockwise`; which copies each GEMM role gets is
the recipe's (:mod:`fp8_lightning.recipes.rowwise`, :mod:`fp8_lightning.recipes.blockwise`), made by a ``cast`` with
``kernels.fine_cast``'s signature (default :func:`reference_fine_cast`; the Triton kernel and the C codec in
:func:`fp8_lightning.ops.dispatch.fast_fine_operands`):

* :func:`fine_operands`: the operand of a 2-D tensor reducing over its last dimension, and the operand of its
  transpose, of kind ``ROW``, ``BLOCK`` or, for a weight gradient kept in high precision, ``HIGH_PRECISION``.
* :func:`row_mm`, :func:`block_mm`, :func:`high_precision_gemm`: ``a @ b.T (+ bias)`` for two operands of a kind.
* :func:`tile_kind`: the operand kind one tile's copy makes.

Traced, each copy is the custom op ``torch.ops.fp8_lightning.fine_tile_cast`` (:mod:`fp8_lightning.ops.layer`), fed
by the same copy mapping (:class:`fp8_lightning.recipes.fine_grained.FineGrainedRecipe`).

Like per-tensor current scaling these recipes keep no state between steps: every scale comes from the tensor
being cast, so there is nothing to synchronise across ranks or to checkpoint beyond the recipe itself.
"""

from __future__ import annotations

from typing import Any

import torch

from fp8_lightning.blockwise import (
    COLUMN_TILE,
    TILE,
    blockwise_mm,
    quantize_blockwise,
)
from fp8_lightning.kernels.fine_grained_layout import ROWWISE_TILES
from fp8_lightning.settings import settings
from fp8_lightning.quantize import BLOCK, ROW, OperandKind, Quantized
from fp8_lightning.rowwise import (
    dequantize_rowwise,
    high_precision_mm,
    quantize_rowwise,
    rowwise_mm,
)


def fine_operands(
    recipe: Any, role: str, x: torch.Tensor, dtype: torch.dtype, columnwise: bool, cast=None
) -> tuple[Quantized, Quantized | None]:
    """(operand of ``x``, operand of ``x.T`` when ``columnwise``) of a 2-D ``x`` in GEMM role ``role``
    (``"input"``, ``"weight"`` or ``"grad_output"``) under a rowwise or blockwise ``recipe``: the copies its
    ``fine_copies`` names, each made by ``cast`` (default :func:`reference_fine_cast`)."""
    return recipe.fine_copies(role, x, dtype, columnwise, cast or reference_fine_cast)


def tile_kind(tile: tuple[int, int]) -> OperandKind:
    """The kind of the operand a ``kernels.fine_cast`` tile makes: ``ROW`` for one scale per row or column (a 0 in
    the tile: the whole dimension), ``BLOCK`` for 1x128 / 128x1 tiles and 128x128 blocks."""
    return ROW if tile in ROWWISE_TILES else BLOCK


def reference_fine_cast(
    x: torch.Tensor, dtype: torch.dtype, tile: tuple[int, int], power_of_2: bool, eps: float = 1e-12,
    transpose: bool = False,
) -> tuple[Quantized, Quantized | None]:
    """``kernels.fine_cast`` from the reference casts (:func:`fine_cast_twin`): the operand of one copy, and with
    ``transpose`` (128x128 blocks) the operand of ``x.T`` from the same blocks."""
    data, scale = fine_cast_twin(x, tile, dtype, power_of_2, eps)
    kind = tile_kind(tile)
    return Quantized(data, scale, kind), (Quantized(data.t(), scale.t(), kind) if transpose else None)


def fine_cast_twin(
    x: torch.Tensor, tile: tuple[int, int], dtype: torch.dtype, power_of_2: bool, eps: float = 1e-12
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale)`` of one copy as ``kernels.fine_cast`` makes it, from the reference casts: ``tile`` (1, 0) or
    (0, 1) one scale per row or per column (rowwise, ``eps``), else a blockwise tile; the copies scaled down x's
    columns ((0, 1), (128, 1)) are the operand of ``x.T`` (transposed views here)."""
    if tile in ROWWISE_TILES:
        data, scale = quantize_rowwise(x, dtype, -1 if tile == ROWWISE_TILES[0] else 0, eps, power_of_2)
    else:
        data, scale = quantize_blockwise(x, tile, dtype, power_of_2)
    return (data.t(), scale.t()) if tile in (ROWWISE_TILES[1], COLUMN_TILE) else (data, scale)


def _add_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return out if bias is None else out + bias.to(out.dtype)


def row_mm(
    a: Quantized, b: Quantized, out_dtype: torch.dtype, emulate: bool = False, bias: torch.Tensor | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``a @ b.T (+ bias)`` for rowwise operands. ``emulate``: multiply the dequantized operands in float32 (GPUs
    without the scaled GEMM). ``fast_accum``: the recipe's fast accumulation, which cuBLAS's rowwise GEMM takes; the
    CPU GEMM accumulates in float32."""
    if _emulating(emulate):
        out = (dequantize_rowwise(a.data, a.scale) @ dequantize_rowwise(b.data, b.scale).t()).to(out_dtype)
    else:
        out = rowwise_mm(a, b, out_dtype, fast_accum)
    return _add_bias(out, bias)


def block_mm(
    a: Quantized, b: Quantized, out_dtype: torch.dtype, emulate: bool = False, bias: torch.Tensor | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``a @ b.T (+ bias)`` for 1x128 / 128x128 operands; cuBLAS's block-scaled GEMM is left to its own accumulation
    (it promotes the partial sums of every 128-long slice of K to float32 with that slice's scales, the precision
    block scaling is chosen for), so ``fast_accum`` is not used."""
    return _add_bias(blockwise_mm(a, b, out_dtype, _emulating(emulate)), bias)


def high_precision_gemm(
    a: Quantized, b: Quantized, out_dtype: torch.dtype, emulate: bool = False, bias: torch.Tensor | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``a @ b.T (+ bias)`` of two unquantized operands (a weight gradient kept in high precision)."""
    return _add_bias(high_precision_mm(a, b, out_dtype), bias)


def _emulating(emulate: bool) -> bool:
    return emulate or settings().gemm == "emulate" or settings().emulate


# --------------------------------------------------------------------------------------------------------
# The FSDP2 all-gather wire format
# --------------------------------------------------------------------------------------------------------
# FSDP2 shards a weight (N, K) by rows and gathers the shards' bytes along rows, one all-gather input per weight.
# Both recipes quantize the fprop copy along K, so every rank quantizes its own rows and the scales travel with the
# data, appended to the shard's rows as bytes:
#
#     rowwise    row r: K code bytes, then the 4 bytes of its float32 scale                (1 + 4/K bytes/element)
#     blockwise  each shard's rows hold their K code bytes, then the shard's 128x128 block scales, flattened and
#                spread over the shard's rows (ceil(4 * blocks / rows) bytes per row)   (about 1 + 4/128**2)
#
# Blockwise blocks must not straddle shards: a shard holds a whole number of 128-row blocks (or the whole weight).

SCALE_BYTES = 4  # float32


def blockwise_shard_reason(rows: int, world_size: int) -> str | None:
    """Why a blockwise weight of ``rows`` rows cannot be gathered in FP8 over ``world_size`` ranks, or None."""
    shard = rows // world_size
    if world_size > 1 and shard % TILE:
        return f"out_features / world size = {shard} rows per shard is not a multiple of the 128-row weight block"
    return None


def block_scale_columns(shard_rows: int, k: int) -> int:
    """Bytes per row that carry a blockwise shard's 128x128 block scales."""
    blocks = -(-shard_rows // TILE) * -(-k // TILE)
    return -(-blocks * SCALE_BYTES // shard_rows)


def pack_shard(data: torch.Tensor, scale: torch.Tensor, width: int) -> torch.Tensor:
    """The uint8 all-gather input of a quantized shard (rows, K): its codes, then its float32 scales' bytes spread
    over ``width`` bytes per row (see above)."""
    rows = data.shape[0]
    scale_bytes = scale.contiguous().view(torch.uint8).reshape(-1)
    spread = torch.nn.functional.pad(scale_bytes, (0, rows * width - scale_bytes.numel())).view(rows, width)
    return torch.cat([data.view(torch.uint8), spread], dim=1)


def unpack_block_scales(gathered: torch.Tensor, shard_rows: int, k: int) -> torch.Tensor:
    """The whole weight's 128x128 block scales from the gathered bytes (N, K + scale columns) of all shards."""
    k_tiles, tiles = -(-k // TILE), -(-shard_rows // TILE)
    scales = [
        part[:, k:].contiguous().view(-1)[: tiles * k_tiles * SCALE_BYTES].view(torch.float32).view(tiles, k_tiles)
        for part in gathered.split(shard_rows)
    ]
    return torch.cat(scales)
