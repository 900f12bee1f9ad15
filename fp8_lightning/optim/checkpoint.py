"""FP8Optimizer state dicts: leaving FP8 (the plain torch optimizer's state dict) and sharded states saved per rank.

The FP8 state dict stores each state as it lives in memory (FP8 bytes plus block scales, FP16, remainders) with
the storage config next to it, so it can be decoded without the model: ``to_plain_state_dict`` decodes every
moment to float32 in the parameter's shape, keeps ``step`` and the parameter groups, and drops the FP8-only
entries. The result loads into ``torch.optim.AdamW`` (or Adam/SGD) built over the same parameters.

Master weights are not part of a torch optimizer's state: a float32 parameter already is its master; for bf16
parameters the master values are returned as float32 by :func:`master_parameters` (exact float32 values with
``master_weights="bf16_remainder"``, 16 significant bits with the default ``"bf16_int8_remainder"``) so the user
can load them into a float32 copy of the model.

Sharded parameters (FSDP2 DTensors) keep their states for the local shard as plain tensors in their own layouts.
Saved as they are, ``torch.distributed.checkpoint`` would take them for replicated tensors and write rank 0's only;
:func:`shard_state_dict` hands each out as a DTensor over the parameter's mesh, sharded along its first dimension
where the parameter is sharded (replicated elsewhere), so every rank's states are saved and load back into the same
rank (the same world size: a resume on another is not supported). Unevenly sharded parameters keep plain tensors.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch

from fp8_lightning.optim import master_weights as mw
from fp8_lightning.optim.config import FP8OptimizerConfig
from fp8_lightning.optim.state_formats import StateFormat, decode_state

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


def _formats(config: FP8OptimizerConfig, entry: dict, name: str) -> StateFormat:
    """The format a stored state was written in: a scale tensor next to it means the configured format."""
    if f"{name}_scale" in entry:
        return config.exp_avg_sq if name == "exp_avg_sq" else config.exp_avg
    if entry[name].dtype == torch.float32:
        return StateFormat("float32")
    return config.exp_avg_sq if name == "exp_avg_sq" else config.exp_avg


def to_plain_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A torch.optim state dict (float32 moments, parameter-shaped) from an FP8Optimizer ``state_dict()``."""
    meta = state_dict.get("fp8_optimizer")
    if meta is None:
        raise ValueError(
            "This is not an FP8Optimizer state dict (no 'fp8_optimizer' entry); it is already plain, load it as is."
        )
    config = FP8OptimizerConfig.from_dict(meta["config"])
    plain_state = {}
    for index, entry in state_dict["state"].items():
        shape = torch.Size(entry["shape"].tolist())
        out: dict[str, Any] = {}
        if meta["rule"] == "adam":
            out["step"] = entry["step"].clone()
        for name in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
            if name in entry:
                fmt = _formats(config, entry, name)
                data, scale = local_state(entry[name]), local_state(entry.get(f"{name}_scale"))
                out[name] = decode_state(data, scale, fmt, shape).clone()  # a sharded entry: this rank's shard
        plain_state[index] = out
    groups = [dict(group) for group in state_dict["param_groups"]]
    return {"state": plain_state, "param_groups": groups}


@torch.no_grad()
def master_parameters(optimizer) -> dict[torch.Tensor, torch.Tensor]:
    """``{parameter: exact float32 master value (local shard)}`` for every parameter the optimizer has stepped."""
    result = {}
    for param, state in optimizer.state.items():
        local = local_state(param).detach()  # the local shard of a DTensor parameter
        result[param] = mw.load_master(local, state, optimizer.master_kind(local)).clone()
    return result
