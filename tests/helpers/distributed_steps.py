"""The end of a training step in a gloo worker: what every distributed worker of the tests does after backward."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fp8_lightning import sync_scales


def finish_step(model: torch.nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor) -> float:
    """Step and clear ``opt``, sync the model's FP8 scales, and return ``loss`` averaged over the world."""
    opt.step()
    opt.zero_grad()
    sync_scales(model)
    value = loss.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()
