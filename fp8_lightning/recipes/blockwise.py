"""Blockwise scaling (DeepSeek-V3's recipe, TransformerEngine's ``Float8BlockScaling``): 1x128 tiles for inputs and
output gradients, 128x128 blocks for weights.

Tiles run along each GEMM's reduction dimension: activations and gradients are cast twice from high precision
(along the feature and along the token dimension); the weight once, its blocks transposed for the input gradient
(:mod:`fp8_lightning.blockwise` holds the math).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch.nn.functional as F

from fp8_lightning.blockwise import (
    COLUMN_TILE,
    ROW_TILE,
    WEIGHT_BLOCK,
    dequantize_blockwise,
    per_element,
    quantize_blockwise,
)
from fp8_lightning.fine_grained import (
    reference_fine_cast,
    block_mm,
    block_scale_columns,
    blockwise_shard_reason,
    pack_shard,
    unpack_block_scales,
)
from fp8_lightning import cuda_rules
from fp8_lightning.formats import Format, fp8_dtype
from fp8_lightning.gemm_routes import GemmRoute, arch_name, cuda_name, emulated_on_gpu, native
from fp8_lightning.groups import ExpertBlockWeights, PaddedGroupColumns, padded_group_sizes, padded_rows
from fp8_lightning.ops import dispatch
from fp8_lightning.ops.layer import operand_values, traced_tile_cast
from fp8_lightning.quantize import BLOCK, Quantized
from fp8_lightning.recipes.base import check_flags
from fp8_lightning.recipes.fine_grained import FineGrainedRecipe


@dataclasses.dataclass(frozen=True)
class BlockwiseScaling(FineGrainedRecipe):
    """DeepSeek-V3's block scaling: inputs and output gradients in 1x128 tiles, weights in 128x128 blocks.

    Every tile or block has a float32 scale ``fp8_max / amax`` (rounded down to a power of two when
    ``power_of_2_scales``, TransformerEngine's default); an all-zero or non-finite block gets scale 1. Tiles run
    along each GEMM's reduction dimension: activations and gradients are cast twice from high precision (along
    the feature and along the token dimension); the weight once, its blocks transposed for the input gradient.

    Args:
        fp8_format: the FP8 formats (``Format.HYBRID``: E4M3 forward, E5M2 gradients; ``Format.E4M3``: E4M3
            everywhere), as an enum or its name.
        fprop_fast_accum: cuBLAS's fast accumulation for the forward GEMM on CUDA.
        grad_fast_accum: cuBLAS's fast accumulation for the two backward GEMMs on CUDA.
        power_of_2_scales: round scales down to a power of two (the default, as TransformerEngine).
    """

    name: ClassVar[str] = "blockwise"
    operand_kind: ClassVar = BLOCK

    fp8_format: Format = Format.E4M3
    power_of_2_scales: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_flags(self, "power_of_2_scales")

    # -- the layer ------------------------------------------------------------------------------------------

    def fine_copies(self, role, x, dtype, columnwise, cast):
        """1x128 tiles along K for fprop and along x's first dimension for ``x.T``; a weight's 128x128 blocks, whose
        transpose is W.T's operand."""
        if role == "weight":
            return cast(x, dtype, WEIGHT_BLOCK, self.power_of_2_scales, transpose=columnwise)
        row = cast(x, dtype, ROW_TILE, self.power_of_2_scales)[0]
        return row, (cast(x, dtype, COLUMN_TILE, self.power_of_2_scales)[0] if columnwise else None)

    # -- grouped GEMMs (mixtures of experts) ----------------------------------------------------------------

    def grouped_operands(self, role, x, bounds, dtype, columnwise, state, record):
        """The fprop copy is one cast of ``x``; every group's ``x[start:end].T`` copy comes from one cast of x's rows
        laid out with each group padded with zeros to whole 128-token tiles, whatever the number of groups: a tile
        never spans two groups and zeros change no tile's amax (the bits of casting each group on its own)."""
        offs = getattr(bounds, "offs", None)
        if not columnwise or offs is None or x.numel() == 0:
            return super().grouped_operands(role, x, bounds, dtype, columnwise, state, record)
        row = self.cast(role, x, dtype, False, True, state, record)[0]
        align = COLUMN_TILE[0]
        index = padded_rows(offs.to(x.device), x.shape[0], align)[0]
        length = sum(padded_group_sizes(bounds, align))
        padded = x.detach().new_zeros(length, x.shape[1]).index_copy_(0, index, x.detach())
        cast = dispatch.fine_caster(padded) or reference_fine_cast
        return row, PaddedGroupColumns(cast(padded, dtype, COLUMN_TILE, self.power_of_2_scales)[0], index, bounds,
                                       align)  # fmt: skip

    def grouped_weight_operands(self, weight, dtype, states, record):
        """Every expert's 128x128 blocks (and W_e.T's, the same blocks transposed) from one cast of the experts
        stacked, each expert's rows padded with zeros to whole blocks: no block spans two experts and zeros change
        no block's amax (the bits of casting each expert on its own), whatever the number of experts."""
        experts, n, k = weight.shape
        if weight.numel() == 0:
            return super().grouped_weight_operands(weight, dtype, states, record)
        block = WEIGHT_BLOCK[0]
        padded = F.pad(weight, (0, 0, 0, -n % block)) if n % block else weight
        stacked = padded.reshape(-1, k)
        row, column = dispatch.fast_fine_operands(self, "weight", stacked, dtype, True)
        return ExpertBlockWeights(row, column, experts, n, block)

    def gemm_route(self, capability, cuda, has_scaled_mm_v2) -> GemmRoute:
        refused = cuda_rules.device_violation(capability, cuda)
        if refused is not None:
            return emulated_on_gpu(refused)
        api = "torch.nn.functional.scaled_mm (v2) and torch._scaled_mm" if has_scaled_mm_v2 else "torch._scaled_mm"
        return native(f"cuBLAS 1x128 / 128x128 block-scaled GEMM ({api})",
                      f"{arch_name(capability)}, {cuda_name(cuda)}; shapes cuBLAS cannot take are emulated "
                      "(fp8_lightning.cuda_rules.blockwise_gemm_plan)")

    def traced_grouped_columns(self, x, offs, dtype, role):
        """Each group's tokens padded with zeros to whole 128-token tiles and cast in tiles along the tokens: the
        tiles of casting each group on its own."""
        index, length = padded_rows(offs, x.shape[0], COLUMN_TILE[0])
        padded = x.new_zeros(length, x.shape[1]).index_copy(0, index, x)
        q = traced_tile_cast(padded, dtype, COLUMN_TILE, self.power_of_2_scales)[0]
        return operand_values(q.data, q.scale, q.kind).t()[index]  # back to x's rows

    # -- tensor and sequence parallelism ---------------------------------------------------------------------

    def tensor_parallel_block(self) -> int:
        return WEIGHT_BLOCK[0]  # 128x128 weight blocks

    def sequence_block(self) -> int:
        return COLUMN_TILE[0]  # the wgrad copy's 128-token tiles

    # -- FSDP2 ----------------------------------------------------------------------------------------------

    def fsdp_unsupported_reason(self, rows: int, cols: int, world_size: int) -> str | None:
        return blockwise_shard_reason(rows, world_size)

    def fsdp_pack(self, shard, module, global_amax):
        """The shard's codes, then its 128x128 block scales spread over its rows."""
        rows, k = shard.shape
        data, scale = quantize_blockwise(shard, WEIGHT_BLOCK, fp8_dtype(self.fp8_format), self.power_of_2_scales)
        return pack_shard(data, scale, block_scale_columns(rows, k)), None

    def fsdp_unpack(self, gathered, shard_rows, k, metadata):
        data = gathered[:, :k].view(fp8_dtype(self.fp8_format))
        return Quantized(data, unpack_block_scales(gathered, shard_rows, k), BLOCK)

    def fsdp_operands(self, gathered, scaling, metadata, record, columnwise=True):
        """W.T's operand is the gathered blocks transposed (exact, as in one process)."""
        row = Quantized(gathered.data.contiguous(), gathered.scale.contiguous(), BLOCK)  # dense for the GEMM
        return row, Quantized(row.data.t(), row.scale.t(), BLOCK) if columnwise else None


BLOCK.implement(
    gemm=block_mm,
    to_f32=lambda q: dequantize_blockwise(q.data, q.scale),
    dequantize=lambda q, out_dtype: dispatch.operand_f32(q).to(out_dtype),
    scale_multiplier=lambda q, k: per_element(q.scale.float(), q.data.shape)[..., :k],
    representative_scale=lambda q: q.scale.float().amin().reshape(()),
)

__all__ = ["BlockwiseScaling"]
