"""NVFP4 weights on the FSDP2 wire: each rank's shard of rows as packed E2M1 codes plus its E4M3 block scales, the
whole weight's float32 global scale agreed beforehand, and the gathered weight's two GEMM operands.

FSDP2 shards a weight (N, K) by rows. Every rank casts its rows with the global scale of the *whole* weight
(``amax / (448 * 6)`` of the amax agreed across the shard group), so the gathered codes and block scales are the
bits one process casting the whole weight makes, provided no scale block is cut by a shard: 1x16 blocks run along
K and never are; 16x16 weight tiles (``fp4_2d_weights``) need shards of whole 16-row tiles. Per row the all-gather
input holds K / 2 code bytes, then the scale bytes:

* 1x16 blocks: the row's K / 16 E4M3 scales (0.5 + 1/16 bytes per element, 0.28x of bf16);
* 16x16 tiles: the shard's (rows / 16, K / 16) tile scales spread over its rows, ceil(K / 256) bytes a row
  (0.5 + 1/256 bytes per element when K is a multiple of 256: 0.25x of bf16).

The global scale travels as metadata (every rank computed the same one). With tiles the dgrad operand of ``W.T`` is
the gathered codes and tiles transposed, exactly what casting ``W.T`` gives; with 1x16 blocks it is re-cast along N
from the gathered values (no rank holds the high-precision weight in full: one more rounding, in dgrad only, as
MXFP8 and rowwise do).

Fused expert weights (E, N, K) travel as E such weights stacked, each with its own global scale: the pack and the
unpack of all of a rank's experts are one set of operations (a vector of global scales broadcast over the blocks),
with the bytes of packing each expert on its own.
"""

from __future__ import annotations

import torch

from fp8_lightning.nvfp4 import (
    NVFP4_BLOCK,
    NVFP4Tensor,
    global_scale_from_amax,
    nvfp4_encode_blocks,
    pack_e2m1,
    quantize_nvfp4,
    unpack_e2m1,
)

_E4M3 = torch.float8_e4m3fn


def nvfp4_shard_reason(rows: int, cols: int, world_size: int, tile_rows: int) -> str | None:
    """Why a (rows, cols) NVFP4 weight sharded by rows over ``world_size`` ranks cannot travel as codes and
    scales, or None: K must hold whole 16-blocks and, with 16x16 tiles, each shard whole 16-row tiles."""
    if cols % NVFP4_BLOCK:
        return f"in_features={cols} is not divisible by the NVFP4 block of {NVFP4_BLOCK}"
    shard = rows // max(world_size, 1)
    if world_size > 1 and shard % tile_rows:
        return (f"out_features / world size = {shard} rows per shard would cut NVFP4's 16x16 weight tiles; use a "
                "world size that leaves multiples of 16 rows, or fp4_2d_weights=False (1x16 blocks along K)")
    return None


def nvfp4_tile_scale_bytes(shard_rows: int, k: int) -> int:
    """Bytes per row that carry a shard's 16x16 tile scales (one byte each, spread over its rows)."""
    tiles = -(-shard_rows // NVFP4_BLOCK) * (k // NVFP4_BLOCK)
    return -(-tiles // shard_rows)


def pack_nvfp4_shard(shard: torch.Tensor, amax: torch.Tensor, tile_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 all-gather input of this rank's rows, the global scale) from the whole weight's agreed ``amax``."""
    global_scale = global_scale_from_amax(amax.to(shard.device))
    q = quantize_nvfp4(shard, global_scale=global_scale, tile_rows=tile_rows)
    rows, k = shard.shape
    scale_bytes = q.block_scales.contiguous().view(torch.uint8)
    if tile_rows == 1:
        return torch.cat([q.codes, scale_bytes], dim=1), global_scale
    width = nvfp4_tile_scale_bytes(rows, k)
    spread = torch.nn.functional.pad(scale_bytes.reshape(-1), (0, rows * width - scale_bytes.numel()))
    return torch.cat([q.codes, spread.view(rows, width)], dim=1), global_scale


def unpack_nvfp4_gathered(
    gathered: torch.Tensor, shard_rows: int, k: int, global_scale: torch.Tensor, tile_rows: int
) -> NVFP4Tensor:
    """The whole weight as an :class:`~fp8_lightning.nvfp4.NVFP4Tensor` from the gathered bytes of all shards
    (the codes are a view of the gathered buffer)."""
    half = k // 2
    codes = gathered[:, :half]
    if tile_rows == 1:
        scales = gathered[:, half : half + k // NVFP4_BLOCK].contiguous().view(_E4M3)
    else:
        k_tiles, tiles = k // NVFP4_BLOCK, -(-shard_rows // NVFP4_BLOCK)
        scales = torch.cat([
            part[:, half:].contiguous().view(-1)[: tiles * k_tiles].view(_E4M3).view(tiles, k_tiles)
            for part in gathered.split(shard_rows)
        ])
    return NVFP4Tensor(codes, scales, global_scale.float(), (gathered.shape[0], k), tile_rows)


def pack_nvfp4_experts(shard: torch.Tensor, amax: torch.Tensor, tile_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 all-gather input of this rank's experts ``shard`` (E_local, N, K), their global scales (E_local,)) from
    each expert's agreed ``amax``: the bytes of :func:`pack_nvfp4_shard` of each expert, concatenated, in one cast."""
    experts, n, k = shard.shape
    if n % tile_rows or k % NVFP4_BLOCK:
        raise ValueError(f"pack_nvfp4_experts: experts of ({n}, {k}) need N a multiple of {tile_rows} and K of "
                         f"{NVFP4_BLOCK}; pad the expert dimensions (NVFP4 conversion leaves such experts in high "
                         "precision).")  # fmt: skip
    global_scales = global_scale_from_amax(amax.to(shard.device))
    rows = global_scales.repeat_interleave(n // tile_rows).unsqueeze(1)  # each row tile's expert's global scale
    codes, scales = nvfp4_encode_blocks(shard.reshape(experts * n, k).float(), rows, tile_rows)
    scale_bytes = scales.view(torch.uint8)
    if tile_rows == 1:
        return torch.cat([codes, scale_bytes], dim=1), global_scales
    width = nvfp4_tile_scale_bytes(n, k)
    spread = torch.nn.functional.pad(scale_bytes.reshape(experts, -1), (0, n * width - scale_bytes.numel() // experts))
    return torch.cat([codes, spread.view(experts * n, width)], dim=1), global_scales


def unpack_nvfp4_experts(
    gathered: torch.Tensor, experts: int, n: int, k: int, global_scales: torch.Tensor, tile_rows: int
) -> NVFP4Tensor:
    """Every expert's weight as one stacked :class:`~fp8_lightning.nvfp4.NVFP4Tensor` (E * N, K) from the gathered
    bytes, its global scale one per row tile (each that of its expert); the codes are a view of the gathered buffer."""
    half = k // 2
    codes = gathered[:, :half]
    if tile_rows == 1:
        scales = gathered[:, half : half + k // NVFP4_BLOCK].contiguous().view(_E4M3)
    else:
        k_tiles, tiles = k // NVFP4_BLOCK, n // NVFP4_BLOCK
        per_expert = gathered[:, half:].reshape(experts, -1)[:, : tiles * k_tiles]
        scales = per_expert.contiguous().view(_E4M3).view(experts * tiles, k_tiles)
    rows = global_scales.float().repeat_interleave(n // tile_rows).unsqueeze(1)
    return NVFP4Tensor(codes, scales, rows, (experts * n, k), tile_rows)


def nvfp4_stacked_transposes(weights: NVFP4Tensor, experts: int, global_scales: torch.Tensor) -> NVFP4Tensor:
    """Every ``W_e.T`` (E * K, N) from the stacked ``W_e`` (E * N, K) in 16x16 tiles: each expert's codes and tiles
    transposed (:func:`nvfp4_transposed_tiles` of each expert, in one pass)."""
    rows, k = weights.shape
    n = rows // experts
    values = unpack_e2m1(weights.codes).view(experts, n, k).transpose(1, 2).reshape(experts * k, n)
    tiles = weights.block_scales.view(experts, n // NVFP4_BLOCK, k // NVFP4_BLOCK).transpose(1, 2)
    per_row = global_scales.float().repeat_interleave(k // NVFP4_BLOCK).unsqueeze(1)
    return NVFP4Tensor(pack_e2m1(values), tiles.reshape(-1, n // NVFP4_BLOCK), per_row, (experts * k, n), NVFP4_BLOCK)


def nvfp4_transposed_tiles(weight: NVFP4Tensor) -> NVFP4Tensor:
    """``W.T`` from ``W`` (N, K) cast in 16x16 tiles: the codes transposed and each tile's scale moved to the
    transposed tile, with the same global scale; the same numbers, bit for bit, as casting ``W.T``."""
    values = unpack_e2m1(weight.codes).t().contiguous()
    rows, k = weight.shape
    return NVFP4Tensor(pack_e2m1(values), weight.block_scales.t().contiguous(), weight.global_scale, (k, rows),
                       weight.tile_rows)


def nvfp4_recast_columns(values: torch.Tensor, global_scale: torch.Tensor) -> NVFP4Tensor:
    """``W.T`` cast in 1x16 blocks along N from ``values`` (the gathered weight's float32 values), with the
    gathered global scale."""
    return quantize_nvfp4(values.t(), global_scale=global_scale, tile_rows=1)


__all__ = [
    "nvfp4_recast_columns",
    "nvfp4_stacked_transposes",
    "nvfp4_shard_reason",
    "nvfp4_tile_scale_bytes",
    "nvfp4_transposed_tiles",
    "pack_nvfp4_experts",
    "pack_nvfp4_shard",
    "unpack_nvfp4_experts",
    "unpack_nvfp4_gathered",
]
