"""FP8 parameter all-gather for FSDP2: two tensor subclasses and the FSDP2 extension hooks between them.

Sharded training gathers every weight before its layer runs (and again for backward). Gathering the weight in
FP8 moves 1 byte per element instead of 2 (bf16) or 4 (fp32). The mechanism is FSDP2's all-gather extension:
when a sharded parameter's local tensor defines ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``, FSDP2 sends
what the first returns and hands the gathered buffers to the second::

    rank r:  FP8ShardedWeight (high-precision shard, N/world x K)
               fsdp_pre_all_gather  -> quantize the shard -> uint8 bytes (MX: + E8M0 block scales, same rows)
    FSDP2:   one all-gather of the bytes of every parameter of the group
    all:       fsdp_post_all_gather -> FP8GatheredWeight (N x K, FP8 data + scale), the unsharded parameter
    FP8Linear: LayerScaling.weight_operands() sees ``fp8_weight_operands`` and uses the FP8 data as is

The design in full: ``docs/design/notes.md``, section ``fp8_lightning.distributed.weight``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from fp8_lightning.ops.dispatch import dequantize_operand
from fp8_lightning.privates import local_shard
from fp8_lightning.quantize import OperandCache, Quantized
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
        q = recipe.fsdp_unpack(gathered, self._hp.shape[0], self.shape[-1], meta)
        if out is not None:
            out = local_shard(out)  # under tensor parallelism FSDP2 refills the local part of a DTensor
            if not isinstance(out, FP8GatheredWeight):
                raise TypeError(
                    f"fsdp_post_all_gather(out=...) expects an FP8GatheredWeight; got {type(out).__name__}."
                )
            if out._q.data.untyped_storage().data_ptr() != q.data.untyped_storage().data_ptr():
                raise RuntimeError("FP8 all-gather: FSDP2 refilled a different buffer than the one the weight views.")
            out._q, out._meta = q, meta
            return None
        gathered = FP8GatheredWeight(q, recipe, meta, param_dtype, (q.data.shape[0], self.shape[-1]))
        return gathered, tuple(outputs)


# --------------------------------------------------------------------------------------------------------
# The gathered FP8 weight (the unsharded parameter during forward/backward)
# --------------------------------------------------------------------------------------------------------


class FP8GatheredWeight(torch.Tensor):
    """The unsharded weight as FP8 data + scale(s), with the shape and (high-precision) dtype of the weight.

    :class:`~fp8_lightning.linear.FP8Linear` consumes it through :meth:`fp8_weight_operands`; any other op
    sees the dequantized weight.
    """

    _q: Quantized
    _recipe: Recipe
    _meta: Any  # what the recipe's fsdp_pack sent beside the bytes (per-tensor: the scale and the agreed amax)

    @staticmethod
    def __new__(cls, q: Quantized, recipe: Recipe, meta: Any, dtype: torch.dtype, shape: tuple | None = None):
        if shape is None or tuple(shape) == tuple(q.data.shape):
            return torch.Tensor._make_wrapper_subclass(
                cls, q.data.size(), strides=q.data.stride(), dtype=dtype, device=q.data.device, requires_grad=False
            )
        # codes narrower than the weight (NVFP4 packs two per byte): the weight's shape, contiguous strides
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=q.data.device, requires_grad=False)

    def __init__(self, q: Quantized, recipe: Recipe, meta: Any, dtype: torch.dtype, shape: tuple | None = None):
        self._q, self._recipe, self._meta = q, recipe, meta

    def __repr__(self) -> str:
        return f"FP8GatheredWeight(shape={tuple(self.shape)}, kind={self._q.kind}, dtype={self.dtype})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _KEEP_GATHERED and isinstance(args[0], cls):
            w = args[0]
            if func in (aten.as_strided.default, aten.view.default) and tuple(args[1]) == tuple(w.shape):
                return cls(w._q, w._recipe, w._meta, w.dtype, w.shape)  # FSDP2 re-views the weight as itself
            if func in (aten.detach.default, aten.alias.default):
                return cls(w._q, w._recipe, w._meta, w.dtype, w.shape)
            data = func(w._q.data, *args[1:], **kwargs)
            if data.shape != w._q.data.shape:
                raise NotImplementedError(f"{func} would reshape an FP8-gathered weight; dequantize it first.")
            kept = OperandCache(native=w._q.cache.native)  # a view of the same codes: its GEMM scales still hold
            return cls(Quantized(data, w._q.scale, w._q.kind, kept), w._recipe, w._meta, w.dtype)
        plain_args, plain_kwargs = pytree.tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs))
        return func(*plain_args, **plain_kwargs)

    def __tensor_flatten__(self):
        native = ["_native"] if self._q.cache.native is not None else []  # NVFP4's GEMM scales travel too
        return ["_data", "_scale", *native], (self._q.kind, self._recipe, self._meta, self.dtype)

    @property
    def _data(self) -> torch.Tensor:
        return self._q.data

    @property
    def _scale(self) -> torch.Tensor:
        return self._q.scale

    @property
    def _native(self) -> torch.Tensor | None:
        return self._q.cache.native

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        kind, recipe, recipe_meta, dtype = meta
        q = Quantized(inner["_data"], inner["_scale"], kind, OperandCache(native=inner.get("_native")))
        return FP8GatheredWeight(q, recipe, recipe_meta, dtype, tuple(outer_size))

    def dequantize(self) -> torch.Tensor:
        """The weight's value as gathered (FP8-rounded), in the weight's dtype."""
        return dequantize_operand(self._q, self.dtype)

    def fp8_weight_operands(self, scaling, record: bool) -> tuple[Quantized, Quantized | None]:
        """(rowwise W, columnwise W for MX) for ``scaling`` (a LayerScaling) without quantizing W again.

        Under another recipe (an ``fp8_autocast(recipe=...)`` override) the gathered value is cast afresh.
        """
        recipe = scaling.recipe
        if recipe != self._recipe:
            w = dequantize_operand(self._q, torch.float32)
            return scaling.cast("weight", w, record, columnwise=True)
        return recipe.fsdp_operands(self._q, scaling, self._meta, record)
