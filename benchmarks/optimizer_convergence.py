"""Convergence of a small GPT on the standard-library byte corpus: FP8 optimizer states vs float32 AdamW.

Every run starts from the same seed (same initial weights, same training windows in the same order, same
validation windows) and differs only in how the AdamW states are stored:

* ``fp32``        -- ``torch.optim.AdamW`` (float32 moments): the reference;
* ``default``     -- ``FP8Optimizer(AdamW, "default")``: m in E4M3, sqrt(v) in E4M3, per-block (128) scales,
  bf16 weights get a 16-bit master (int8 remainder);
* ``max_savings`` -- ``FP8Optimizer(AdamW, "max_savings")``: the same moments, no master copy, bf16 weights
  rounded stochastically (``max_savings_stochastic`` names the same explicitly; ``max_savings_nearest`` rounds
  to nearest, which is what ``max_savings`` did before 2026-11-22 06:00 UTC);
* ``fp16_v_exact_master`` -- the earlier default: v in FP16 (per-block scales) and an exact float32 master
  (int16 remainder) for bf16 weights.

By default the model is float32 (so the master-weight choice does not enter: a float32 parameter is its own
master). ``--dtype bfloat16`` trains bf16 weights instead; the reference is then the classic mixed-precision
AdamW (float32 states and a float32 master copy), and ``default_no_master`` (``master_weights="param"``: bf16
weights are the only copy) shows what the exact master of the default preset buys.

The learning rate follows linear warm-up and cosine decay. Validation loss is the mean
cross-entropy (nats per byte) over fixed held-out windows, measured every ``--eval-every`` steps and at the end.
The criterion of the project: the default preset's final validation loss within 1% of the reference.

Usage::

    python -m benchmarks optim-convergence --out benchmarks/results/optimizer_convergence.md
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import torch
import torch.nn.functional as F

from fp8_lightning.data import ByteTextDataModule
from fp8_lightning.models import GPT, warmup_cosine
from fp8_lightning.optim import FP8Optimizer

from benchmarks.bench_common import loss_curve_table, write_markdown_report

# run name -> (FP8Optimizer preset, options); "fp32" is torch AdamW for float32 weights and, for bf16 weights,
# the classic mixed-precision reference: float32 states and a float32 master copy ("fp32" preset).
RUNS = {
    "fp32": (None, {}),
    "default": ("default", {}),
    "default_no_master": ("default", {"master_weights": "param"}),
    "default_exact_master": ("default", {"master_weights": "bf16_remainder"}),
    "fp16_v_exact_master": ("default", {"exp_avg_sq": "fp16:128", "master_weights": "bf16_remainder"}),
    # the default preset stepping each parameter in backward and freeing its gradient (needs --clip-grad-norm 0)
    "default_released": ("default", {"release": True}),
    # no master copy, but bf16 weights rounded stochastically (zero extra bytes)
    "max_savings_stochastic": ("max_savings", {"master_weights": "bf16_stochastic"}),
    "max_savings_nearest": ("max_savings", {"master_weights": "param"}),
    "max_savings": ("max_savings", {}),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build(args, run_name: str):
    torch.manual_seed(args.seed)
    model = GPT(
        optimizer=functools.partial(torch.optim.AdamW, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1),
        vocab_size=256, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
    ).to(DTYPES[args.dtype])
    optimizer = model.configure_optimizers()
    preset, options = RUNS[run_name]
    options = dict(options)
    release = options.pop("release", False)
    if preset is None and args.dtype != "float32":
        preset = "fp32"
    if preset is not None:
        optimizer = FP8Optimizer(optimizer, preset, **options)
    if release:
        if args.clip_grad_norm:
            raise SystemExit(f"run {run_name!r} releases gradients in backward: pass --clip-grad-norm 0.")
        optimizer.release_gradients_in_backward()
    scheduler = warmup_cosine(getattr(optimizer, "optimizer", optimizer),
                              warmup_steps=args.steps // 10, total_steps=args.steps, min_lr_ratio=0.1)
    return model, optimizer, scheduler


@torch.no_grad()
def evaluate(model, val_batches) -> float:
    model.eval()
    total, count = 0.0, 0
    for inputs, targets in val_batches:
        logits = model(inputs)
        total += F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum").item()
        count += targets.numel()
    model.train()
    return total / count


def run(args, preset: str, train_batches, val_batches) -> dict:
    model, optimizer, scheduler = build(args, preset)
    curve, train_losses = [], []
    start = time.perf_counter()
    for step, (inputs, targets) in enumerate(train_batches, start=1):
        loss = F.cross_entropy(model(inputs).float().flatten(0, 1), targets.flatten())
        loss.backward()
        if args.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        train_losses.append(loss.item())
        if step % args.eval_every == 0 or step == args.steps:
            curve.append((step, evaluate(model, val_batches)))
            print(f"  {preset:12s} step {step:4d}  train {sum(train_losses[-50:]) / len(train_losses[-50:]):.4f}"
                  f"  val {curve[-1][1]:.4f}", flush=True)
    return {"preset": preset, "curve": curve, "final_val": curve[-1][1], "seconds": time.perf_counter() - start,
            "final_train_avg50": sum(train_losses[-50:]) / 50}


def data(args):
    module = ByteTextDataModule(block_size=args.block_size, batch_size=args.batch_size, max_files=args.max_files,
                                train_samples=args.steps * args.batch_size, max_val_windows=args.val_windows,
                                seed=args.seed)
    module.setup()
    train = [batch for batch, _ in zip(module.train_dataloader(), range(args.steps))]
    val = list(module.val_dataloader())
    return train, val, module.stats


def report(args, results, stats, argv) -> str:
    ref = results[0]["final_val"]
    lines = [
        "| optimizer states | final val loss (nats/byte) | gap vs the fp32 reference | time (s) |",
        "|---|---:|---:|---:|",
    ]
    for r in results:
        gap = 100.0 * (r["final_val"] - ref) / ref
        lines.append(f"| {r['preset']} | {r['final_val']:.4f} | {gap:+.2f}% | {r['seconds']:.0f} |")
    curves = loss_curve_table({r["preset"]: r["curve"] for r in results})
    setup = (
        f"GPT n_layer={args.n_layer}, n_embd={args.n_embd}, n_head={args.n_head}, block_size={args.block_size}, "
        f"{args.dtype} weights; "
        f"batch {args.batch_size}; {args.steps} steps; AdamW lr={args.lr} (warm-up 10%, cosine to 10%), betas "
        f"(0.9, 0.95), weight decay 0.1 on matrices, grad-norm clip {args.clip_grad_norm or 'off'}; seed {args.seed}; "
        "data: stdlib .py bytes "
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
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--max-files", type=int, default=600)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a busy 2-core host)")
    parser.add_argument("--val-windows", type=int, default=256)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--runs", nargs="+", default=["fp32", "default", "max_savings"], choices=list(RUNS))
    parser.add_argument("--clip-grad-norm", type=float, default=1.0, help="0 turns clipping off")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES), help="dtype of the model's weights")
    parser.add_argument("--out", help="write the result (markdown, with command, machine and date) here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    train_batches, val_batches, stats = data(args)
    results = [run(args, preset, train_batches, val_batches) for preset in args.runs]
    text = report(args, results, stats, argv)
    print(text)
    if args.out:
        write_markdown_report(
            args.out, "Optimizer convergence: FP8 states vs float32 AdamW", "optimizer_convergence.py", argv, text
        )
        with open(args.out.rsplit(".", 1)[0] + ".json", "w") as f:
            json.dump({"args": vars(args), "results": results, "stats": stats}, f, indent=1)


if __name__ == "__main__":
    main()
