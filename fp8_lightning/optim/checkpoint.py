"""Leaving FP8: turn an FP8Optimizer state dict into the state dict of the plain torch optimizer it wraps.

The FP8 state dict stores each state as it lives in memory (FP8 bytes plus block scales, FP16, remainders) with
the storage config next to it, so it can be decoded without the model: ``to_plain_state_dict`` decodes every
moment to float32 in the parameter's shape, keeps ``step`` and the parameter groups, and drops the FP8-only
entries. The result loads into ``torch.optim.AdamW`` (or Adam/SGD) built over the same parameters.

Master weights are not part of a torch optimizer's state: a float32 parameter already is its master; for bf16
parameters the master values are returned as float32 by :func:`master_parameters` (exact float32 values with
``master_weights="bf16_remainder"``, 16 significant bits with the default ``"bf16_int8_remainder"``) so the user
can load them into a float32 copy of the model.
"""

from __future__ import annotations

from typing import Any

import torch

from fp8_lightning.optim import master_weights as mw
from fp8_lightning.optim.config import FP8OptimizerConfig
from fp8_lightning.optim.sharded_state import local_state
from fp8_lightning.optim.state_formats import StateFormat, decode_state


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
    from fp8_lightning.optim.optimizer import local_tensor

    result = {}
    for param, state in optimizer.state.items():
        local = local_tensor(param)
        result[param] = mw.load_master(local, state, optimizer.master_kind(local)).clone()
    return result
