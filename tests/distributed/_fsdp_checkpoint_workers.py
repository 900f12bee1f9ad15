"""Process body of the 2-process test of activation checkpointing over FSDP2 with FP8 all-gather (importable by
spawned children): blocks of a linear layer into ``GroupedExperts``, checkpointed or not, every recipe."""

from __future__ import annotations

import torch
import torch.nn as nn

from fp8_lightning import convert_to_fp8, fp8_autocast
from fp8_lightning.distributed import enable_fp8_all_gather, shard_model
from fp8_lightning.testing import end_worker, init_gloo
from tests.distributed._fsdp_compile_workers import DIM, RECIPES, STEPS, TOKENS, HandMoE
from tests.helpers.distributed_steps import finish_step

__all__ = ["RECIPES", "checkpoint_worker"]


class Block(HandMoE):
    """The hand-written MoE of the compile test with a residual: a block to checkpoint."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + super().forward(x)


def train(recipe: str, world: int, rank: int, checkpointed: bool) -> dict:
    """Losses and last gradients of ``STEPS`` steps; the weights gathered in FP8."""
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    convert_to_fp8(model, recipe)
    report = enable_fp8_all_gather(model, world)
    shard_model(model, block_classes=["Block"], activation_checkpointing=checkpointed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs = torch.randn(STEPS, world, TOKENS, DIM, generator=torch.Generator().manual_seed(1))
    losses, grads = [], {}
    for step in range(STEPS):
        with fp8_autocast():
            loss = model(xs[step, rank]).square().mean()
        loss.backward()
        grads = {name: p.grad.full_tensor().clone() for name, p in model.named_parameters()}
        losses.append(finish_step(model, opt, loss))
    return {"losses": losses, "grads": grads, "gathered": list(report.fp8)}


def checkpoint_worker(rank: int, world: int, port: int, out: dict) -> None:
    init_gloo(rank, world, port)
    results = {}
    for recipe in RECIPES:
        try:
            results[recipe] = {"plain": train(recipe, world, rank, False), "checkpointed": train(recipe, world, rank, True)}
        except Exception as error:  # reported to the test, which names it
            results[recipe] = {"error": f"{type(error).__name__}: {str(error)[:2000]}"}
    if rank == 0:
        out.update(results)
    end_worker()
