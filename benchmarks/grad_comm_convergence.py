"""Convergence with FP8 gradient communication: a small GPT on the standard-library byte corpus, 2 processes.

Four runs from the same seed (same initial weights, same global batches, each rank taking its half, same
validation windows); they differ only in how gradients are averaged over the 2 gloo processes:

* ``ddp``       -- DistributedDataParallel, float32 all-reduce (the reference for ``ddp_fp8``);
* ``ddp_fp8``   -- the same with ``register_comm_hook(FP8CommState(), fp8_compress_hook)``;
* ``fsdp``      -- FSDP2 (``fully_shard`` per block and at the root), float32 reduce-scatter;
* ``fsdp_fp8``  -- the same with ``set_custom_reduce_scatter(FP8ReduceScatter())`` on every FSDP module.

The model is float32 (its GEMMs are not FP8), so the gap is the gradient communication's alone. AdamW with
linear warm-up and cosine decay, grad-norm clipping at 1.0. Validation loss is the mean cross-entropy (nats
per byte) over fixed held-out windows. The criterion: each FP8 run's final validation loss within 1% of its
float32 reference.

Usage::

    python -m benchmarks grad-comm --out benchmarks/results/grad_comm_convergence.md
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from benchmarks.bench_common import loss_curve_table, write_markdown_report
from benchmarks.optimizer_convergence import data, evaluate
from fp8_lightning.distributed import FP8CommState, FP8ReduceScatter, fp8_compress_hook
from fp8_lightning.models import GPT, warmup_cosine
from fp8_lightning.testing import end_worker, free_port, init_gloo

RUNS = ("ddp", "ddp_fp8", "fsdp", "fsdp_fp8")
WORLD = 2


def wrap(model: GPT, run: str):
    """The model as the run trains it: DDP (with or without the FP8 hook) or FSDP2 (with or without FP8)."""
    if run.startswith("ddp"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model)
        if run == "ddp_fp8":
            ddp.register_comm_hook(FP8CommState(), fp8_compress_hook)
        return ddp
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    if run == "fsdp_fp8":
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(FP8ReduceScatter())
    return model


def worker(rank: int, args, run: str, port: int, train, val, out) -> None:
    init_gloo(rank, WORLD, port)
    torch.manual_seed(args.seed)
    model = GPT(
        optimizer=functools.partial(torch.optim.AdamW, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1),
        vocab_size=256, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
    )
    trained = wrap(model, run)
    optimizer = model.configure_optimizers()
    scheduler = warmup_cosine(optimizer, warmup_steps=args.steps // 10, total_steps=args.steps, min_lr_ratio=0.1)
    curve, start = [], time.perf_counter()
    for step, (inputs, targets) in enumerate(train, start=1):
        inputs, targets = inputs.chunk(WORLD)[rank], targets.chunk(WORLD)[rank]
        loss = F.cross_entropy(trained(inputs).float().flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if step % args.eval_every == 0 or step == args.steps:
            curve.append((step, evaluate(model, val)))
            if rank == 0:
                print(f"  {run:9s} step {step:4d}  val {curve[-1][1]:.4f}", flush=True)
    if rank == 0:
        out[run] = {"run": run, "curve": curve, "final_val": curve[-1][1], "seconds": time.perf_counter() - start}
    dist.barrier()
    end_worker()


def report(args, results: dict, stats: dict) -> str:
    lines = ["| gradients | final val loss (nats/byte) | gap vs float32 | time (s) |", "|---|---:|---:|---:|"]
    for run in args.runs:
        r = results[run]
        reference = results.get(run.removesuffix("_fp8"))
        gap = f"{100.0 * (r['final_val'] - reference['final_val']) / reference['final_val']:+.2f}%" if reference else "-"
        lines.append(f"| {run} | {r['final_val']:.4f} | {gap if run.endswith('_fp8') else '(reference)'} | "
                     f"{r['seconds']:.0f} |")
    curves = loss_curve_table({run: results[run]["curve"] for run in args.runs})
    setup = (
        f"GPT n_layer={args.n_layer}, n_embd={args.n_embd}, n_head={args.n_head}, block_size={args.block_size}, "
        f"float32 weights; global batch {args.batch_size} over {WORLD} gloo processes; {args.steps} steps; AdamW "
        f"lr={args.lr} (warm-up 10%, cosine to 10%), betas (0.9, 0.95), weight decay 0.1 on matrices, grad-norm "
        f"clip 1.0; seed {args.seed}; FP8: E4M3 codes, 4096-element blocks (the defaults); data: stdlib .py bytes "
        f"({stats.get('train_files')} train files, {stats.get('val_files')} val files, up to {args.val_windows} "
        "val windows). Times are wall-clock on a shared machine and only indicative."
    )
    return "\n".join([setup, "", *lines, "", "Validation loss during training:", "", *curves, ""])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32, help="global batch (each rank takes half)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--max-files", type=int, default=600)
    parser.add_argument("--val-windows", type=int, default=256)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=RUNS)
    parser.add_argument("--out", help="write the result (markdown, with command, machine and date) here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    train, val, stats = data(args)
    results = mp.Manager().dict()
    for run in args.runs:
        mp.spawn(worker, args=(args, run, free_port(), train, val, results), nprocs=WORLD)
    results = dict(results)
    text = report(args, results, stats)
    print(text)
    if args.out:
        write_markdown_report(args.out, "Convergence with FP8 gradient communication (2 processes)",
                              "grad_comm_convergence.py", argv, text)
        with open(args.out.rsplit(".", 1)[0] + ".json", "w") as f:
            json.dump({"args": vars(args), "results": results, "stats": stats}, f, indent=1)


if __name__ == "__main__":
    main()
