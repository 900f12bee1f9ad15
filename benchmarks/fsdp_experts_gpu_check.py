"""GPU check of the fused expert weights' FP8 all-gather under FSDP2 on NCCL (one GPU is enough; more through
torchrun).

    python -m benchmarks fsdp-experts-gpu-check                          # one GPU: NCCL process group of size 1
    torchrun --nproc_per_node 8 -m benchmarks fsdp-experts-gpu-check     # several GPUs

For each recipe (tensorwise, delayed, rowwise, blockwise, MXFP8, NVFP4) it trains a few SGD steps of a stack of
``GroupedExperts`` blocks sharded with ``fully_shard``, once with the expert weights gathered in FP8 and once in
high precision (the same weights, inputs and routing), and checks:

* the hooks ran on CUDA with NCCL: every expert weight was consumed as gathered FP8 operands in each forward
  (``FP8GatheredExperts.fp8_expert_operands`` calls) and the gathered codes are float8 on the GPU;
* the losses match the high-precision gather to the standards the CPU test holds (2 gloo processes,
  ``tests/distributed/test_fsdp_experts.py``): per-tensor and blockwise rel 1e-6, MXFP8 1e-5, rowwise 1e-3, NVFP4
  (16x16 tiles: each expert's codes and tile scales, its own global scale) equal;
* one weight-amax all-reduce per step for per-tensor recipes and NVFP4 where there are several ranks, none otherwise.

Exits non-zero on a failure, and with a clear message where there is no CUDA device.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn as nn

from benchmarks.fsdp_gpu_check import init, train
from fp8_lightning import convert_to_fp8
from fp8_lightning.distributed import FP8GatheredExperts, enable_fp8_all_gather, shard_model, weight_amax_reductions
from fp8_lightning.grouped.experts import GroupedExperts

TOLERANCE = {"tensorwise": 1e-6, "delayed": 1e-6, "blockwise": 1e-6, "mxfp8": 1e-5, "rowwise": 1e-3, "nvfp4": 0.0}
AMAX_AGREED = ("tensorwise", "delayed", "nvfp4")  # one weight-amax all-reduce per step
DIM, HIDDEN, EXPERTS, DEPTH, ROWS, STEPS = 256, 512, 8, 2, 512, 3


class ExpertsStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([GroupedExperts(DIM, HIDDEN, EXPERTS) for _ in range(DEPTH)])

    def forward(self, x):
        sizes = torch.tensor([0, 32, 64, 32, 128, 64, 96, 96], device=x.device) * (x.shape[0] // ROWS)
        offs = torch.cumsum(sizes, 0, dtype=torch.int32)  # uneven, one expert empty
        for block in self.blocks:
            x = x + block(x, offs)
        return x


def run(recipe: str, fp8_gather: bool, world: int, data) -> tuple[list[float], int, int]:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = ExpertsStack().cuda()
    # every projection in FP8 (no NVFP4 high-precision tail): this checks the hooks, not speed
    convert_to_fp8(model, recipe, profitability=False, layers={"last": 0})
    report = enable_fp8_all_gather(model, world) if fp8_gather else None
    shard_model(model, mesh=init_device_mesh("cuda", (world,)))
    losses = train(model, data)
    return losses, (len(report.fp8) if report else 0), weight_amax_reductions(model)


def check(recipe: str, rank: int, world: int) -> list[str]:
    failures = []
    g = torch.Generator(device="cuda").manual_seed(1 + rank)
    data = [torch.randn(ROWS, DIM, device="cuda", generator=g) for _ in range(STEPS)]
    uses, dtypes = [], set()
    original = FP8GatheredExperts.fp8_expert_operands

    def spy(self, scaling, record):
        uses.append(1)
        dtypes.update((q.data.dtype, q.data.device.type) for q in self._q)
        return original(self, scaling, record)

    FP8GatheredExperts.fp8_expert_operands = spy
    try:
        fp8, fp8_weights, reductions = run(recipe, True, world, data)
    finally:
        FP8GatheredExperts.fp8_expert_operands = original
    hp, _, _ = run(recipe, False, world, data)
    n_weights = 3 * DEPTH
    if fp8_weights != n_weights:
        failures.append(f"{recipe}: {fp8_weights}/{n_weights} expert weights gather in FP8")
    if len(uses) != n_weights * STEPS:
        failures.append(f"{recipe}: gathered FP8 experts used {len(uses)} times, expected {n_weights * STEPS}")
    if any(device != "cuda" or dtype.itemsize != 1 for dtype, device in dtypes):
        failures.append(f"{recipe}: gathered codes are {dtypes}, expected float8 on cuda")
    bad = [(a, b) for a, b in zip(fp8, hp) if abs(a - b) > TOLERANCE[recipe] * abs(b)]
    if bad:
        failures.append(f"{recipe}: losses differ from the high-precision gather: {fp8} vs {hp}")
    expected = STEPS if recipe in AMAX_AGREED and world > 1 else 0
    if reductions != expected:
        failures.append(f"{recipe}: {reductions} weight-amax all-reduces, expected {expected}")
    if rank == 0:
        print(f"{recipe:>10}: FP8 gather losses {['%.6f' % v for v in fp8]}, high precision {['%.6f' % v for v in hp]}")
    return failures


def main() -> int:
    if not torch.cuda.is_available():
        print("fsdp_experts_gpu_check: needs a CUDA GPU (and NCCL); none is available here.")
        return 2
    rank, world = init()
    failures = []
    for recipe in TOLERANCE:
        failures += check(recipe, rank, world)
    dist.destroy_process_group()
    if rank == 0:
        print("\n".join(failures) if failures else f"PASS: experts' FP8 all-gather on NCCL, world size {world}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
