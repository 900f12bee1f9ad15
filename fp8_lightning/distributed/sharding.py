"""Preparing an FP8 model for FSDP2: FP8 all-gather weights, a default sharding policy, activation checkpointing.

Order matters, because FSDP2 reads a parameter's type when ``fully_shard`` runs::

    convert_to_fp8(model, recipe)             # nn.Linear -> FP8Linear (in place)
    enable_fp8_all_gather(model, world_size)  # FP8Linear weights -> FP8ShardedWeight (still unsharded)
    shard_model(model, mesh=...)              # activation checkpointing (optional), then fully_shard per block

Usable without Lightning; :class:`~fp8_lightning.lightning.fsdp.FP8FSDPStrategy` runs the same three steps.

The default policy shards every child of every ``nn.ModuleList`` (the transformer-block convention), or the
modules whose class name is listed in ``block_classes``, and finally the root, which takes whatever parameters
are left (embeddings, final norm, head). A block is the unit of all-gather and of activation checkpointing.

Activation checkpointing recomputes a block's forward during backward, outside the ``fp8_autocast`` context the
forward ran in; the converted layers replay the FP8 setting of their forward there (:mod:`fp8_lightning.recompute`),
and :func:`~fp8_lightning.recompute.fp8_checkpoint_context` carries each block's setting with the call.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import torch.nn as nn

from fp8_lightning.conv1d import FP8Conv1D
from fp8_lightning.convert import fp8_expert_modules, fp8_modules
from fp8_lightning.distributed.amax import WeightAmaxSync
from fp8_lightning.distributed.expert_weight import FP8ShardedExperts, experts_gather_unsupported_reason
from fp8_lightning.linear import GATHERED_IN_FP8
from fp8_lightning.distributed.weight import FP8ShardedWeight, fp8_all_gather_unsupported_reason
from fp8_lightning.privates import local_shard
from fp8_lightning.recompute import fp8_checkpoint_context

AMAX_SYNC_ATTR = "_fp8_amax_sync"


@dataclasses.dataclass
class AllGatherReport:
    """Which FP8 layers gather their weight in FP8, and why the others gather in high precision."""

    fp8: list[str] = dataclasses.field(default_factory=list)
    high_precision: dict[str, str] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"FP8 all-gather: {len(self.fp8)} weight(s) in FP8, {len(self.high_precision)} in high precision"]
        lines += [f"  {name}: {reason}" for name, reason in self.high_precision.items()]
        return "\n".join(lines)


CONV1D_GATHER_REASON = "weight stored (in, out) (transformers Conv1D); FP8 all-gather needs (out, in)"
EXPERTS_GATHER_REASON = "fused 3-D expert weights gathered in high precision, cast to FP8 per expert after the gather"


def enable_fp8_all_gather(model: nn.Module, world_size: int) -> AllGatherReport:
    """Make the weight of every FP8Linear and every fused expert weight of ``model`` gather in FP8 under FSDP2
    (expert weights are named ``"<module>.<projection>"`` in the report). Call before ``fully_shard`` (and,
    with tensor parallelism, before ``parallelize_module``: the FP8 styles keep the wrapper in each rank's part where
    its shards suit the recipe).

    Idempotent. ``world_size`` is the size of the shard group (shards must be even).
    """
    from torch.distributed.tensor import DTensor

    sync = getattr(model, AMAX_SYNC_ATTR, None)
    if sync is None:
        sync = WeightAmaxSync(model)
        object.__setattr__(model, AMAX_SYNC_ATTR, sync)
    sync.world_size = world_size
    report = AllGatherReport()
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    for name, layer in fp8_modules(model):
        weight = layer.weight
        if uses.get(id(weight), 0) > 1:
            report.high_precision[name] = "weight is tied to another module's parameter (e.g. an embedding)"
            continue
        if isinstance(layer, FP8Conv1D):  # shards would split K, the reduction dimension, not N
            report.high_precision[name] = CONV1D_GATHER_REASON
            continue
        local = local_shard(weight) if isinstance(weight, DTensor) else weight
        if isinstance(local, FP8ShardedWeight):
            setattr(layer, GATHERED_IN_FP8, True)
            report.fp8.append(name)
            continue
        if isinstance(weight, DTensor):
            report.high_precision[name] = getattr(layer, "fp8_gather_refused", None) or (
                "sharded before FP8 all-gather was enabled (convert before sharding)")
            continue
        reason = fp8_all_gather_unsupported_reason(weight.shape, world_size, layer.fp8_recipe)
        if reason is not None:
            report.high_precision[name] = reason
            continue
        wrapped = FP8ShardedWeight(weight.detach(), sync)
        layer.weight = nn.Parameter(wrapped, requires_grad=weight.requires_grad)
        setattr(layer, GATHERED_IN_FP8, True)
        report.fp8.append(name)
    for name, experts in fp8_expert_modules(model):
        for projection, stored_kn in experts.fp8_weights.items():
            where, weight = f"{name}.{projection}", getattr(experts, projection)
            reason = _experts_refusal(weight, stored_kn, world_size, experts, uses)
            if reason is None and not isinstance(weight, (DTensor, FP8ShardedExperts)):  # not yet wrapped
                wrapped = FP8ShardedExperts(weight.detach(), sync, projection)
                setattr(experts, projection, nn.Parameter(wrapped, requires_grad=weight.requires_grad))
            if reason is None:
                setattr(experts, GATHERED_IN_FP8, True)
                report.fp8.append(where)
            else:
                report.high_precision[where] = f"{EXPERTS_GATHER_REASON}: {reason}"
    sync.unbind()  # re-bind at the next gather
    return report


def _experts_refusal(weight, stored_kn: bool, world_size: int, experts: nn.Module, uses: dict) -> str | None:
    """Why a fused expert weight stays in a high-precision all-gather, or None."""
    from torch.distributed.tensor import DTensor

    if uses.get(id(weight), 0) > 1:
        return "the weight is tied to another module's parameter"
    if isinstance(weight, DTensor):
        if isinstance(local_shard(weight), FP8ShardedExperts):
            return None
        return "sharded before FP8 all-gather was enabled (convert before sharding)"
    return experts_gather_unsupported_reason(weight.shape, stored_kn, world_size, experts.fp8_recipe)


def disable_fp8_all_gather(model: nn.Module, only_unsharded: bool = True) -> list[str]:
    """Turn FP8-gather weights that were never sharded back into plain parameters; returns their names."""
    restored = []
    for name, layer in fp8_modules(model):
        weight = layer.weight
        if isinstance(weight, FP8ShardedWeight):
            layer.weight = nn.Parameter(weight._hp.detach(), requires_grad=weight.requires_grad)
            layer.__dict__.pop(GATHERED_IN_FP8, None)
            restored.append(name)
    for name, experts in fp8_expert_modules(model):
        for projection in experts.fp8_weights:
            weight = getattr(experts, projection)
            if isinstance(weight, FP8ShardedWeight):
                setattr(experts, projection, nn.Parameter(weight._hp.detach(), requires_grad=weight.requires_grad))
                restored.append(f"{name}.{projection}")
        if not any(isinstance(getattr(experts, p), FP8ShardedWeight) for p in experts.fp8_weights):
            experts.__dict__.pop(GATHERED_IN_FP8, None)
    return restored


def is_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def default_shard_targets(model: nn.Module, block_classes: Iterable[str] | None = None) -> list[nn.Module]:
    """The blocks to shard one by one: modules of the named classes, else every child of every ModuleList."""
    names = set(block_classes or ())
    if names:
        targets = [m for m in model.modules() if type(m).__name__ in names]
    else:
        targets = [child for m in model.modules() if isinstance(m, nn.ModuleList) for child in m]
    return [m for m in targets if any(True for _ in m.parameters())]


def apply_activation_checkpointing(blocks: Sequence[nn.Module]) -> None:
    """Checkpoint each block (composable API: module names and state_dict keys are unchanged)."""
    from torch.distributed._composable import checkpoint

    for block in blocks:
        checkpoint(block, context_fn=fp8_checkpoint_context)


def shard_model(
    model: nn.Module,
    mesh=None,
    mp_policy=None,
    reshard_after_forward: bool = True,
    block_classes: Iterable[str] | None = None,
    activation_checkpointing: bool = False,
    roots: Sequence[nn.Module] | None = None,
) -> list[nn.Module]:
    """``fully_shard`` each block (see :func:`default_shard_targets`), then each module of ``roots``
    (``[model]`` by default). Returns the blocks."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = mp_policy or MixedPrecisionPolicy()
    blocks = default_shard_targets(model, block_classes)
    if block_classes and not blocks:
        raise ValueError(
            f"block_classes={sorted(block_classes)} matched no module with parameters; classes present: "
            f"{sorted({type(m).__name__ for m in model.modules()})}."
        )
    if activation_checkpointing:
        apply_activation_checkpointing(blocks)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    for root in roots if roots is not None else [model]:
        fully_shard(root, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    return blocks


def weight_amax_reductions(model: nn.Module) -> int:
    """How many amax all-reduces the model's FP8 all-gather issued so far."""
    sync = getattr(model, AMAX_SYNC_ATTR, None)
    return 0 if sync is None else sync.reductions


__all__ = [
    "AllGatherReport",
    "apply_activation_checkpointing",
    "default_shard_targets",
    "disable_fp8_all_gather",
    "enable_fp8_all_gather",
    "is_sharded",
    "shard_model",
    "weight_amax_reductions",
]

