"""FP8 all-gather of fused expert weights under FSDP2: each rank casts its own experts, the FP8 bytes travel.

A fused experts module holds a projection of all its experts as one 3-D parameter, (E, N, K) or (E, K, N) where
it is stored transposed. FSDP2 shards it along its first dimension, so a rank holds whole experts, and every
expert's scales (one per expert for tensorwise and delayed scaling, per row for rowwise, 128x128 blocks, MX blocks
of 32 along K) can be computed on the rank that holds it: the scales never cross an expert boundary, and a
shard never cuts a block. The recipe's ``fsdp_experts_*`` methods say what travels::

    rank r:  FP8ShardedExperts (experts r*E/W .. (r+1)*E/W, high precision)
               fsdp_pre_all_gather  -> the recipe casts each local expert W_e (N, K) -> uint8 rows (+ scale bytes)
             per-tensor recipes: every expert's amax agreed first (one MAX all-reduce of E values per weight update,
             shared with the linear layers' amaxes), so every rank keeps every expert's scaling state equal
    FSDP2:   one all-gather of the bytes of every parameter of the group
    all:       fsdp_post_all_gather -> FP8GatheredExperts (E, ., .), the unsharded parameter: the gathered bytes
    experts: GroupedScaling.weight_operands() sees ``fp8_expert_operands`` and uses the gathered casts

The gathered weight holds the gathered buffer and the pack's metadata only; the experts' operands are unpacked from
the buffer at each use. The grouped GEMM saves the weight itself for backward (``fp8_regathered_for_backward``), not
its operands: FSDP2 frees the buffer on reshard after forward and re-fills it (same bytes) before backward, which then
makes the operands again, so between forward and backward a layer holds nothing of its gathered experts.

The gathered weight follows the transposes the experts' forward applies (``weight.transpose(-2, -1)``); any other
operation sees its dequantized value.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from fp8_lightning.distributed.weight import FP8ShardedWeight, aten
from fp8_lightning.ops.dispatch import dequantize_operand
from fp8_lightning.privates import local_shard
from fp8_lightning.recipes import Recipe
from fp8_lightning.scaling import records_amax

# Ops through which a gathered expert weight stays FP8 (FSDP2 re-views it; the forward transposes it).
_KEEP_GATHERED = {aten.detach.default, aten.alias.default, aten.view.default, aten.as_strided.default,
                  aten._unsafe_view.default, aten.transpose.int}  # fmt: skip


def experts_gather_unsupported_reason(shape: torch.Size | tuple, stored_kn: bool, world_size: int,
                                      recipe: Recipe) -> str | None:  # fmt: skip
    """Why a fused (E, N, K) expert weight (``stored_kn``: stored (E, K, N)) cannot be gathered in FP8 over
    ``world_size`` ranks (None when it can)."""
    if len(shape) != 3:
        return f"weight has {len(shape)} dimensions; the experts' FP8 all-gather handles 3-D fused expert weights"
    experts, n, k = (shape[0], shape[2], shape[1]) if stored_kn else tuple(shape)
    return recipe.fsdp_experts_unsupported_reason(experts, n, k, world_size)


class FP8ShardedExperts(FP8ShardedWeight):
    """This rank's experts of the fused projection ``projection`` (high precision), all-gathered in FP8."""

    _projection: str

    @staticmethod
    def __new__(cls, hp: torch.Tensor, amax_sync: Any, projection: str):
        return FP8ShardedWeight.__new__(cls, hp, amax_sync)

    def __init__(self, hp: torch.Tensor, amax_sync: Any, projection: str):
        super().__init__(hp, amax_sync)
        self._projection = projection

    def __repr__(self) -> str:
        return f"FP8ShardedExperts({self._projection}, {self._hp!r})"

    def rewrap(self, hp: torch.Tensor) -> "FP8ShardedExperts":
        return FP8ShardedExperts(hp, self._amax_sync, self._projection)

    def __tensor_flatten__(self):
        return ["_hp"], (self._amax_sync, self._projection)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return FP8ShardedExperts(inner["_hp"], *meta)

    # -- FSDP2 extension ------------------------------------------------------------------------------------

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """Cast this rank's experts with the recipe's per-expert rules (``Recipe.fsdp_experts_pack``)."""
        if tuple(outer_size[1:]) != tuple(self.shape[1:]):
            raise RuntimeError(
                f"FP8 all-gather of {self._projection}: FSDP2 shards it along a dimension other than the experts "
                f"(unsharded {tuple(outer_size)}, shard {tuple(self.shape)}); shard fused expert weights along "
                "dimension 0 (FSDP2's default placement), or call disable_fp8_all_gather before fully_shard."
            )
        recipe, name = module.fp8_recipe, self._projection
        dim = mesh.ndim - 1  # the shard dimension is the mesh's last one (of an HSDP mesh too)
        group = mesh.get_group(dim)
        shard = self._hp.transpose(1, 2) if module.fp8_weights[name] else self._hp  # (E_local, N, K)
        first = mesh.get_local_rank(dim) * shard.shape[0]
        agreed_amax = lambda: self._amax_sync.global_amax(module, group, name)  # noqa: E731
        scaling = module.fp8_scaling(recipe).parts[name]
        packed, meta = recipe.fsdp_experts_pack(shard, scaling, first, records_amax(module.training), agreed_amax)
        stored_kn = module.fp8_weights[name]
        return (packed,), (recipe, meta, stored_kn)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        """Wrap the gathered bytes (no copy) as the unsharded FP8 experts; refresh ``out`` on later gathers."""
        recipe, meta, stored_kn = metadata
        (gathered,) = outputs
        rows, cols = self.shape[1:]
        n, k = (cols, rows) if stored_kn else (rows, cols)
        experts = gathered.shape[0] // n
        if out is not None:
            out = local_shard(out)
            if not isinstance(out, FP8GatheredExperts):
                raise TypeError(
                    f"fsdp_post_all_gather(out=...) expects an FP8GatheredExperts; got {type(out).__name__}."
                )
            if out._buffer.untyped_storage().data_ptr() != gathered.untyped_storage().data_ptr():
                raise RuntimeError("FP8 all-gather: FSDP2 refilled a different buffer than the one the experts view.")
            out._meta, out._buffer = meta, gathered
            return None
        shape = (experts, *self.shape[1:])
        return FP8GatheredExperts(gathered, recipe, meta, param_dtype, shape, stored_kn, False), (gathered,)


class FP8GatheredExperts(torch.Tensor):
    """The unsharded fused expert weight as each expert's FP8 operand, with the weight's shape and dtype.

    ``stored_kn``: the parameter is stored (E, K, N); ``flipped``: this view has its last two dimensions swapped
    from the stored ones. The experts consume it through :meth:`fp8_expert_operands`; any other op sees the
    dequantized weight. It holds the gathered bytes ``buffer`` and the pack's ``meta`` only (every view shares the
    buffer, which FSDP2 frees on reshard and re-fills in place).
    """

    _buffer: torch.Tensor

    @staticmethod
    def __new__(cls, buffer, recipe, meta, dtype, stored_shape, stored_kn, flipped):
        e, a, b = stored_shape
        shape, strides = ((e, b, a), (a * b, 1, b)) if flipped else ((e, a, b), (a * b, b, 1))
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=strides, dtype=dtype, device=buffer.device, requires_grad=False
        )

    def __init__(self, buffer, recipe, meta, dtype, stored_shape, stored_kn, flipped):
        self._buffer, self._recipe, self._meta = buffer, recipe, meta
        self._stored_shape, self._stored_kn, self._flipped = tuple(stored_shape), stored_kn, flipped

    def __repr__(self) -> str:
        recipe = type(self._recipe).__name__
        return f"FP8GatheredExperts(shape={tuple(self.shape)}, recipe={recipe}, dtype={self.dtype})"

    def _view(self, flipped: bool) -> "FP8GatheredExperts":
        return FP8GatheredExperts(self._buffer, self._recipe, self._meta, self.dtype, self._stored_shape,
                                  self._stored_kn, flipped)  # fmt: skip

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _KEEP_GATHERED and isinstance(args[0], cls):
            w = args[0]
            if func is aten.transpose.int and {d % 3 for d in args[1:3]} == {1, 2}:
                return w._view(not w._flipped)
            if func is not aten.transpose.int and (len(args) < 2 or tuple(args[1]) == tuple(w.shape)):
                return w._view(w._flipped)  # detach, alias, or FSDP2 re-viewing the unsharded tensor as itself
        plain_args, plain_kwargs = pytree.tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs))
        return func(*plain_args, **plain_kwargs)

    def __tensor_flatten__(self):
        return ["_buffer"], (self._recipe, self._meta, self.dtype, self._stored_shape, self._stored_kn, self._flipped)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        recipe, recipe_meta, dtype, stored_shape, stored_kn, flipped = meta
        return FP8GatheredExperts(inner["_buffer"], recipe, recipe_meta, dtype, stored_shape, stored_kn, flipped)

    @property
    def _as_experts_nk(self) -> bool:
        """Whether this view is (E, N, K): each ``self[e]`` is expert ``e``'s weight as a linear layer holds it."""
        return self._stored_kn == self._flipped

    def _unpacked(self) -> list:
        """Each expert's fprop operand, unpacked from the gathered buffer (views of it where the recipe can)."""
        if self._buffer.untyped_storage().nbytes() == 0:
            raise RuntimeError(
                f"FP8GatheredExperts of shape {tuple(self.shape)}: its gathered buffer was freed (FSDP2 resharded the "
                "module) and not gathered again; use the weight inside the module's forward or backward, or call "
                "module.unshard() first."
            )
        e, a, b = self._stored_shape
        n, k = (b, a) if self._stored_kn else (a, b)
        return self._recipe.fsdp_experts_unpack(self._buffer, e, n, k, self._meta)

    @property
    def _q(self) -> list:
        """Each expert's fprop operand (unpacked at each read)."""
        return self._unpacked()

    def dequantize(self) -> torch.Tensor:
        """The weight's value as gathered (FP8-rounded), in the weight's dtype and this view's layout."""
        values = torch.stack([dequantize_operand(q, self.dtype) for q in self._unpacked()])  # (E, N, K)
        return values if self._as_experts_nk else values.transpose(1, 2)

    def fp8_expert_operands(self, scaling, record: bool):
        """What ``Recipe.grouped_weight_operands`` returns, for ``scaling`` (a GroupedScaling), from the gathered
        casts; under another recipe (an ``fp8_autocast(recipe=...)`` override) the gathered value is cast afresh."""
        if not self._as_experts_nk:
            raise RuntimeError(
                f"FP8GatheredExperts of shape {tuple(self.shape)}: the grouped GEMM takes the (E, N, K) view (each "
                "expert's (out, in) weight); transpose the last two dimensions first."
            )
        if scaling.recipe != self._recipe:
            values = self.dequantize().float()
            return scaling.recipe.grouped_weight_operands(values, scaling.forward_dtype, scaling.expert_states, record)
        return self._recipe.fsdp_experts_operands(self._unpacked(), scaling, self._meta, record)

    def fp8_regathered_for_backward(self, scaling) -> bool:
        """Whether backward can make this weight's operands for ``scaling`` again, bit for bit, from the buffer FSDP2
        re-gathers for it (the gathered recipe's own operands; an override's casts are kept from the forward)."""
        return scaling.recipe == self._recipe


__all__ = ["FP8GatheredExperts", "FP8ShardedExperts", "experts_gather_unsupported_reason"]
