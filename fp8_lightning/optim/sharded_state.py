"""FP8 optimizer states of sharded (DTensor) parameters in distributed checkpoints.

:class:`~fp8_lightning.optim.optimizer.FP8Optimizer` keeps the states of an FSDP2 parameter for its local shard only,
as plain tensors (FP8 codes, block scales, remainders: their own layouts, not the parameter's). Saved as they are,
``torch.distributed.checkpoint`` takes a plain tensor for a replicated one and writes a single copy: a sharded
resume would give every rank rank 0's states. So ``state_dict`` hands out each per-shard state tensor as a DTensor
over the parameter's mesh, sharded along its first dimension on every mesh dimension the parameter is sharded on
(replicated on the others): each rank's tensor is saved as its own chunk and loaded back into the same rank, and
``load_state_dict`` takes the local tensors back. The layout is the same at save and at load (same mesh, same
placements), which is all a resume needs; it is not the parameter's layout, so a resume on another world size is
not supported. Unevenly sharded parameters (whose chunks would not follow ``torch.chunk``) keep plain tensors.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch

_PER_PARAMETER = ("step", "shape")  # the same on every rank (for evenly sharded parameters): saved once


def _placements_for(param: torch.Tensor) -> list | None:
    """The placements of a state of ``param``'s local shard, or None where ``param`` is no evenly sharded DTensor."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(param, DTensor):
        return None
    mesh, placements = param.device_mesh, param.placements
    shards = [mesh.size(i) for i, p in enumerate(placements) if p.is_shard()]
    if not shards or param.to_local().numel() * math.prod(shards) != param.numel():
        return None
    return [Shard(0) if p.is_shard() else Replicate() for p in placements]


def shard_state_dict(state_dict: dict[str, Any], param_groups: list[dict]) -> dict[str, Any]:
    """``state_dict`` (a torch optimizer state dict, state keyed by parameter index) with the per-shard state tensors
    of sharded parameters as DTensors (see the module docstring)."""
    from torch.distributed.tensor import DTensor

    params = list(itertools.chain.from_iterable(g["params"] for g in param_groups))
    for index, state in state_dict["state"].items():
        param = params[index] if isinstance(index, int) and index < len(params) else None
        placements = None if param is None else _placements_for(param)
        if placements is None:
            continue
        state_dict["state"][index] = {
            key: value if key in _PER_PARAMETER or not torch.is_tensor(value) or value.dim() == 0
            else DTensor.from_local(value, param.device_mesh, placements, run_check=False)
            for key, value in state.items()
        }  # fmt: skip
    return state_dict


def local_state(value: Any) -> Any:
    """A saved state value as this rank's tensor: the local part of a DTensor, else the value itself."""
    to_local = getattr(value, "to_local", None)
    return to_local() if callable(to_local) else value


__all__ = ["local_state", "shard_state_dict"]
