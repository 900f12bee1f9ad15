"""Process body of the 2-process test of what an FSDP2-sharded MoE holds between its forward and its backward.

The bytes counted are those of the storages the autograd graph reaches (a custom Function's ``ctx`` attributes and
saved tensors, a built-in node's saved tensors, an AccumulateGrad node's variable, the inner tensors of a tensor
subclass) that the model does not hold anyway (its sharded parameters and the FP8 scaling state of its modules),
grouped by the graph node that reaches them. A storage FSDP2 freed on reshard (``resize_(0)``) counts zero bytes.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fp8_lightning import convert_to_fp8, fp8_autocast, recipe_from
from fp8_lightning.grouped.experts import GroupedExperts
from fp8_lightning.testing import end_worker, init_gloo
from tests.helpers.graph_memory import graph_held, storage_bytes, walk
from tests.helpers.distributed_steps import finish_step

DIM, HIDDEN, EXPERTS, TOKENS, BLOCKS, STEPS = 64, 128, 4, 32, 3, 3
OFFS = (4, 4, 20, 32)  # an empty expert, uneven groups
RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8", "nvfp4", "nvfp4_1x16")
SPECS = {"nvfp4_1x16": {"name": "nvfp4", "fp4_2d_weights": False}}


class Block(nn.Module):
    """Fused SwiGLU experts and a linear layer, with residuals: one FSDP2 unit."""

    def __init__(self):
        super().__init__()
        self.experts = GroupedExperts(DIM, HIDDEN, EXPERTS)
        self.proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        x = x + self.experts(x, torch.tensor(OFFS, dtype=torch.int32))
        return x + self.proj(x)


class MoENet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(BLOCKS)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _model(recipe) -> MoENet:
    torch.manual_seed(0)
    model = MoENet()
    convert_to_fp8(model, recipe_from(SPECS.get(recipe, recipe)), layers={"last": 0})
    return model


def unsharded_held(recipe) -> dict[str, int]:
    """What the graph holds after a forward of the model in one process, unsharded (the weights' casts are then the
    step's cache, which the modules hold anyway): the reference of activation bytes."""
    model = _model(recipe)
    with fp8_autocast():
        loss = (model(torch.randn(TOKENS, DIM)) ** 2).mean()
    return graph_held(loss, model)


MADE = {"columns": 0}  # deferred stacked W_e.T casts made (see count_deferred_columns)


def count_deferred_columns() -> None:
    """Count each deferred stacked W_e.T cast when it is made (rowwise and MXFP8 through ``StackedWeights.columns``,
    NVFP4 through ``NVFP4StackedWeights.casts``)."""
    from fp8_lightning.groups import StackedWeights
    from fp8_lightning.nvfp4_grouped import NVFP4StackedWeights

    for cls, prop, attr in ((StackedWeights, "columns", "_columns"), (NVFP4StackedWeights, "casts", "_column_cast")):
        def counted(self, _get=getattr(cls, prop).fget, _attr=attr):
            MADE["columns"] += callable(getattr(self, _attr))
            return _get(self)

        setattr(cls, prop, property(counted))


def memory_run(recipe, rank: int, world: int, fp8_all_gather: bool, reshard: bool = True) -> dict:
    """Train ``STEPS`` steps of :class:`MoENet` under FSDP2 (every block its own unit, resharded after forward unless
    ``reshard`` is False); after each forward, count what the graph holds and the W_e.T casts made. Returns the counts
    of the last step, the losses, the last gradients and the bytes of the sharded expert weights (each rank's) and of
    their gathered buffers after the forward."""
    from fp8_lightning.distributed import enable_fp8_all_gather, shard_model
    from fp8_lightning.privates import local_shard

    model = _model(recipe)
    if fp8_all_gather:
        enable_fp8_all_gather(model, world)
    shard_model(model, reshard_after_forward=reshard)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    losses, run = [], {}
    for _ in range(STEPS):
        x = torch.randn(world, TOKENS, DIM, generator=g)[rank]
        MADE["columns"] = 0
        with fp8_autocast():
            loss = (model(x) ** 2).mean()
        run["held"], run["columns_in_forward"] = graph_held(loss, model), MADE["columns"]
        experts = [getattr(block.experts, w) for block in model.blocks for w in ("w1", "w2", "w3")]
        run["shard_bytes"] = sum(storage_bytes(walk(local_shard(w))).get(_key(local_shard(w)), 0) for w in experts)
        loss.backward()
        run["columns_in_backward"] = MADE["columns"] - run["columns_in_forward"]
        run["grads"] = {name: p.grad.full_tensor().clone() for name, p in model.named_parameters()}
        losses.append(finish_step(model, opt, loss))
    return {**run, "losses": losses}


def _key(t: torch.Tensor) -> int:
    """The storage of a sharded expert weight's high-precision shard."""
    return getattr(t, "_hp", t).untyped_storage()._cdata


def memory_worker(rank: int, world: int, port: int, out: dict, recipes=RECIPES) -> None:
    init_gloo(rank, world, port)
    count_deferred_columns()
    results = {r: {"fp8": memory_run(r, rank, world, True), "hp": memory_run(r, rank, world, False),
                   "kept": memory_run(r, rank, world, True, reshard=False),
                   "unsharded": unsharded_held(r)} for r in recipes}  # fmt: skip
    if rank == 0:
        out.update(results)
    end_worker()
