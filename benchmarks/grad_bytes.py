"""Bytes moved by gradient communication per training step: float32, bf16 and FP8, for DDP and FSDP2.

Two gloo processes on CPU (``torch.multiprocessing``) run one backward of the stack of blocks that
``allgather_bytes.py`` uses (LayerNorm, Linear up, GELU, Linear down; biases and norms included), and count the
bytes this rank puts on the wire at the ``torch.distributed`` calls, with the usual per-rank costs of each
collective (:class:`WireBytes`): ring all-reduce ``2(w-1)/w x size``, all-to-all and reduce-scatter
``(w-1)/w x input``, all-gather ``(w-1) x input``. FP8 counts its scales (the agreed block amaxes and the
factor each owner sends back).

* DDP: a float32 all-reduce hook and a bf16 one (cast, all-reduce, divide: what torch's ``bf16_compress_hook``
  does, which refuses gloo), against ``fp8_compress_hook``.
* FSDP2: the gradient reduce-scatter in float32 and in bf16 (``MixedPrecisionPolicy(reduce_dtype=bf16)``)
  against ``FP8ReduceScatter`` (the parameter all-gathers are left out: they are the same in the three runs).

The time column is the median wall-clock of the backward (reduction included) over a few steps on this machine,
where the "network" is loopback: it shows what the FP8 encoding costs in compute, not what a slow link saves.

Usage::

    python -m benchmarks grad-bytes [--width 256] [--depth 4] [--out benchmarks/results/grad_bytes.md]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.multiprocessing as mp

from benchmarks.allgather_bytes import Stack
from benchmarks.bench_common import write_markdown_report
from fp8_lightning.distributed import FP8CommState, enable_fp8_reduce_scatter, fp8_compress_hook
from fp8_lightning.testing import WireBytes, bf16_hook, end_worker, fp32_hook, free_port, init_gloo

WORLD = 2


def ddp_model(model: torch.nn.Module, comm: str):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model)
    hooks = {"fp32": (None, fp32_hook), "bf16": (None, bf16_hook), "fp8": (FP8CommState(), fp8_compress_hook)}
    ddp.register_comm_hook(*hooks[comm])
    return ddp


def fsdp_model(model: torch.nn.Module, comm: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16 if comm == "bf16" else None)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    if comm == "fp8":
        enable_fp8_reduce_scatter(model)
    return model


def measure(kind: str, comm: str, rank: int, width: int, depth: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = (ddp_model if kind == "ddp" else fsdp_model)(Stack(width, depth, bias=True), comm)
    x = torch.randn(64, width, generator=torch.Generator().manual_seed(rank))
    with WireBytes() as wire:
        model(x).square().mean().backward()
    counted = {k: v for k, v in wire.bytes.items() if kind == "ddp" or not k.startswith("all_gather")}
    seconds = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        start = time.perf_counter()
        loss.backward()
        seconds.append(time.perf_counter() - start)
    return {"bytes": sum(counted.values()), "by_call": counted, "backward_ms": 1e3 * statistics.median(seconds),
            "gradient_elements": sum(p.numel() for p in Stack(width, depth, bias=True).parameters())}


def worker(rank: int, port: int, width: int, depth: int, steps: int, out: dict) -> None:
    init_gloo(rank, WORLD, port)
    rows = {(kind, comm): measure(kind, comm, rank, width, depth, steps)
            for kind in ("ddp", "fsdp") for comm in ("fp32", "bf16", "fp8")}
    if rank == 0:
        out.update(rows)
    end_worker()


def table(rows: dict) -> str:
    lines = []
    for kind, title in (("ddp", "DDP gradient all-reduce (communication hook)"),
                        ("fsdp", "FSDP2 gradient reduce-scatter")):
        fp32, bf16 = rows[kind, "fp32"]["bytes"], rows[kind, "bf16"]["bytes"]
        lines += [f"{title}, {rows[kind, 'fp32']['gradient_elements']:,} gradient elements:", "",
                  "| gradients | bytes / rank / step | vs fp32 | vs bf16 | by call | backward (ms) |",
                  "|---|---:|---:|---:|---|---:|"]
        for comm in ("fp32", "bf16", "fp8"):
            r = rows[kind, comm]
            calls = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(r["by_call"].items()))
            lines.append(f"| {comm} | {r['bytes']:,.0f} | {r['bytes'] / fp32:.4f} | {r['bytes'] / bf16:.4f} | "
                         f"{calls} | {r['backward_ms']:.1f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5, help="timed backward passes (median reported)")
    parser.add_argument("--out", help="write the table (markdown, with command, machine and date) here")
    args = parser.parse_args(argv)
    out = mp.Manager().dict()
    mp.spawn(worker, args=(free_port(), args.width, args.depth, args.steps, out), nprocs=WORLD)
    text = (f"{WORLD} gloo processes on one machine (loopback), one torch thread each; stack of {args.depth} "
            f"blocks of width {args.width}, batch 64 per rank.\n\n" + table(dict(out)))
    print(text)
    if args.out:
        write_markdown_report(args.out, "Gradient communication bytes per training step (measured)",
                              "grad_bytes.py", argv, text)


if __name__ == "__main__":
    main()
