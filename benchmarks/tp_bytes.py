"""Bytes of the sequence-parallel all-gathers per training step: FP8 (every recipe) versus the same plan in bf16.

Two gloo processes on CPU train one step of a stack of bf16 blocks (LayerNorm, an attention-like mixer whose q, k,
v share one gather through ``PrepareFP8ModuleInput`` and whose output projection reduce-scatters, then an MLP:
``FP8ColwiseParallel(input_layouts=Shard(1))`` up, ``FP8RowwiseParallel(output_layouts=Shard(1))`` down), with the
activations sharded along the sequence between the tensor-parallel regions. The bf16 plan is the same model with
FP8 off, whose regions gather in bf16. Bytes are what this rank contributes to ``all_gather_into_tensor``, apart
for the forward (the activations entering each colwise region) and the backward (the gradients leaving each rowwise
region, bf16 in both plans).

Usage::

    python -m benchmarks tp-bytes [--width 256] [--sequence 256] [--depth 2] [--out benchmarks/results/tp_bytes.md]

Block recipes (rowwise, blockwise, MXFP8) are measured twice: sending both FP8 copies (the default) and with
``fp8_all_gather="fprop"`` (the forward copy alone).

Writes a Markdown table (with the command, machine and date) and a JSON file next to it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from benchmarks.bench_common import write_gloo_result
from fp8_lightning.testing import CollectiveCounter, Mixer, free_port

WORLD = 2
RECIPES = ["tensorwise", "delayed", "rowwise", "blockwise", "mxfp8"]
BLOCK_RECIPES = ["rowwise", "blockwise", "mxfp8"]  # two copies travel by default; "fprop" sends one
TARGET = 0.55  # forward bytes of the FP8 plan over the bf16 plan's


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mixer = Mixer(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        x = x + self.mixer(self.norm(x))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def plan(depth: int, gather: bool | str = True) -> dict:
    from torch.distributed.tensor import Shard

    from fp8_lightning.distributed import FP8ColwiseParallel, FP8RowwiseParallel, PrepareFP8ModuleInput

    styles = {}
    for i in range(depth):
        styles[f"{i}.mixer"] = PrepareFP8ModuleInput(consumers=("q", "k", "v"), fp8_all_gather=gather)
        styles.update({f"{i}.mixer.{n}": FP8ColwiseParallel() for n in ("q", "k", "v")})
        styles[f"{i}.mixer.o"] = FP8RowwiseParallel(output_layouts=Shard(1))
        styles[f"{i}.up"] = FP8ColwiseParallel(input_layouts=Shard(1), fp8_all_gather=gather)
        styles[f"{i}.down"] = FP8RowwiseParallel(output_layouts=Shard(1))
    return styles


def one_step(recipe: str | None, rank: int, width: int, sequence: int, depth: int, gather: bool | str = True) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from fp8_lightning import convert_to_fp8, fp8_autocast

    torch.manual_seed(0)
    model = nn.Sequential(*[Block(width) for _ in range(depth)]).to(torch.bfloat16)
    mesh = init_device_mesh("cpu", (WORLD,))
    parallelize_module(model, mesh, plan(depth, gather))
    convert_to_fp8(model, recipe or "tensorwise")
    x = torch.randn(2, sequence, width, dtype=torch.bfloat16).chunk(WORLD, 1)[rank]
    with fp8_autocast(enabled=recipe is not None):  # warm-up: first-use scales
        model(x).float().square().mean().backward()
    with CollectiveCounter() as forward, fp8_autocast(enabled=recipe is not None):
        y = model(x)
    with CollectiveCounter() as backward:
        y.float().square().mean().backward()
    config = (recipe or "bf16") + (' (fp8_all_gather="fprop")' if gather == "fprop" else "")
    return {"config": config, "forward": forward.bytes, "backward": backward.bytes,
            "activation_elements": 2 * sequence // WORLD * width}


def worker(rank: int, port: int, width: int, sequence: int, depth: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    rows = [one_step(recipe, rank, width, sequence, depth) for recipe in [None, *RECIPES]]
    rows += [one_step(recipe, rank, width, sequence, depth, "fprop") for recipe in BLOCK_RECIPES]
    if rank == 0:
        out["rows"] = rows
    dist.destroy_process_group()


def table(rows: list[dict]) -> str:
    base = rows[0]["forward"]["all_gather"]
    lines = ["| plan | forward all-gather bytes / rank / step | vs bf16 | backward all-gather bytes | all-reduce bytes |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        ag = r["forward"]["all_gather"]
        reduce = r["forward"]["all_reduce"] + r["backward"]["all_reduce"]
        lines.append(f"| {r['config']} | {ag:,} | {ag / base:.4f} | {r['backward']['all_gather']:,} | {reduce:,} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--sequence", type=int, default=256)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/tp_bytes.md"))
    args = parser.parse_args(argv)

    out = mp.Manager().dict()
    mp.spawn(worker, args=(free_port(), args.width, args.sequence, args.depth, out), nprocs=WORLD)
    rows = out["rows"]
    notes = ("Bytes this rank contributes to all-gathers: forward (activations entering colwise regions) and backward\n"
             "(bf16 gradients leaving rowwise regions). All-reduce bytes: the agreed amaxes of per-tensor scales (and\n"
             "rowwise's column amaxes). By default block recipes send both FP8 copies (the bits of gathering in high\n"
             'precision); with fp8_all_gather="fprop" the forward copy alone, the weight-gradient copy re-quantized\n'
             "from it after the gather.\n")
    write_gloo_result(args.out, "tp_bytes", argv, "Sequence-parallel all-gather bytes per training step (measured)",
                      f"backend gloo, {WORLD} processes, bf16 model", notes, table(rows), rows)
    base = rows[0]["forward"]["all_gather"]
    met = [r["config"] for r in rows[1:] if r["forward"]["all_gather"] <= TARGET * base]
    print(f"FP8 forward all-gather <= {TARGET}x bf16: {', '.join(met) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
