"""Error of candidate optimizer-state formats on real AdamW states, against float64.

Which scale granularity do the moments need? This script trains the convergence benchmark's small GPT with
``torch.optim.AdamW`` (float32 states) for a few hundred steps, takes the real ``exp_avg`` (m) and
``exp_avg_sq`` (v) of every matrix the FP8 optimizer would quantize, and encodes/decodes them in each candidate
format. Everything is compared in float64 with the float32 state as the truth:

* ``rel_l2``       -- ``||decoded - x|| / ||x||``;
* ``flushed``      -- the fraction of non-zero entries that decode to zero (underflow);
* ``denom_p99``    -- for v only: the 99th percentile over elements of the relative error of Adam's denominator
  ``sqrt(v) + eps`` (eps = 1e-8), the quantity the update divides by;
* ``bytes/elem``   -- storage per element, scales included.

Candidates: block-scaled (128 elements, float32 scale, as shipped), the same blocks with a 1-byte E8M0
(power-of-two, rounded down so nothing saturates) scale, larger blocks, one scale per tensor, and, for v, FP16
without any scale. The per-tensor and E8M0 variants are evaluated here only (they are not state formats of the
optimizer); encode/decode of the shipped formats is ``fp8_lightning.optim.state_formats``.

Usage::

    python -m benchmarks optim-state-error --out benchmarks/results/optimizer_state_error.md
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F

from fp8_lightning.data import ByteTextDataModule
from fp8_lightning.models import GPT, warmup_cosine
from fp8_lightning.optim.state_formats import StateFormat, decode_state, encode_state, saturating_cast, state_block_scales

from benchmarks.bench_common import write_markdown_report

EPS = 1e-8


def pow2_block_roundtrip(x: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """Like ``encode_state``/``decode_state`` of ``fmt`` but with each block scale rounded down to a power of two (E8M0)."""
    x32 = x.float().reshape(-1)
    if fmt.transform == "sqrt":
        x32 = x32.clamp(min=0).sqrt()
    pad = -x32.numel() % fmt.block_size
    blocks = F.pad(x32, (0, pad)).view(-1, fmt.block_size)
    scale = torch.exp2(torch.floor(torch.log2(state_block_scales(blocks, fmt.torch_dtype))))
    data = saturating_cast(blocks * scale.unsqueeze(-1), fmt.torch_dtype)
    out = (data.float() / scale.unsqueeze(-1)).reshape(-1)[: x.numel()].reshape(x.shape)
    return out * out if fmt.transform == "sqrt" else out


def roundtrip(x: torch.Tensor, spec: str) -> tuple[torch.Tensor, float]:
    """decode_state(encode_state(x)) for a candidate ``spec`` and its bytes per element (scales included)."""
    if spec.endswith(":e8m0"):
        fmt = StateFormat.parse(spec.removesuffix(":e8m0"))
        return pow2_block_roundtrip(x, fmt), fmt.torch_dtype.itemsize + 1.0 / fmt.block_size
    if ":tensor" in spec:
        fmt = StateFormat.parse(spec.replace(":tensor", f":{x.numel()}"))
        data, scale = encode_state(x, fmt)
        return decode_state(data, scale, fmt, x.shape), float(fmt.torch_dtype.itemsize)
    fmt = StateFormat.parse(spec)
    data, scale = encode_state(x, fmt)
    return decode_state(data, scale, fmt, x.shape), fmt.bytes_per_element()


def errors(truth: torch.Tensor, decoded: torch.Tensor, second_moment: bool) -> dict:
    t, d = truth.double(), decoded.double()
    out = {"rel_l2": ((d - t).norm() / t.norm()).item(),
           "flushed": ((d == 0) & (t != 0)).double().sum().item() / max(1, (t != 0).sum().item())}
    if second_moment:
        denom_t, denom_d = t.clamp(min=0).sqrt() + EPS, d.clamp(min=0).sqrt() + EPS
        out["denom_p99"] = torch.quantile(((denom_d - denom_t).abs() / denom_t).float(), 0.99).item()
    return out


def trained_states(args) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    torch.manual_seed(args.seed)
    model = GPT(optimizer=functools.partial(torch.optim.AdamW, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1),
                vocab_size=256, block_size=64, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd)
    optimizer = model.configure_optimizers()
    scheduler = warmup_cosine(optimizer, warmup_steps=args.steps // 10, total_steps=args.steps, min_lr_ratio=0.1)
    data = ByteTextDataModule(block_size=64, batch_size=32, max_files=600, train_samples=args.steps * 32,
                              seed=args.seed)
    data.setup()
    for (inputs, targets), _ in zip(data.train_dataloader(), range(args.steps)):
        F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    return [(name, optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"])
            for name, p in model.named_parameters() if p.numel() >= 4096 and p in optimizer.state]


M_SPECS = ["e4m3:128", "e4m3:128:e8m0", "e4m3:1024", "e4m3:tensor"]
V_SPECS = ["fp16:0", "fp16:tensor", "fp16:128", "e4m3:128:sqrt", "e4m3:128:sqrt:e8m0", "e4m3:1024:sqrt",
           "e4m3:tensor:sqrt"]


def table(states, specs, index: int) -> list[str]:
    second = index == 2
    head = "| format | bytes/elem | rel. L2 error (mean / max over tensors) | flushed to zero (max) |"
    head += " denominator error p99 (max) |" if second else ""
    lines = [head, "|---|---:|---:|---:|" + ("---:|" if second else "")]
    for spec in specs:
        rows = []
        for entry in states:
            decoded, nbytes = roundtrip(entry[index], spec)
            rows.append(errors(entry[index], decoded, second))
        rel = [r["rel_l2"] for r in rows]
        line = (f"| `{spec}` | {nbytes:.3f} | {sum(rel) / len(rel):.4f} / {max(rel):.4f} | "
                f"{max(r['flushed'] for r in rows):.2%} |")
        if second:
            line += f" {max(r['denom_p99'] for r in rows):.4f} |"
        lines.append(line)
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    states = trained_states(args)
    text = "\n".join([
        f"States of {len(states)} matrices ({sum(m.numel() for _, m, _ in states):,} elements) of GPT "
        f"n_layer={args.n_layer}, n_embd={args.n_embd} after {args.steps} AdamW steps (lr {args.lr}, seed "
        f"{args.seed}, stdlib byte corpus). `:N` = one float32 scale per N elements, `:e8m0` = a 1-byte "
        "power-of-two scale, `:tensor` = one scale per tensor, `:0` = a plain cast, `:sqrt` = sqrt(v) stored.",
        "", "First moment m:", "", *table(states, M_SPECS, 1), "", "Second moment v:", "", *table(states, V_SPECS, 2),
        ""])
    print(text)
    if args.out:
        write_markdown_report(
            args.out, "Optimizer state formats: error on real AdamW states vs float64", "optimizer_state_error.py",
            argv, text,
        )


if __name__ == "__main__":
    main()
