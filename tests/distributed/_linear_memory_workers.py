"""Process body of the 2-process test of what a dense model sharded with FSDP2 holds between its forward and its
backward when its linear layers' weights are all-gathered in FP8 (bytes counted by :mod:`tests.helpers.graph_memory`).

Three blocks of two converted ``nn.Linear`` layers (with biases), each block its own FSDP2 unit. For every recipe the
worker trains the model with the FP8 all-gather resharded after forward and not, with the high-precision all-gather,
and counts what one unsharded process holds after the same forward.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fp8_lightning import FP8Linear, convert_to_fp8, fp8_autocast, recipe_from
from fp8_lightning.testing import end_worker, init_gloo
from tests.helpers.graph_memory import graph_held
from tests.helpers.distributed_steps import finish_step

TOKENS, BLOCKS, STEPS = 32, 3, 3
RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise", "mxfp8", "nvfp4", "nvfp4_1x16")
SPECS = {"nvfp4_1x16": {"name": "nvfp4", "fp4_2d_weights": False}}
# blockwise shards whole 128-row weight blocks: 128 rows per rank; 64 elsewhere keeps the test quick
WIDTH = {"blockwise": 256}
DEFAULT_WIDTH = 64
RUNS = {"fp8": (True, True), "fp8_kept": (True, False), "hp": (False, True)}  # (FP8 all-gather, reshard after forward)


def width(recipe: str) -> int:
    """in_features = out_features of every layer of the model under ``recipe``."""
    return WIDTH.get(recipe, DEFAULT_WIDTH)


class Block(nn.Module):
    """Two linear layers with a residual: one FSDP2 unit."""

    def __init__(self, dim: int):
        super().__init__()
        self.up = nn.Linear(dim, dim)
        self.down = nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class DenseNet(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim) for _ in range(BLOCKS)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _model(recipe: str) -> DenseNet:
    torch.manual_seed(0)
    model = DenseNet(width(recipe))
    convert_to_fp8(model, recipe_from(SPECS.get(recipe, recipe)))
    return model


def unsharded_held(recipe: str) -> dict[str, int]:
    """What the graph holds after a forward of the model in one process, unsharded (the weights' casts are then the
    step's cache, which the modules hold anyway): the reference of activation bytes."""
    model = _model(recipe)
    with fp8_autocast():
        loss = (model(torch.randn(TOKENS, width(recipe))) ** 2).mean()
    return graph_held(loss, model)


def memory_run(recipe: str, rank: int, world: int, fp8_all_gather: bool, reshard: bool) -> dict:
    """Train ``STEPS`` steps under FSDP2 (every block its own unit); after each forward, count what the graph holds.
    Returns the counts of the last step, the losses and every step's gradients (whole, on every rank)."""
    from fp8_lightning.distributed import enable_fp8_all_gather, shard_model

    model = _model(recipe)
    if fp8_all_gather:
        enable_fp8_all_gather(model, world)
    shard_model(model, reshard_after_forward=reshard)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    losses, grads, held = [], [], {}
    for _ in range(STEPS):
        x = torch.randn(world, TOKENS, width(recipe), generator=g)[rank]
        with fp8_autocast():
            loss = (model(x) ** 2).mean()
        held = graph_held(loss, model)
        loss.backward()
        grads.append({name: p.grad.full_tensor().clone() for name, p in model.named_parameters()})
        losses.append(finish_step(model, opt, loss))
    layers = sum(isinstance(m, FP8Linear) for m in model.modules())
    return {"held": held, "losses": losses, "grads": grads, "layers": layers}


def memory_worker(rank: int, world: int, port: int, out: dict, recipes=RECIPES) -> None:
    init_gloo(rank, world, port)
    results = {}
    for recipe in recipes:
        results[recipe] = {name: memory_run(recipe, rank, world, *how) for name, how in RUNS.items()}
        results[recipe]["unsharded"] = unsharded_held(recipe)
    if rank == 0:
        out.update(results)
    end_worker()
