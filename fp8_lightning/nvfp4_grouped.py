"""NVFP4's grouped casts in one pass, whatever the number of experts: the stacked expert weights with a global scale
per expert, and every group's wgrad copy from one layout of the tokens with each group padded to whole 16-blocks.

Each expert's or group's cast on its own takes the global scale of its own amax, its own blocks, and (gradients) its
own stochastic-rounding key. The casts here compute the same numbers for all of them at once: the amaxes by one
reduction, a vector of global scales broadcast over the blocks, the Hadamard transform block by block (no block
spans two groups), the noise from the counter-based hash with each position's own group key. Every code, block scale
and global scale is that of the per-expert / per-group cast, and the emulated GEMMs dequantize each stacked operand
once. The experts' weights gathered by FSDP2 (:mod:`fp8_lightning.nvfp4_shards`) become the same stacked operands,
made in one pass from the gathered stacked cast.
"""

from __future__ import annotations

import collections.abc
import functools
from typing import Callable

import torch

from fp8_lightning.groups import GroupBounds, GroupOperands, StackedWeights, group_ends, host_token_layout, token_layout
from fp8_lightning.nvfp4 import (
    NVFP4_BLOCK,
    NVFP4Tensor,
    block_multipliers,
    nvfp4_encode_blocks,
    global_scale_from_amax,
    mix_seed,
    rht_blocks,
    uniform_at,
)
from fp8_lightning.nvfp4_shards import nvfp4_stacked_transposes
from fp8_lightning.quantize import OperandCache, Quantized

Operand = Callable[[NVFP4Tensor], Quantized]  # the recipe's maker of a GEMM operand from a cast


def _stacked(cast: NVFP4Tensor, kind) -> Quantized:
    """The operand of a stacked cast for one dequantization: codes and each block's multiplier, no GEMM scales."""
    return Quantized(cast.codes, block_multipliers(cast), kind, OperandCache())


def _cast_stacked(x: torch.Tensor, global_scales: torch.Tensor, tile_rows: int, uniform=None) -> NVFP4Tensor:
    """One cast of ``x`` whose blocks each take their own entry of ``global_scales`` (broadcast over the blocks)."""
    codes, scales = nvfp4_encode_blocks(x.float(), global_scales, tile_rows, uniform)
    return NVFP4Tensor(codes, scales, global_scales, tuple(x.shape), tile_rows)


class NVFP4StackedWeights(StackedWeights):
    """Every expert's (W_e, W_e.T) NVFP4 operands, made on first use with their GEMM scales, from the two stacked
    casts (``rows`` (E * N, K), ``columns`` (E * K, N): 16x16 tiles or 1x16 blocks, each inside one expert) and each
    expert's global scale ``global_scales`` (E,). ``columns`` may be a function that makes the cast, called on first
    use (the forward of FSDP2-gathered experts needs the rows only)."""

    def __init__(self, rows: NVFP4Tensor, columns: NVFP4Tensor | Callable[[], NVFP4Tensor], global_scales,
                 experts: int, operand: Operand, kind):  # fmt: skip
        super().__init__(_stacked(rows, kind), lambda: _stacked(self.casts[1], kind), experts)
        self._column_cast, self.row_cast, self.global_scales, self.operand = columns, rows, global_scales, operand

    @property
    def casts(self) -> tuple[NVFP4Tensor, NVFP4Tensor]:
        """The two stacked casts, W.T's made now if it was deferred."""
        if callable(self._column_cast):
            self._column_cast = self._column_cast()
        return self.row_cast, self._column_cast

    def values(self) -> torch.Tensor:
        """Every W_e's float32 values (E, N, K) from one dequantization of the stacked rows."""
        return self.rows.kind.dequantize(self.rows, torch.float32).reshape(self.experts, -1, self.row_cast.shape[1])

    def transposed_values(self) -> torch.Tensor:
        """The values of every W_e.T operand (its own blocks), transposed back to (E, N, K)."""
        values = self.columns.kind.dequantize(self.columns, torch.float32)
        return values.reshape(self.experts, -1, self.casts[1].shape[1]).transpose(1, 2)

    @functools.cached_property
    def _pairs(self) -> list[tuple[Quantized, Quantized]]:
        return [tuple(self.operand(_expert_cast(cast, e, self.experts, scale)) for cast in self.casts)
                for e, scale in enumerate(self.global_scales.unbind(0))]  # fmt: skip


def _expert_cast(cast: NVFP4Tensor, expert: int, experts: int, global_scale: torch.Tensor) -> NVFP4Tensor:
    rows, k = cast.shape[0] // experts, cast.shape[1]
    tiles = rows // cast.tile_rows
    return NVFP4Tensor(cast.codes[expert * rows : (expert + 1) * rows],
                       cast.block_scales[expert * tiles : (expert + 1) * tiles], global_scale, (rows, k),
                       cast.tile_rows)  # fmt: skip


def nvfp4_stacked_weights(weight: torch.Tensor, tile_rows: int, operand: Operand, kind) -> NVFP4StackedWeights:
    """The experts' weights (E, N, K) cast at once: each expert's global scale from its own amax (one reduction), the
    stacked rows and the stacked transposes each cast once with those scales, N and K being whole 16-blocks."""
    experts, n, k = weight.shape
    w = weight.detach().float()
    global_scales = global_scale_from_amax(w.abs().amax(dim=(1, 2)))  # (E,)
    rows = _cast_stacked(w.reshape(experts * n, k), global_scales.repeat_interleave(n // tile_rows).unsqueeze(1),
                         tile_rows)  # fmt: skip
    flipped = w.transpose(1, 2).reshape(experts * k, n)
    columns = _cast_stacked(flipped, global_scales.repeat_interleave(k // tile_rows).unsqueeze(1), tile_rows)
    return NVFP4StackedWeights(rows, columns, global_scales, experts, operand, kind)


class NVFP4ExpertRows(collections.abc.Sequence):
    """Every expert's fprop operand W_e (its own global scale), made on first use, of the stacked cast ``cast``
    (E * N, K) that FSDP2 gathered; ``global_scales`` (E,)."""

    def __init__(self, cast: NVFP4Tensor, global_scales: torch.Tensor, experts: int, operand: Operand):
        self.cast, self.global_scales, self.experts, self.operand = cast, global_scales, experts, operand

    @functools.cached_property
    def _operands(self) -> list[Quantized]:
        return [self.operand(_expert_cast(self.cast, e, self.experts, scale))
                for e, scale in enumerate(self.global_scales.unbind(0))]  # fmt: skip

    def __getitem__(self, index):
        return self._operands[index]

    def __len__(self) -> int:
        return self.experts


def nvfp4_gathered_weights(gathered: NVFP4ExpertRows, operand: Operand, kind) -> NVFP4StackedWeights:
    """The (W_e, W_e.T) operands of every gathered expert in one pass: W_e.T from 16x16 tiles transposed (the bits of
    casting W_e.T), or with 1x16 blocks re-cast along N from the gathered values with each expert's global scale."""
    cast, experts, global_scales = gathered.cast, gathered.experts, gathered.global_scales
    rows = cast._replace(codes=cast.codes.contiguous())

    def columns() -> NVFP4Tensor:  # made where used: the forward needs the rows only
        if rows.tile_rows == NVFP4_BLOCK:
            return nvfp4_stacked_transposes(rows, experts, global_scales)
        k, n = rows.shape[1], rows.shape[0] // experts
        values = kind.dequantize(_stacked(rows, kind), torch.float32).view(experts, n, k)
        flipped = values.transpose(1, 2).reshape(experts * k, n)
        return _cast_stacked(flipped, global_scales.float().repeat_interleave(k).unsqueeze(1), 1)

    return NVFP4StackedWeights(rows, columns, global_scales, experts, operand, kind)


class NVFP4GroupColumns(GroupOperands):
    """Every group's wgrad copy of ``x[start:end].T`` (None for an empty group), made on first use with its GEMM
    scales, from one cast ``whole`` of the (K, L) layout with each group padded to whole 16-blocks (an empty group
    one block of zeros); ``offs`` (device int32) and ``bounds`` (host) the padded groups' ends, ``global_scales`` each
    group's, ``sizes`` each group's tokens."""

    def __init__(self, whole: NVFP4Tensor, global_scales, offs, bounds: GroupBounds, sizes, operand: Operand, kind):
        self.whole, self.global_scales, self.offs, self.bounds = whole, global_scales, offs, bounds
        self.sizes, self.operand, self.kind = sizes, operand, kind

    @functools.cached_property
    def _views(self) -> list[Quantized | None]:
        whole, views = self.whole, []
        for (start, end), size, scale in zip(self.bounds, self.sizes, self.global_scales.unbind(0)):
            cast = NVFP4Tensor(whole.codes[:, start // 2 : end // 2].contiguous(),
                               whole.block_scales[:, start // NVFP4_BLOCK : end // NVFP4_BLOCK].contiguous(), scale,
                               (whole.shape[0], end - start))  # fmt: skip
            views.append(self.operand(cast) if size else None)
        return views

    def __len__(self) -> int:
        return len(self.sizes)

    def padded_values(self) -> torch.Tensor:
        """The float32 values (K, L) of the whole layout from one dequantization: each group's operand (its padding
        included, where the transform spread its tokens) at its padded place, zeros for an empty group."""
        return self.kind.dequantize(_stacked(self.whole, self.kind), torch.float32)

    def wgrad_values(self, offs, bounds):
        """The whole layout's values (:meth:`padded_values`) with the padded groups' ends and bounds: the product sums
        over each group's padding too, which holds values where the transform spread the group's tokens."""
        return self.padded_values(), self.offs, self.bounds


def nvfp4_group_columns(x, bounds, signs, keys, operand: Operand, kind) -> NVFP4GroupColumns:
    """Every group's wgrad copy of ``x`` (M, K) in one cast: the tokens laid out with each group padded with zeros to
    whole 16-blocks, transposed to (K, L), through the RHT (``signs``, or None) block by block, each group's global
    scale from its own amax, and (``keys``: each group's stochastic-rounding key (E,), or None) each group's noise
    numbered from its own first column as its own cast numbers it."""
    sizes, padded, starts = host_token_layout(bounds, NVFP4_BLOCK)
    total, device, (rows, k) = sum(padded), x.device, x.shape
    placed = token_layout(group_ends(bounds, device), NVFP4_BLOCK, rows)
    layout = x.detach().float().new_zeros(total, k).index_copy_(0, placed.dest, x.detach().float()).t()  # (K, L)
    if signs is not None:
        layout = rht_blocks(layout, signs)
    column = torch.arange(total, device=device)
    group = torch.searchsorted(placed.ends, column, right=True)  # each column's group
    block_amax = layout.abs().amax(dim=0).reshape(-1, NVFP4_BLOCK).amax(dim=1)  # (L / 16,)
    amax = block_amax.new_zeros(len(sizes)).scatter_reduce_(0, group[::NVFP4_BLOCK], block_amax, "amax")
    global_scales = global_scale_from_amax(amax)
    uniform = None
    if keys is not None:  # position (r, c) of group g's own (K, p_g) cast: r * p_g + c
        local = column - (placed.ends - placed.sizes)[group]
        index = torch.arange(k, device=device).unsqueeze(1) * placed.sizes[group] + local
        uniform = uniform_at(index, keys.to(device)[group])
    whole = _cast_stacked(layout, global_scales[group[::NVFP4_BLOCK]].unsqueeze(0), 1, uniform)
    padded_bounds = GroupBounds(zip(starts, [s + p for s, p in zip(starts, padded)]), placed.ends.to(torch.int32))
    return NVFP4GroupColumns(whole, global_scales, placed.ends.to(torch.int32), padded_bounds, sizes, operand, kind)


def group_keys(seed: "int | torch.Tensor", rank: int, counter, groups: int, copy: int, device) -> torch.Tensor:
    """Every group's stochastic-rounding key of its wgrad copy, ``mix_seed(mix_seed(seed, rank, counter, g), copy)``,
    as one vector (the hash is elementwise)."""
    group = torch.arange(groups, dtype=torch.int64, device=device)
    counter = counter if counter is not None else 0
    return mix_seed(mix_seed(seed, rank, counter, group), copy)
