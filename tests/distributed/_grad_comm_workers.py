"""Process body of the 2-process FP8 gradient communication tests (importable by spawned children).

One spawn runs every case; rank 0 reports each case's inputs (every rank's) and results (every rank's), and the
test process checks them against float64 references and counts."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from fp8_lightning.distributed import FP8CommState, FP8ReduceScatter, fp8_all_reduce_mean, fp8_compress_hook
from fp8_lightning.testing import WireBytes, bf16_hook, end_worker, fp32_hook, init_gloo

NUMEL, BLOCK = 3001, 256  # odd: the chunks and the last block are padded


def adversarial(case: str, rank: int) -> torch.Tensor:
    """This rank's gradient for one adversarial case (deterministic per case and rank)."""
    g = torch.Generator().manual_seed(1000 * rank + len(case))
    x = torch.randn(NUMEL, generator=g)
    if case == "one_rank_1e4x":
        return x * (1e4 if rank == 0 else 1.0)
    if case == "log_uniform":  # magnitudes over 2**-40 .. 1: many land in the FP8 subnormals (and below) after scaling
        return x.sign() * torch.exp2(-40 * torch.rand(NUMEL, generator=g))
    if case == "tiny":  # the whole gradient near float32's smallest normals: the scale saturates at float32 max
        return x * 1e-37
    if case == "zeros":
        return torch.zeros(NUMEL)
    if case == "zeros_on_one_rank":
        return x if rank == 0 else torch.zeros(NUMEL)
    if case == "nonfinite":
        x[5 if rank == 1 else 2000] = float("nan") if rank == 1 else float("inf")
        return x
    raise ValueError(case)


CASES = ("one_rank_1e4x", "log_uniform", "tiny", "zeros", "zeros_on_one_rank", "nonfinite")


def gathered(x: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x)
    return out


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128), nn.GELU(), nn.Linear(128, 16))


def ddp_step(hook, state, rank: int) -> tuple[float, dict, list[torch.Tensor]]:
    """One backward through DDP with ``hook``: the wire bytes of the gradient reduction and the averaged grads."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model(), bucket_cap_mb=0.1)
    ddp.register_comm_hook(state, hook)
    x = torch.randn(32, 128, generator=torch.Generator().manual_seed(rank))
    with WireBytes() as wire:
        ddp(x).square().mean().backward()
    return sum(wire.bytes.values()), dict(wire.bytes), [p.grad.clone() for p in ddp.parameters()]


def fsdp_step(rank: int, fp8: bool, reduce_dtype=None) -> tuple[float, dict, list[torch.Tensor]]:
    """One backward through FSDP2 (float32 or bf16 reduce-scatter, or FP8): wire bytes and the full gradients."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    net = model()
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for layer in net[::2]:
        fully_shard(layer, mp_policy=policy)
    fully_shard(net, mp_policy=policy)
    if fp8:
        for module in net.modules():
            if hasattr(module, "set_custom_reduce_scatter"):
                module.set_custom_reduce_scatter(FP8ReduceScatter(block_size=BLOCK))
    x = torch.randn(32, 128, generator=torch.Generator().manual_seed(rank))
    with WireBytes() as wire:
        net(x).square().mean().backward()
    grads = [p.grad.full_tensor().clone() for p in net.parameters()]
    return sum(wire.bytes.values()), dict(wire.bytes), grads


def worker(rank: int, world: int, port: int, out: dict) -> None:
    init_gloo(rank, world, port)
    results: dict = {}
    for fmt in ("e4m3", "e5m2"):
        for case in CASES:
            x = adversarial(case, rank)
            state = FP8CommState(fp8_format=fmt, block_size=BLOCK)
            mean = fp8_all_reduce_mean(x.clone(), state)
            shard = torch.empty(math.ceil(NUMEL / world))
            padded = torch.cat([x, x.new_zeros(world * shard.numel() - NUMEL)])
            FP8ReduceScatter(fmt, BLOCK)(shard, padded, None, dist.ReduceOp.AVG)
            results[fmt, case] = {
                "inputs": gathered(x),
                "means": gathered(mean),
                "shards": gathered(shard),
                "factor": state.factors[0].item(),
            }
    # overflow back-off: identical gradients on both ranks do not cancel, so a factor of 2 overflows the mean
    same = adversarial("one_rank_1e4x", 1)
    state = FP8CommState(block_size=BLOCK, growth_interval=1)
    first = fp8_all_reduce_mean(same, state)
    grown = state.factors[0].item()
    second = fp8_all_reduce_mean(same, state)
    results["backoff"] = {
        "input": same, "first": first, "second": second, "grown": grown,
        "after": state.factors[0].item(), "backoffs": state.overflow_backoffs,
    }
    results["ddp"] = {name: ddp_step(hook, st, rank) for name, hook, st in [
        ("fp32", fp32_hook, None), ("bf16", bf16_hook, None), ("fp8", fp8_compress_hook, FP8CommState())]}
    results["fsdp"] = {
        "fp32": fsdp_step(rank, False), "bf16": fsdp_step(rank, False, torch.bfloat16), "fp8": fsdp_step(rank, True)}
    results["lightning"] = lightning_fits(rank, world, port)
    if rank == 0:
        out.update(results)
    end_worker()


def lightning_fits(rank: int, world: int, port: int) -> dict:
    """The two strategy switches under a real Trainer (in the process group already joined), against the same
    strategy without FP8 gradients: losses, and proof that the FP8 communication ran."""
    import os
    import warnings

    from fp8_lightning import FP8DDPStrategy, FP8FSDPStrategy
    from tests.distributed._lightning_workers import fit, make_module

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    warnings.filterwarnings("ignore")
    res = {}
    _, res["ddp"] = fit(make_module(), FP8DDPStrategy(), recipe="tensorwise", epochs=1)
    trainer, res["ddp_fp8"] = fit(make_module(), FP8DDPStrategy(fp8_gradients=True), recipe="tensorwise", epochs=1)
    state = trainer.strategy.fp8_comm_state
    res["ddp_fp8_buckets"] = len(state.factors)
    _, res["fsdp"] = fit(make_module(), FP8FSDPStrategy(), recipe="tensorwise", epochs=1)
    module = make_module()
    _, res["fsdp_fp8"] = fit(module, FP8FSDPStrategy(fp8_reduce_scatter=True), recipe="tensorwise", epochs=1)
    groups = [g for m in module.modules() if hasattr(m, "_get_fsdp_state") for g in m._get_fsdp_state()._fsdp_param_groups]
    res["fsdp_fp8_comms"] = [type(g._reduce_scatter_comm).__name__ for g in groups]
    return res
