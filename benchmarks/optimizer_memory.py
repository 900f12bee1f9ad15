"""Bytes per parameter actually held by a GPT's weights, gradients, optimizer states and master weights.

What is counted: every distinct tensor *storage* (``untyped_storage().nbytes()``, deduplicated by address, so
tied weights count once and views never count twice) reachable from

* the model's parameters (``model.parameters()``),
* their gradients (``p.grad``),
* the optimizer state (``optimizer.state``: moments, block scales, master copies or remainders, step counters),

divided by the number of model parameters. Nothing is computed from formulas: padding of the last block,
scales, per-parameter counters and full-precision states of small tensors are all in the count.

Two moments of a training step are reported:

* **at the step** -- right after ``optimizer.step()`` and before ``zero_grad``: weights + gradients + states.
  This is the peak of the model-state memory of a step.
* **between steps** -- after ``zero_grad(set_to_none=True)`` (what Lightning does): weights + states; the
  gradients are freed and come back during the next backward.

With ``release_gradients_in_backward()`` each parameter is stepped, and its gradient freed, as soon as backward
has produced it; the gradient column then counts the largest total of gradient storage alive at any moment of
the backward pass (recorded by hooks), not zero.

Activations, temporaries of the step (one parameter's float32 working copy) and allocator caching are not part
of either number.

Usage::

    python -m benchmarks optim-memory                      # GPT n_layer=6, n_embd=512 (~19M params)
    python -m benchmarks optim-memory --n-layer 12 --n-embd 768 --out benchmarks/results/optimizer_memory.md
"""

from __future__ import annotations

import argparse
import functools

import torch

from fp8_lightning.models import GPT
from fp8_lightning.optim import FP8Optimizer

from benchmarks.bench_common import write_markdown_report

SCENARIOS = [
    # (label, parameter dtype, preset or None for plain torch AdamW, FP8 options)
    ("torch AdamW, fp32 weights", torch.float32, None, {}),
    ("fp32 preset, bf16 weights + fp32 master (classic mixed precision)", torch.bfloat16, "fp32", {}),
    ("default, fp32 weights", torch.float32, "default", {}),
    ("default, bf16 weights (+ int8 remainder = 16-bit master)", torch.bfloat16, "default", {}),
    ("max_savings, bf16 weights (no master, stochastic rounding)", torch.bfloat16, "max_savings", {}),
    ("max_savings, fp32 weights", torch.float32, "max_savings", {}),
    ("default, bf16 weights (+ int8 remainder), gradients released in backward", torch.bfloat16, "default",
     {"release": True}),
    ("default + exact master (int16 remainder), bf16 weights, gradients released in backward", torch.bfloat16,
     "default", {"master_weights": "bf16_remainder", "release": True}),
    ("earlier default: FP16 v + int16 remainder, bf16 weights, gradients released in backward", torch.bfloat16,
     "default", {"exp_avg_sq": "fp16:128", "master_weights": "bf16_remainder", "release": True}),
    ("FP16 v + int8 remainder, bf16 weights, gradients released in backward", torch.bfloat16, "default",
     {"exp_avg_sq": "fp16:128", "release": True}),
    ("max_savings, bf16 weights, gradients released in backward", torch.bfloat16, "max_savings", {"release": True}),
]


def storages(tensors) -> dict[int, int]:
    """``{storage address: nbytes}`` of the given tensors (DTensors counted by their local shard)."""
    found = {}
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        storage = t.untyped_storage()
        found[storage.data_ptr()] = storage.nbytes()
    return found


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())
    weights = storages(params)
    grads = storages(p.grad for p in params)
    state = storages(v for s in optimizer.state.values() for v in s.values())
    for key in weights:  # a float32 parameter that is its own master is not counted twice
        state.pop(key, None)
    return {"weights": sum(weights.values()), "grads": sum(grads.values()), "state": sum(state.values())}


def record_peak_gradients(model: torch.nn.Module) -> dict:
    """Hooks that record the largest total of gradient storage alive at any gradient accumulation.

    Registered before the optimizer's release hooks, so each one sees its parameter's gradient still alive.
    """
    params, peak = list(model.parameters()), {"bytes": 0}

    def record(_param):
        peak["bytes"] = max(peak["bytes"], sum(storages(p.grad for p in params).values()))

    for param in params:
        param.register_post_accumulate_grad_hook(record)
    return peak


def measure(label, dtype, preset, options, args) -> dict:
    torch.manual_seed(0)
    model = GPT(
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-4, weight_decay=0.1),
        vocab_size=256, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
    ).to(dtype)
    optimizer = model.configure_optimizers()
    options = dict(options)
    release = options.pop("release", False)
    if preset is not None:
        optimizer = FP8Optimizer(optimizer, preset, **options)
    peak_grads = record_peak_gradients(model) if release else None
    if release:
        optimizer.release_gradients_in_backward()
    tokens = torch.randint(0, 256, (2, 65))
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    at_step = held_bytes(model, optimizer)
    if release:  # no gradient is left after backward: count the most that were alive at once during it
        at_step["grads"] = peak_grads["bytes"]
    optimizer.zero_grad(set_to_none=True)
    between = held_bytes(model, optimizer)
    n = sum(p.numel() for p in model.parameters())
    return {
        "label": label,
        "n_params": n,
        "weights": at_step["weights"] / n,
        "grads": at_step["grads"] / n,
        "state": at_step["state"] / n,
        "at_step": sum(at_step.values()) / n,
        "between": sum(between.values()) / n,
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| configuration | weights | gradients | optimizer state + master | **at the step** | between steps |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['weights']:.2f} | {r['grads']:.2f} | {r['state']:.2f} | **{r['at_step']:.2f}** "
            f"| {r['between']:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--out", help="write the table (markdown, with command, machine and date) here")
    args = parser.parse_args(argv)
    rows = [measure(*scenario, args) for scenario in SCENARIOS]
    header = (
        f"GPT n_layer={args.n_layer}, n_embd={args.n_embd}, vocab 256, block_size={args.block_size}: "
        f"{rows[0]['n_params']:,} parameters. Bytes per parameter (real tensor storage, see the script's docstring)."
    )
    text = f"{header}\n\n{table(rows)}\n"
    print(text)
    if args.out:
        write_markdown_report(args.out, "Optimizer memory: bytes held per parameter", "optimizer_memory.py", argv, text)


if __name__ == "__main__":
    main()
