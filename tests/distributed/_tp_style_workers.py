"""Workers of the tensor-parallel tests: every case in one spawn (process start-up dominates the cost)."""

from __future__ import annotations

import copy
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import parallelize_module

from fp8_lightning import NVFP4BlockScaling, convert_to_fp8, fp8_autocast
from fp8_lightning.saved_state import fp8_state_dict
from fp8_lightning.distributed import FP8ColwiseParallel, FP8RowwiseParallel, PrepareFP8ModuleInput
from fp8_lightning.distributed import sequence
from fp8_lightning.testing import Mixer

RECIPES = ["delayed", "tensorwise", "rowwise", "blockwise", "mxfp8"]
STEPS = 3
SEQUENCE, HIDDEN, FFN = 256, 256, 512  # 128 tokens per rank: whole 128-token tiles for blockwise


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


def _plan(sequence_parallel: bool, fp8_all_gather: bool | str = True) -> dict:
    if not sequence_parallel:
        return {"w1": FP8ColwiseParallel(), "w2": FP8RowwiseParallel()}
    return {"w1": FP8ColwiseParallel(input_layouts=Shard(1), fp8_all_gather=fp8_all_gather),
            "w2": FP8RowwiseParallel(output_layouts=Shard(1))}


def _full(t: torch.Tensor, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.detach().contiguous())
    return torch.cat(parts, dim)


class GatherBytes:
    """Counts the bytes this rank puts into all-gathers (``dist.all_gather_into_tensor``)."""

    def __init__(self):
        self.bytes, self.calls, self._real = 0, 0, dist.all_gather_into_tensor

    def __enter__(self):
        def counted(out, inp, group=None, async_op=False):
            self.bytes += inp.numel() * inp.element_size()
            self.calls += 1
            return self._real(out, inp, group=group, async_op=async_op)

        sequence.dist.all_gather_into_tensor = counted
        return self

    def __exit__(self, *exc):
        sequence.dist.all_gather_into_tensor = self._real


def _train(model, recipe_batches, rank, world, sequence_parallel: bool):
    """SGD steps; returns (losses, output of the first step (whole), grads of the first step (whole))."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, first = [], None
    for x in recipe_batches:
        local = x.chunk(world, 1)[rank] if sequence_parallel else x
        with fp8_autocast():
            y = model(local)
        loss = y.float().square().sum() / x.numel()
        loss.backward()
        total = loss.detach().clone()
        if sequence_parallel:
            dist.all_reduce(total)
        losses.append(total.item())
        if first is None:
            out = _full(y, 1) if sequence_parallel else y.detach()
            grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                     for n, p in model.named_parameters()}
            first = (out, grads)
        opt.step()
        opt.zero_grad()
    return losses, first


def _single(model, batches):
    return _train(model, batches, 0, 1, False)


def _errors(mesh) -> dict:
    errors = {}
    for label, build in (
        ("mxfp8_split_block", lambda: (nn.Sequential(nn.Linear(64, 96)), "mxfp8")),
        ("nvfp4", lambda: (nn.Sequential(nn.Linear(64, 48)), "nvfp4")),  # shards of 24 rows cut 16-blocks
    ):
        model, recipe = build()
        parallelize_module(model, mesh, {"0": FP8ColwiseParallel()})
        try:
            convert_to_fp8(model, recipe)
        except ValueError as err:
            errors[label] = str(err)
    try:
        parallelize_module(nn.Sequential(nn.Conv1d(4, 4, 1)), mesh, {"0": FP8ColwiseParallel()})
    except TypeError as err:
        errors["conv"] = str(err)
    return errors


def tp_worker(rank: int, world: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    batches = [torch.randn(2, SEQUENCE, HIDDEN) for _ in range(STEPS)]
    result = {"errors": _errors(mesh)}
    for recipe in RECIPES:
        torch.manual_seed(1)
        base = MLP()
        single = copy.deepcopy(base)
        convert_to_fp8(single, recipe)
        runs = {"eval": _evaluation_difference(base, single, mesh, recipe, batches[0])}
        runs["single"] = _single(single, batches)
        for name, sp, fp8_gather in (("tp", False, True), ("sp_fp8", True, True), ("sp_hp", True, False),
                                     ("sp_fprop", True, "fprop")):
            model = copy.deepcopy(base)
            parallelize_module(model, mesh, _plan(sp, fp8_gather))
            convert_to_fp8(model, recipe)
            with GatherBytes() as counter:
                runs[name] = _train(model, batches, rank, world, sp)
            runs[name + "_bytes"] = counter.bytes
            runs[name + "_scales"] = fp8_state_dict(model)
        result[recipe] = runs
    result["nvfp4"] = _nvfp4(mesh, rank, world, batches)
    result["short"] = _short_sequence(mesh, rank, world)
    result["mixer"] = _mixer(mesh, rank, world, batches[0])
    out[rank] = result
    dist.destroy_process_group()


def _nvfp4(mesh, rank, world, batches) -> dict:
    """NVFP4 split colwise and rowwise against one process: rounding to nearest and the full recipe (stochastic
    rounding keyed by the rank); every layer in NVFP4 (no high-precision tail)."""
    runs = {}
    for label, recipe in (("rtn", NVFP4BlockScaling(disable_stochastic_rounding=True)), ("sr", NVFP4BlockScaling())):
        torch.manual_seed(1)
        base = MLP()
        single = copy.deepcopy(base)
        convert_to_fp8(single, recipe, layers={"last": 0})
        runs[label] = {"single": _single(single, batches)}
        model = copy.deepcopy(base)
        parallelize_module(model, mesh, _plan(False))
        convert_to_fp8(model, recipe, layers={"last": 0})
        runs[label]["tp"] = _train(model, batches, rank, world, False)
        runs[label]["scales"] = fp8_state_dict(model)
    return runs


def _evaluation_difference(base, single, mesh, recipe, x) -> float:
    """An evaluation forward of the split model and of one process, before any training (after training the two
    weights differ by float32 summation order, which can move an FP8 code): the largest difference relative to the
    largest output."""
    model = copy.deepcopy(base)
    parallelize_module(model, mesh, _plan(False))
    convert_to_fp8(model, recipe)
    model.eval()
    single.eval()
    with fp8_autocast(), torch.no_grad():
        expected = single(x)
        difference = (model(x) - expected).abs().max() / expected.abs().max()
    single.train()
    return difference.item()


def _short_sequence(mesh, rank, world) -> dict:
    """Blockwise with 32 tokens per rank, which hold no whole 128-token tile: gathered in high precision, warned."""
    torch.manual_seed(3)
    model = MLP()
    parallelize_module(model, mesh, _plan(True))
    convert_to_fp8(model, "blockwise")
    with warnings.catch_warnings(record=True) as caught, GatherBytes() as counter:
        warnings.simplefilter("always")
        _train(model, [torch.randn(2, 64, HIDDEN)], rank, world, True)
    return {"bytes": counter.bytes, "warnings": [str(w.message) for w in caught]}


def _mixer(mesh, rank, world, x) -> dict:
    torch.manual_seed(2)
    base = Mixer(HIDDEN)
    single = copy.deepcopy(base)
    convert_to_fp8(single, "tensorwise")
    model = copy.deepcopy(base)
    plan = {"": PrepareFP8ModuleInput(consumers=("q", "k", "v")), "q": FP8ColwiseParallel(),
            "k": FP8ColwiseParallel(), "v": FP8ColwiseParallel(), "o": FP8RowwiseParallel(output_layouts=Shard(1))}
    parallelize_module(model, mesh, plan)
    convert_to_fp8(model, "tensorwise")
    with fp8_autocast():
        expected = single(x)
        expected.square().sum().backward()
        with GatherBytes() as counter:
            y = model(x.chunk(world, 1)[rank])
        y.square().sum().backward()
    grad_q = model.q.weight.grad.full_tensor()
    return {
        "out": (_full(y, 1) - expected.detach()).abs().max().item() / expected.abs().max().item(),
        "grad_q": (grad_q - single.q.weight.grad).abs().max().item() / single.q.weight.grad.abs().max().item(),
        "gathers": counter.calls,
        "gather_bytes": counter.bytes,
    }
