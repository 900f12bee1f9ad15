"""Models, data and process bodies shared by the 2-process FSDP2 tests (importable by spawned children)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from fp8_lightning import convert_to_fp8, fp8_autocast, recipe_from, sync_scales
from fp8_lightning.testing import CollectiveCounter, end_worker, init_gloo

REPO_ROOT = Path(__file__).resolve().parents[2]
WIDTH, HIDDEN, OUT = 64, 128, 32
RECIPES = ("tensorwise", "delayed", "mxfp8", "rowwise", "nvfp4")
NVFP4_1X16 = {"name": "nvfp4", "fp4_2d_weights": False}  # 1x16 weight blocks: row scales on the wire


class Block(nn.Module):
    def __init__(self, bias: bool = True):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH, elementwise_affine=bias)
        self.up = nn.Linear(WIDTH, HIDDEN, bias=bias)
        self.down = nn.Linear(HIDDEN, WIDTH, bias=bias)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, depth: int = 2, bias: bool = True):
        super().__init__()
        self.blocks = nn.ModuleList([Block(bias) for _ in range(depth)])
        self.head = nn.Linear(WIDTH, OUT, bias=bias)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def convert(model: nn.Module, recipe) -> None:
    """FP8 conversion of every Linear (``last: 0`` turns NVFP4's default high-precision tail off; the other recipes
    have none)."""
    convert_to_fp8(model, recipe_from(recipe), layers={"last": 0})


def batches(steps: int, rows: int = 64, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, WIDTH, generator=g), torch.randn(rows, OUT, generator=g)) for _ in range(steps)]


def train_plain(
    model: nn.Module, data, rank: int, world: int, lr: float = 0.1, momentum: float = 0.0, fp8_optimizer=False
) -> list[float]:
    """SGD steps (or FP8-state AdamW) on this rank's slice of each global batch; returns the global mean loss."""
    if fp8_optimizer:
        from fp8_lightning.optim import fp8_adamw

        opt = fp8_adamw(model.parameters(), lr=1e-2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    losses = []
    for x, y in data:
        if world > 1:
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        with fp8_autocast():
            loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sync_scales(model)
        value = loss.detach().clone()
        if world > 1 and dist.is_initialized():
            dist.all_reduce(value)
            value /= world
        losses.append(value.item())
    return losses


def fsdp_run(
    recipe, rank: int, world: int, data, fp8_all_gather: bool, param_dtype=None, bias=True, fp8_optimizer=False
) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fp8_lightning.distributed import enable_fp8_all_gather, shard_model, weight_amax_reductions

    torch.manual_seed(0)
    model = Net(bias=bias)
    convert(model, recipe)
    report = enable_fp8_all_gather(model, world) if fp8_all_gather else None
    shard_model(model, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype))
    with CollectiveCounter() as counter:
        losses = train_plain(model, data, rank, world, fp8_optimizer=fp8_optimizer)
    return {
        "losses": losses,
        "allgather_bytes": counter.bytes["all_gather"],
        "allgather_calls": counter.calls["all_gather"],
        "amax_reductions": weight_amax_reductions(model),
        "fp8_weights": len(report.fp8) if report else 0,
    }


def plain_fully_shard_run(recipe, rank: int, world: int, data) -> list[float]:
    """``fully_shard`` called by hand on a converted model (no shard_model, no strategy), high-precision gathers."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Net()
    convert(model, recipe)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return train_plain(model, data, rank, world)


def single_run(recipe, data, momentum: float = 0.0) -> list[float]:
    torch.manual_seed(0)
    model = Net()
    convert(model, recipe)
    return train_plain(model, data, 0, 1, momentum=momentum)


def parity_worker(rank: int, world: int, port: int, steps: int, out: dict) -> None:
    init_gloo(rank, world, port)
    data = batches(steps)
    results = {}
    for recipe in RECIPES:
        results[recipe] = {
            "single": single_run(recipe, data),
            "fp8": fsdp_run(recipe, rank, world, data, True),
            "hp": fsdp_run(recipe, rank, world, data, False),
            "plain_fully_shard": plain_fully_shard_run(recipe, rank, world, data),
        }
    results["bf16_params"] = fsdp_run("tensorwise", rank, world, data, True, torch.bfloat16)  # FP8 + bf16 others
    results["fp8_optimizer"] = {  # FP8 optimizer states, updated through the local shards
        "fp8": fsdp_run("tensorwise", rank, world, data, True, fp8_optimizer=True),
        "hp": fsdp_run("tensorwise", rank, world, data, False, fp8_optimizer=True),
    }
    results["bytes"] = {
        "fp32": fsdp_run("tensorwise", rank, world, data[:1], False, bias=False)["allgather_bytes"],
        "bf16": fsdp_run("tensorwise", rank, world, data[:1], False, torch.bfloat16, bias=False)["allgather_bytes"],
        **{r: fsdp_run(r, rank, world, data[:1], True, bias=False)["allgather_bytes"] for r in RECIPES},
        "nvfp4_1x16": fsdp_run(NVFP4_1X16, rank, world, data[:1], True, bias=False)["allgather_bytes"],
    }
    if rank == 0:
        out.update(results)
    end_worker()
