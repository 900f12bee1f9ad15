"""FP8 parameter all-gather for FSDP2: two tensor subclasses and the FSDP2 extension hooks between them.

Sharded training gathers every weight before its layer runs (and again for backward). Gathering the weight in
FP8 moves 1 byte per element instead of 2 (bf16) or 4 (fp32). The mechanism is FSDP2's all-gather extension:
when a sharded parameter's local tensor defines ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``, FSDP2 sends
what the first returns and hands the gathered buffers to the second::

    rank r:  FP8ShardedWeight (high-precision shard, N/world x K)
               fsdp_pre_all_gather  -> quantize the shard -> uint8 bytes (MX: + E8M0 block scales, same rows)
    FSDP2:   one all-gather of the bytes of every parameter of the group
    all:       fsdp_post_all_gather -> FP8GatheredWeight (N x K), the unsharded parameter: the gathered bytes
    FP8Linear: LayerScaling.weight_operands() sees ``fp8_weight_operands`` and uses the FP8 data as is

The gathered weight holds the gathered buffer and the pack's metadata only; its operand is unpacked at each use. The
layer saves the weight itself for backward (``fp8_regathered_for_backward``), not W.T's operand: FSDP2 frees the
buffer on reshard after forward and re-fills it (same bytes) before backward, which makes W.T again from it
(``fp8_dgrad_operand``), so between forward and backward a layer holds nothing of its gathered weight.

The design in full: ``docs/design/notes.md``, section ``fp8_lightning.distributed.weight``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from fp8_lightning.ops.dispatch import dequantize_operand
from fp8_lightning.privates import local_shard
from fp8_lightning.quantize import Quantized
from fp8_lightning.recipes import Recipe

aten = torch.ops.aten

# Ops through which the sharded weight stays a sharded weight (FSDP2 builds shards, pads and copies with them).
_KEEP_SHARDED = {
    aten.detach.default,
    aten.alias.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.as_strided.default,
    aten.slice.Tensor,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.chunk.default,
    aten.narrow.default,
    aten.clone.default,
    aten.empty_like.default,
    aten.new_zeros.default,
    aten.new_empty.default,
    aten.copy_.default,
    aten._pin_memory.default,
}

# Ops through which a gathered weight stays FP8 (FSDP2 re-views it into the unsharded parameter).
_KEEP_GATHERED = {aten.detach.default, aten.alias.default, aten.view.default, aten.as_strided.default}


def fp8_all_gather_unsupported_reason(shape: torch.Size | tuple, world_size: int, recipe: Recipe) -> str | None:
    """Why a weight of ``shape`` cannot be gathered in FP8 over ``world_size`` ranks (None when it can)."""
    if len(shape) != 2:
        return f"weight has {len(shape)} dimensions; FP8 all-gather handles 2-D Linear weights"
    rows, cols = shape
    if rows % world_size:
        return f"out_features={rows} is not divisible by the shard world size {world_size} (uneven shards)"
    return recipe.fsdp_unsupported_reason(rows, cols, world_size)


def fit_gather_to_split(layer: Any) -> None:
    """After tensor parallelism split ``layer``'s weight (a DTensor): keep the FP8 all-gather of this rank's part
    only where the part's FSDP2 shards suit the layer's recipe; otherwise the part gathers in high precision, and
    the reason is kept on the layer (``fp8_gather_refused``) for the strategy's report."""
    from torch.distributed.tensor import DTensor

    weight = layer.weight
    part = local_shard(weight)
    if not (isinstance(weight, DTensor) and isinstance(part, FP8ShardedWeight)):
        return
    reason = fp8_all_gather_unsupported_reason(part.shape, part._amax_sync.world_size, layer.fp8_recipe)
    if reason is None:
        return
    plain = DTensor.from_local(part._hp, weight.device_mesh, weight.placements, run_check=False,
                               shape=weight.shape, stride=weight.stride())  # fmt: skip
    layer.weight = torch.nn.Parameter(plain, requires_grad=weight.requires_grad)
    layer.fp8_gather_refused = f"its part under tensor parallelism: {reason}"


# --------------------------------------------------------------------------------------------------------
# The sharded high-precision weight
# --------------------------------------------------------------------------------------------------------


class FP8ShardedWeight(torch.Tensor):
    """A high-precision weight (or its FSDP2 shard) that all-gathers in FP8. Behaves as the tensor it wraps.

    ``amax_sync`` is the model's :class:`~fp8_lightning.distributed.amax.WeightAmaxSync`.
    """

    _hp: torch.Tensor
    _amax_sync: Any

    @staticmethod
    def __new__(cls, hp: torch.Tensor, amax_sync: Any):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            hp.size(),
            strides=hp.stride(),
            storage_offset=hp.storage_offset(),
            dtype=hp.dtype,
            layout=hp.layout,
            device=hp.device,
            requires_grad=hp.requires_grad,
        )

    def __init__(self, hp: torch.Tensor, amax_sync: Any):
        self._hp = hp
        self._amax_sync = amax_sync

    def __repr__(self) -> str:
        return f"FP8ShardedWeight({self._hp!r})"

    def __reduce_ex__(self, protocol):
        """Pickles (torch.save, distributed checkpoints) as the plain high-precision tensor."""
        return self._hp.detach().clone().__reduce_ex__(protocol)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, cls))
        plain_args, plain_kwargs = pytree.tree_map_only(cls, lambda t: t._hp, (args, kwargs))
        out = func(*plain_args, **plain_kwargs)
        if func not in _KEEP_SHARDED:
            return out
        if func._schema.is_mutable:  # in place (copy_): the wrapper itself is the result
            return args[0]
        return pytree.tree_map_only(torch.Tensor, first.rewrap, out)

    def rewrap(self, hp: torch.Tensor) -> "FP8ShardedWeight":
        """``hp`` (a view or copy of this shard) wrapped as this weight is."""
        return type(self)(hp, self._amax_sync)

    def __tensor_flatten__(self):
        return ["_hp"], self._amax_sync

    @staticmethod
    def __tensor_unflatten__(inner, amax_sync, outer_size, outer_stride):
        return FP8ShardedWeight(inner["_hp"], amax_sync)

    # -- FSDP2 extension ------------------------------------------------------------------------------------

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """Quantize this rank's shard (the recipe's ``fsdp_pack``); return (all-gather inputs as uint8, metadata for
        post-all-gather)."""
        recipe = module.fp8_recipe
        # the shard dimension is the mesh's last one (of an HSDP mesh too)
        agreed_amax = lambda: self._amax_sync.global_amax(module, mesh.get_group(mesh.ndim - 1))  # noqa: E731
        packed, meta = recipe.fsdp_pack(self._hp, module, agreed_amax)
        return (packed,), (recipe, meta)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        """Wrap the gathered bytes (no copy) as the unsharded FP8 weight; refresh ``out`` on later gathers."""
        recipe, meta = metadata
        (gathered,) = outputs
        rows, k = self._hp.shape[0], self.shape[-1]
        if out is not None:
            out = local_shard(out)  # under tensor parallelism FSDP2 refills the local part of a DTensor
            if not isinstance(out, FP8GatheredWeight):
                raise TypeError(
                    f"fsdp_post_all_gather(out=...) expects an FP8GatheredWeight; got {type(out).__name__}."
                )
            if out._buffer.untyped_storage().data_ptr() != gathered.untyped_storage().data_ptr():
                raise RuntimeError("FP8 all-gather: FSDP2 refilled a different buffer than the one the weight views.")
            out._buffer, out._meta = gathered, meta
            return None
        q = recipe.fsdp_unpack(gathered, rows, k, meta)
        gathered_weight = FP8GatheredWeight(gathered, recipe, meta, param_dtype, (q.data.shape[0], k), rows)
        return gathered_weight, tuple(outputs)


# --------------------------------------------------------------------------------------------------------
# The gathered FP8 weight (the unsharded parameter during forward/backward)
# --------------------------------------------------------------------------------------------------------


class FP8GatheredWeight(torch.Tensor):
    """The unsharded weight as gathered FP8 bytes, with the shape and (high-precision) dtype of the weight.

    It holds the gathered buffer and the pack's metadata only: the FP8 operand (``_q``) is unpacked from the buffer
    at each use, so nothing derived from it (a float32 form, a dense copy of the scales) outlives that use. FSDP2
    frees the buffer on reshard after forward and re-fills it (same bytes) before backward, where the layer makes
    W.T's operand again (:meth:`fp8_dgrad_operand`). :class:`~fp8_lightning.linear.FP8Linear` consumes it through
    :meth:`fp8_weight_operands`; any other op sees the dequantized weight.
    """

    _buffer: torch.Tensor  # the all-gather output: every shard's packed bytes
    _recipe: Recipe
    _meta: Any  # what the recipe's fsdp_pack sent beside the bytes (per-tensor: the scale and the agreed amax)

    @staticmethod
    def __new__(cls, buffer: torch.Tensor, recipe: Recipe, meta: Any, dtype: torch.dtype, shape: tuple,
                shard_rows: int):  # fmt: skip
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=buffer.device, requires_grad=False)

    def __init__(self, buffer: torch.Tensor, recipe: Recipe, meta: Any, dtype: torch.dtype, shape: tuple,
                 shard_rows: int):  # fmt: skip
        self._buffer, self._recipe, self._meta, self._shard_rows = buffer, recipe, meta, shard_rows

    def __repr__(self) -> str:
        return f"FP8GatheredWeight(shape={tuple(self.shape)}, recipe={type(self._recipe).__name__}, dtype={self.dtype})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _KEEP_GATHERED and isinstance(args[0], cls):
            w = args[0]
            if func in (aten.detach.default, aten.alias.default) or tuple(args[1]) == tuple(w.shape):
                return w._same()  # FSDP2 re-views the weight as itself
            raise NotImplementedError(f"{func} would reshape an FP8-gathered weight; dequantize it first.")
        plain_args, plain_kwargs = pytree.tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs))
        return func(*plain_args, **plain_kwargs)

    def _same(self) -> "FP8GatheredWeight":
        """Another wrapper of the same buffer and metadata (a view of the whole weight)."""
        shape = tuple(self.shape)
        return FP8GatheredWeight(self._buffer, self._recipe, self._meta, self.dtype, shape, self._shard_rows)

    def __tensor_flatten__(self):
        return ["_buffer"], (self._recipe, self._meta, self.dtype, self._shard_rows)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        recipe, recipe_meta, dtype, shard_rows = meta
        return FP8GatheredWeight(inner["_buffer"], recipe, recipe_meta, dtype, tuple(outer_size), shard_rows)

    @property
    def _q(self) -> Quantized:
        """The fprop operand, unpacked from the gathered buffer at each read (views of it where the recipe can)."""
        if self._buffer.untyped_storage().nbytes() == 0:
            raise RuntimeError(
                f"FP8GatheredWeight of shape {tuple(self.shape)}: its gathered buffer was freed (FSDP2 resharded the "
                "module) and not gathered again; use the weight inside the module's forward or backward, or call "
                "module.unshard() first."
            )
        return self._recipe.fsdp_unpack(self._buffer, self._shard_rows, self.shape[-1], self._meta)

    def dequantize(self) -> torch.Tensor:
        """The weight's value as gathered (FP8-rounded), in the weight's dtype."""
        return dequantize_operand(self._q, self.dtype)

    def fp8_weight_operands(self, scaling, record: bool, columnwise: bool = True) -> tuple[Quantized, Quantized | None]:
        """(rowwise W, columnwise W for MX) for ``scaling`` (a LayerScaling) without quantizing W again; without
        ``columnwise`` the second is None under the gathered recipe (backward makes it again from the re-gathered
        buffer: :meth:`fp8_dgrad_operand`).

        Under another recipe (an ``fp8_autocast(recipe=...)`` override) the gathered value is cast afresh.
        """
        recipe = scaling.recipe
        if recipe != self._recipe:
            w = dequantize_operand(self._q, torch.float32)
            return scaling.cast("weight", w, record, columnwise=True)
        return recipe.fsdp_operands(self._q, scaling, self._meta, record, columnwise)

    def fp8_regathered_for_backward(self, scaling) -> bool:
        """Whether backward can make W.T's operand for ``scaling`` again, bit for bit, from the buffer FSDP2
        re-gathers (:meth:`fp8_dgrad_operand`): under the gathered recipe; an override's casts are kept from the
        forward."""
        return scaling.recipe == self._recipe

    def fp8_dgrad_operand(self, scaling) -> Quantized:
        """W.T's operand (dgrad's) as the forward's :meth:`fp8_weight_operands` made it, from the gathered bytes as
        they are now (re-gathered for backward), booking nothing."""
        recipe = self._recipe
        return recipe.transposed(*recipe.fsdp_operands(self._q, scaling, self._meta, False))
