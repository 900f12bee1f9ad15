"""Bytes moved by FSDP2 weight all-gathers per training step: FP8 (every recipe) versus fp32 and bf16.

Two gloo processes on CPU (``torch.multiprocessing``) train one step of a small transformer-like stack of
blocks (LayerNorm, Linear up, GELU, Linear down) sharded per block with ``fully_shard``. The bytes are counted
at the ``torch.distributed`` call FSDP2 makes (``all_gather_single`` / ``all_gather_into_tensor``: the tensor this
rank contributes), for the forward gathers and the backward re-gathers. Other collectives of the step are
counted apart: the amax all-reduces of the FP8 scales (``all_reduce``) and the gradient reduce-scatters.

Three models:

* ``weights`` has no biases and no norm parameters, so an all-gather carries Linear weights only: the ratio of
  the FP8 wire format itself (1 byte per element, plus 1/32 byte of E8M0 scales for MXFP8; NVFP4: half a byte of
  E2M1 codes plus one E4M3 scale per 16x16 tile, or per 1x16 block with ``fp4_2d_weights=False``).
* ``full`` has biases and LayerNorm parameters; under FP8 they travel in ``param_dtype`` next to the FP8 weights
  (float32 unless a bf16 ``MixedPrecisionPolicy`` is set), which is what a real run moves.
* ``experts`` stacks mixture-of-experts blocks (``GroupedExperts``: fused 3-D SwiGLU expert weights, no biases),
  sharded per block: the fused expert weights gathered in FP8 by every recipe (per-expert scales or blocks; NVFP4
  as each expert's E2M1 codes and E4M3 scales), the tokens routed to the experts unevenly (one expert gets none).

Usage::

    python -m benchmarks allgather-bytes [--width 256] [--depth 4] [--out benchmarks/results/allgather_bytes.md]

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
from fp8_lightning.testing import CollectiveCounter, free_port

WORLD = 2
CONFIGS = [  # (name, FP8 recipe or None, FP8 all-gather, FSDP2 param_dtype)
    ("fp32", None, False, None),
    ("bf16", None, False, torch.bfloat16),
    ("fp8 tensorwise", "tensorwise", True, None),
    ("fp8 delayed", "delayed", True, None),
    ("fp8 mxfp8", "mxfp8", True, None),
    ("fp8 tensorwise + bf16 params", "tensorwise", True, torch.bfloat16),
    ("fp8 mxfp8 + bf16 params", "mxfp8", True, torch.bfloat16),
    ("fp4 nvfp4", "nvfp4", True, None),  # 16x16 weight tiles (the default)
    ("fp4 nvfp4 1x16 blocks", {"name": "nvfp4", "fp4_2d_weights": False}, True, None),
    ("fp4 nvfp4 + bf16 params", "nvfp4", True, torch.bfloat16),
]

EXPERT_CONFIGS = [
    ("fp32", None, False, None),
    ("bf16", None, False, torch.bfloat16),
    *((f"fp8 {r}", r, True, None) for r in ("tensorwise", "delayed", "rowwise", "blockwise", "mxfp8")),
    ("fp4 nvfp4", "nvfp4", True, None),  # each expert's 16x16 tiles, its own global scale
    ("fp4 nvfp4 1x16 blocks", {"name": "nvfp4", "fp4_2d_weights": False}, True, None),
    ("fp8 mxfp8 + bf16 params", "mxfp8", True, torch.bfloat16),
]
EXPERTS = 8
MODELS = {"weights": CONFIGS, "full": CONFIGS, "experts": EXPERT_CONFIGS}


class Block(nn.Module):
    def __init__(self, width: int, bias: bool):
        super().__init__()
        self.norm = nn.LayerNorm(width, elementwise_affine=bias)
        self.up = nn.Linear(width, 4 * width, bias=bias)
        self.down = nn.Linear(4 * width, width, bias=bias)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, width: int, depth: int, bias: bool):
        super().__init__()
        self.blocks = nn.ModuleList([Block(width, bias) for _ in range(depth)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class ExpertsStack(nn.Module):
    """Residual blocks of fused experts; the tokens' routing is fixed and uneven (an empty expert)."""

    def __init__(self, width: int, depth: int):
        from fp8_lightning.grouped.experts import GroupedExperts

        super().__init__()
        self.blocks = nn.ModuleList([GroupedExperts(width, 2 * width, EXPERTS) for _ in range(depth)])

    def forward(self, x):
        sizes = torch.tensor([0, 2, 4, 2, 8, 4, 6, 6]) * x.shape[0] // 32
        offs = torch.cumsum(sizes, 0, dtype=torch.int32)
        for block in self.blocks:
            x = x + block(x, offs)
        return x


def one_step(model_kind: str, config, rank: int, width: int, depth: int) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fp8_lightning import convert_to_fp8, fp8_autocast, recipe_from, sync_scales
    from fp8_lightning.distributed import enable_fp8_all_gather, shard_model

    name, recipe, fp8_gather, param_dtype = config
    torch.manual_seed(0)
    model = ExpertsStack(width, depth) if model_kind == "experts" else Stack(width, depth, bias=model_kind == "full")
    if recipe is not None:
        convert_to_fp8(model, recipe_from(recipe), layers={"last": 0})  # no NVFP4 high-precision tail
        if fp8_gather:
            enable_fp8_all_gather(model, WORLD)
    shard_model(model, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, width)
    with fp8_autocast(enabled=recipe is not None):  # warm-up step: lazy init and first-use scales
        model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    sync_scales(model)
    with CollectiveCounter() as counter:  # the measured step
        with fp8_autocast(enabled=recipe is not None):
            model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sync_scales(model)
    weights = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    return {"config": name, "model": model_kind, "bytes": counter.bytes, "calls": counter.calls, "weights": weights}


def worker(rank: int, port: int, width: int, depth: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    rows = [one_step(kind, config, rank, width, depth) for kind, configs in MODELS.items() for config in configs]
    if rank == 0:
        out["rows"] = rows
    dist.destroy_process_group()


def table(rows: list[dict]) -> str:
    lines = []
    for kind, what in (("weights", "Linear weight"), ("full", "Linear weight"), ("experts", "expert weight")):
        base = {r["config"]: r["bytes"]["all_gather"] for r in rows if r["model"] == kind}
        lines += [
            f"\nModel `{kind}` ({next(r['weights'] for r in rows if r['model'] == kind):,} {what} elements):\n",
            "| all-gather | bytes / rank / step | vs fp32 | vs bf16 | all-reduce bytes | reduce-scatter bytes |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for r in (r for r in rows if r["model"] == kind):
            ag = r["bytes"]["all_gather"]
            lines.append(
                f"| {r['config']} | {ag:,} | {ag / base['fp32']:.4f} | {ag / base['bf16']:.4f} | "
                f"{r['bytes']['all_reduce']:,} | {r['bytes']['reduce_scatter']:,} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/allgather_bytes.md"))
    args = parser.parse_args(argv)

    out = mp.Manager().dict()
    mp.spawn(worker, args=(free_port(), args.width, args.depth, out), nprocs=WORLD)
    rows = out["rows"]
    notes = (
        "Bytes this rank contributes to all-gathers in one training step (forward gathers + backward re-gathers),\n"
        "counted at the torch.distributed call FSDP2 makes. All-reduce bytes: FP8 scale agreement (weight amaxes\n"
        "once per step; input/gradient amaxes of delayed scaling). Reduce-scatter: gradients, in param_dtype.\n"
        "NVFP4 sends half a byte of E2M1 codes per element plus its E4M3 scales: one per 16x16 weight tile by\n"
        "default (1/256 byte per element: 0.252x bf16), one per 1x16 block with fp4_2d_weights=False (1/16 byte:\n"
        "0.281x bf16); its float32 global scale is agreed by the weight-amax all-reduce and never gathered.\n"
        "Experts: NVFP4 expert weights gather as each expert's codes and E4M3 scales (its 16x16 tiles, 1/256\n"
        "byte per element, or its 1x16 blocks), every expert's global scale agreed in the one amax all-reduce.\n"
    )
    write_gloo_result(args.out, "allgather_bytes", argv, "FSDP2 weight all-gather bytes per training step (measured)",
                      f"backend gloo, {WORLD} processes", notes, table(rows), rows)
    ok = True
    for kind in ("weights", "experts"):
        measured = {r["config"]: r["bytes"]["all_gather"] for r in rows if r["model"] == kind}
        fits = all(
            measured[name] <= 0.52 * measured["bf16"] and measured[name] <= 0.26 * measured["fp32"]
            for name in measured if name.startswith(("fp8", "fp4"))
        )
        print(f"FP8/FP4 <= 0.52x bf16 and <= 0.26x fp32 for {kind}:", "yes" if fits else "NO")
        ok = ok and fits
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
