"""Process body of the 2-process test of FP8 tensor parallelism under ``torch.compile`` (importable by spawned
children): an MLP split colwise/rowwise (and sequence parallel) trained eagerly, compiled, and compiled with
``fullgraph=True``, under NVFP4 (stochastic rounding on, every layer in NVFP4) and tensorwise scaling."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import parallelize_module

from fp8_lightning import convert_to_fp8, fp8_autocast, recipe_from
from fp8_lightning.saved_state import fp8_state_dict
from fp8_lightning.distributed import FP8ColwiseParallel, FP8RowwiseParallel, PrepareFP8ModuleInput
from fp8_lightning.testing import Mixer

RECIPES = ("nvfp4", "tensorwise")
PLANS = ("tp", "sp", "mixer")  # colwise + rowwise; sequence parallel; one FP8 gather for three consumers
MODES = ("eager", "compile", "fullgraph")
HIDDEN, FFN, TOKENS, STEPS = 64, 128, 32, 3
# The mixer compiles with aot_eager: inductor fuses tanh(q) * k + v with float32 roundings of its own, a last-bit
# difference from eager that NVFP4's casts of the gradients can turn into different codes (measured: equal losses,
# q's weight apart after 3 steps). That is the compiler's code between the split layers, not theirs.
BACKEND = {"tp": "inductor", "sp": "inductor", "mixer": "aot_eager"}


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


def _plan(kind: str) -> dict:
    if kind == "tp":
        return {"w1": FP8ColwiseParallel(), "w2": FP8RowwiseParallel()}
    if kind == "mixer":
        return {"": PrepareFP8ModuleInput(consumers=("q", "k", "v")), "q": FP8ColwiseParallel(),
                "k": FP8ColwiseParallel(), "v": FP8ColwiseParallel(), "o": FP8RowwiseParallel(output_layouts=Shard(1))}
    return {"w1": FP8ColwiseParallel(input_layouts=Shard(1)), "w2": FP8RowwiseParallel(output_layouts=Shard(1))}


def _run(recipe: str, plan: str, mode: str, mesh, rank: int, world: int, batches) -> dict:
    """SGD steps: this rank's losses, weights (local shards) and FP8 state, or the error the first step raised."""
    torch.manual_seed(1)
    torch._dynamo.reset()
    model = Mixer(HIDDEN) if plan == "mixer" else MLP()
    parallelize_module(model, mesh, _plan(plan))
    convert_to_fp8(model, recipe_from(recipe), layers={"last": 0})  # NVFP4: no high-precision tail
    step = model if mode == "eager" else torch.compile(model, fullgraph=mode == "fullgraph", backend=BACKEND[plan])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for x in batches:
        local = x if plan == "tp" else x.chunk(world, 1)[rank]
        try:
            with fp8_autocast():
                y = step(local)
        except Exception as err:  # noqa: BLE001 - the refusal under fullgraph=True is the result
            return {"error": f"{type(err).__name__}: {err}"}
        loss = y.float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    weights = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "weights": weights, "state": fp8_state_dict(model)}


def tp_compile_worker(rank: int, world: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    batches = [torch.randn(2, TOKENS, HIDDEN) for _ in range(STEPS)]
    results = {f"{r}/{p}/{m}": _run(r, p, m, mesh, rank, world, batches) for r in RECIPES for p in PLANS for m in MODES}
    out[rank] = results
    dist.destroy_process_group()
