"""One coalesced all-reduce per optimizer step for the whole-weight amaxes of FP8-gathered weights.

A per-tensor (tensorwise or delayed) FP8 weight has one scale, and every rank must quantize its shard with the
same one, computed from the amax of the *whole* weight. Reducing each weight's amax separately would add one
collective per layer; instead :class:`WeightAmaxSync` (one per model) computes the local amax of every
per-tensor weight shard, packs them into one vector and runs a single MAX all-reduce over the shard group (and a
second over the tensor-parallel group where the model has layers split by tensor parallelism).

It does this lazily, the first time any weight is gathered after a weight changed. "Changed" is read from the
version counters of the sharded parameters and of their local shards (an in-place update through the DTensor
bumps the first, one through the local shard, as optimizers that work per shard do, bumps the second), which
every optimizer update and checkpoint load moves; so it is once per
optimizer step, never per micro-batch or for the backward re-gather. Every rank gathers the same weights in the
same order, so every rank reaches the reduction at the same point. A NaN amax is sent as +inf so that MAX
propagates it (the scale logic then keeps the previous scale).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

from fp8_lightning.ops.dispatch import fast_amax
from fp8_lightning.convert import fp8_expert_modules
from fp8_lightning.distributed.expert_weight import FP8ShardedExperts
from fp8_lightning.distributed.weight import FP8ShardedWeight
from fp8_lightning.linear import FP8Linear
from fp8_lightning.privates import local_shard
from fp8_lightning.scaling import max_across


class WeightAmaxSync:
    """Agrees the amax of every per-tensor FP8-gathered weight of ``root`` in one all-reduce per weight update."""

    def __init__(self, root: nn.Module):
        self._root = weakref.ref(root)
        self._layers: list[nn.Module] | None = None
        self._keys: list[tuple[int, str]] = []  # (id(module), parameter name) of each weight
        self._params: list[torch.Tensor] = []  # the sharded parameters: their version counters see updates
        self._shards: list[torch.Tensor] = []
        self._key: tuple | None = None
        self._amax: dict[int, torch.Tensor] = {}
        self._tensor_parallel_group = None
        self.reductions = 0  # collectives issued (tests and benchmarks read it)
        self.world_size = 1  # the shard group's size (enable_fp8_all_gather sets it)

    def bind(self) -> None:
        """Find the per-tensor FP8-gathered weights of the model, in module order (identical on every rank): the
        linear layers' weights and the fused expert weights (one amax per expert)."""
        root = self._root()
        if root is None:
            raise RuntimeError("WeightAmaxSync: the model it was created for no longer exists.")
        layers, keys, params, shards = [], [], [], []
        candidates = [(name, m, "weight") for name, m in root.named_modules() if isinstance(m, FP8Linear)]
        candidates += [(name, m, p) for name, m in fp8_expert_modules(root) for p in m.fp8_weights]
        for name, module, param_name in candidates:
            if not module.fp8_recipe.global_weight_amax:
                continue
            param = getattr(module, param_name)
            shard = local_shard(param)
            if isinstance(shard, FP8ShardedWeight):
                layers.append(module)
                keys.append((id(module), param_name))
                params.append(param)
                shards.append(shard)
            elif type(shard).__name__ in ("FP8GatheredWeight", "FP8GatheredExperts"):
                raise RuntimeError(
                    f"WeightAmaxSync.bind: layer '{name}' is unsharded right now; bind between steps "
                    "(it binds itself at the first all-gather)."
                )
        self._layers, self._keys, self._params, self._shards, self._key = layers, keys, params, shards, None
        # a weight split by tensor parallelism has parts on the other ranks of its tensor-parallel group too: the
        # amaxes agreed over the shard group are then agreed over that group as well (a weight only sharded along
        # data parallelism is the same on its tensor-parallel peers, so the second reduction changes nothing for it)
        split = [m.fp8_tensor_parallel for m in layers if "fp8_tensor_parallel" in m.__dict__]
        self._tensor_parallel_group = split[0].group if split else None

    def unbind(self) -> None:
        """Forget the weights found by :meth:`bind` (the model's FP8-gathered weights changed): the next gather
        binds again."""
        self._layers = None

    def global_amax(self, layer: nn.Module, group: "dist.ProcessGroup | None", name: str = "weight") -> torch.Tensor:
        """The amax of ``layer``'s whole weight ``name``, agreed by all ranks of ``group`` (float32 scalar; for fused
        expert weights one per expert, (E,)), and by the tensor-parallel group where the model has split FP8
        layers."""
        if self._layers is None or (id(layer), name) not in self._keys:
            self.bind()
        key = tuple((p._version, s._version) for p, s in zip(self._params, self._shards))
        if key != self._key:
            local = torch.cat([_local_amaxes(s, group) for s in self._shards])
            local, reduced = max_across(local, group)
            self.reductions += reduced
            if self._tensor_parallel_group is not None:
                local, reduced = max_across(local, self._tensor_parallel_group)
                self.reductions += reduced
            sizes = [_amax_count(s, group) for s in self._shards]
            self._amax = {k: (part if isinstance(s, FP8ShardedExperts) else part[0])
                          for k, s, part in zip(self._keys, self._shards, local.split(sizes))}  # fmt: skip
            self._key = key
        return self._amax[(id(layer), name)]


def _amax_count(shard: FP8ShardedWeight, group) -> int:
    """How many amaxes a weight contributes: one, or one per expert of the whole fused weight."""
    if not isinstance(shard, FP8ShardedExperts):
        return 1
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    return shard._hp.shape[0] * world


def _local_amaxes(shard: FP8ShardedWeight, group) -> torch.Tensor:
    """This rank's part of a weight's amaxes: its shard's amax, or a vector over every expert of a fused weight
    holding this rank's experts' amaxes at their places and zeros elsewhere (the MAX over ranks fills them)."""
    if not isinstance(shard, FP8ShardedExperts):
        return fast_amax(shard._hp).reshape(1)
    local = shard._hp.detach().abs().amax(dim=(1, 2)).float()
    rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
    everyone = local.new_zeros(_amax_count(shard, group))
    everyone[rank * local.numel() : (rank + 1) * local.numel()] = local
    return everyone
