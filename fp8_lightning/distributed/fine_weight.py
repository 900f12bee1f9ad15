"""FP8 all-gather wire format of the rowwise and blockwise recipes: each shard's codes with its float32 scales.

FSDP2 shards a weight (N, K) by rows and gathers the shards' bytes along rows, one all-gather input per weight.
Both recipes quantize the fprop copy along K, so every rank quantizes its own rows and the scales travel with the
data, appended to the shard's rows as bytes::

    rowwise    row r: K code bytes, then the 4 bytes of its float32 scale                 (1 + 4/K bytes/element)
    blockwise  each shard's rows hold their K code bytes, then the shard's 128x128 block scales, flattened and
               spread over the shard's rows (ceil(4 * blocks / rows) bytes per row)    (about 1 + 4/128**2)

Blockwise blocks must not straddle shards: a shard holds a whole number of 128-row blocks (or the whole weight),
which :func:`blockwise_shard_reason` checks.

dgrad's copy of the gathered weight: blockwise transposes the gathered blocks (exact, as in one process); rowwise
needs W scaled down its columns (along N), which no rank can compute from its rows, so it is quantized from the
gathered weight dequantized exactly (a second rounding in dgrad only, as MXFP8 does).
"""

from __future__ import annotations

import torch

from fp8_lightning.blockwise import TILE, WEIGHT_BLOCK, quantize_blockwise
from fp8_lightning.fine_grained import fine_dequantize, fine_operands
from fp8_lightning.quantize import Quantized
from fp8_lightning.recipes import BlockwiseScaling, Recipe
from fp8_lightning.rowwise import quantize_rowwise

SCALE_BYTES = 4  # float32


def blockwise_shard_reason(rows: int, world_size: int) -> str | None:
    """Why a blockwise weight of ``rows`` rows cannot be gathered in FP8 over ``world_size`` ranks, or None."""
    shard = rows // world_size
    if world_size > 1 and shard % TILE:
        return f"out_features / world size = {shard} rows per shard is not a multiple of the 128-row weight block"
    return None


def _scale_columns(shard_rows: int, k: int, recipe: Recipe) -> int:
    """Bytes per row that carry the shard's scales."""
    if not isinstance(recipe, BlockwiseScaling):
        return SCALE_BYTES
    blocks = -(-shard_rows // TILE) * -(-k // TILE)
    return -(-blocks * SCALE_BYTES // shard_rows)


def pack_shard(shard: torch.Tensor, recipe: Recipe, dtype: torch.dtype) -> torch.Tensor:
    """The uint8 all-gather input of a weight shard (rows, K): codes, then scale bytes (see the module docstring)."""
    rows, k = shard.shape
    if isinstance(recipe, BlockwiseScaling):
        data, scale = quantize_blockwise(shard, WEIGHT_BLOCK, dtype, recipe.power_of_2_scales)
    else:
        data, scale = quantize_rowwise(shard, dtype, -1, recipe.eps, recipe.power_of_2_scales)
    scale_bytes = scale.contiguous().view(torch.uint8).reshape(-1)
    width = _scale_columns(rows, k, recipe)
    spread = torch.nn.functional.pad(scale_bytes, (0, rows * width - scale_bytes.numel())).view(rows, width)
    return torch.cat([data.view(torch.uint8), spread], dim=1)


def unpack_gathered(gathered: torch.Tensor, shard_rows: int, k: int, recipe: Recipe, dtype: torch.dtype) -> Quantized:
    """The fprop operand of the whole weight from the gathered bytes (N, K + scale columns) of all shards."""
    data = gathered[:, :k].view(dtype)
    if not isinstance(recipe, BlockwiseScaling):
        return Quantized(data, gathered[:, k : k + SCALE_BYTES].contiguous().view(torch.float32), "row")
    k_tiles, tiles = -(-k // TILE), -(-shard_rows // TILE)
    scales = [
        part[:, k:].contiguous().view(-1)[: tiles * k_tiles * SCALE_BYTES].view(torch.float32).view(tiles, k_tiles)
        for part in gathered.split(shard_rows)
    ]
    return Quantized(data, torch.cat(scales), "block")


def gathered_operands(row: Quantized, recipe: Recipe) -> tuple[Quantized, Quantized]:
    """(fprop operand, dgrad operand of W.T) of a gathered weight (see the module docstring)."""
    row = Quantized(row.data.contiguous(), row.scale.contiguous(), row.kind)  # dense for the GEMM
    if row.kind == "block":
        return row, Quantized(row.data.t(), row.scale.t(), "block")
    return row, fine_operands(recipe, "weight", fine_dequantize(row), row.data.dtype, columnwise=True)[1]
