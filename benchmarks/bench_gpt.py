"""End-to-end GPT training step: tokens/s, step-time ratio and peak memory for each precision.

One training step = forward, cross-entropy loss, backward, AdamW step, ``zero_grad`` and (FP8) the once-per-step
``sync_scales``: what ``Trainer(precision="fp8-...")`` runs per batch, without the Trainer's bookkeeping. All
precisions of one model are built first and run interleaved (see ``bench_common``); the ratio column divides
by the reference precision of the same run (fp32 on CPU, bf16 on GPU).

* ``--suite cpu``: GPTs of 2 layers and 4 x 128 tokens per step, n_embd 64 (``dim64``), 128 (``gpt_tiny``, the
  shape of ``conf/model/gpt_tiny.yaml``, the CPU default) and 256 (``dim256``), and the step ``make train`` runs
  (``make_train``: ``gpt_tiny`` with the default data's 16 x 128 tokens), one thread; ``--models dim512`` runs a
  wider one (slow: CPU bf16 matmuls). FP8 is emulated on a CPU (exact FP8 values, float32 GEMMs); the
  ratio is the emulation's cost. Peak memory is not measured on CPU (no allocator statistics); see
  ``bench_memory``.
* ``--suite gpu``: GPT ``350M`` (24 layers, n_embd 1024, 16 heads, 8 x 1024 tokens, vocab 50304), bf16 autocast
  around everything that is not an FP8 GEMM; peak memory from ``torch.cuda.max_memory_allocated``; the host time
  per step (until the step returns, unsynchronized: whether the host or the GPU sets the pace); ``--compile``
  compiles every configuration with the same settings. ``--models llama3_8b_x4``: four Llama-3-8B-shaped decoder
  layers (``fp8_lightning.testing.LlamaStack``) on 8 x 1024 tokens of random hidden states with a mean-square loss, the shapes
  torchao publishes its float8 speed-ups for; targets printed: FP8 >= 1.3x bf16 and >= torchao.float8.

Both suites run torchao.float8 (tensorwise, every linear layer converted, as ours) as a peer when it is installed
(``pip install -e '.[peer]'``; on a CPU it runs ``torch._scaled_mm``'s CPU float8 GEMM).

Usage::

    python -m benchmarks gpt --suite cpu
    python -m benchmarks gpt --suite gpu --compile
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F

from benchmarks.bench_common import bar_plot, header, interleaved_medians, markdown_table, run_folder, write_results
from benchmarks.bench_linear import torchao_status

from fp8_lightning import convert_to_fp8, fp8_autocast, sync_scales
from fp8_lightning.models import GPT
from fp8_lightning.testing import LLAMA3_8B, LlamaStack, versus_torchao

MODELS = {
    "dim64": dict(n_layer=2, n_embd=64, n_head=4, block_size=128, vocab_size=256, batch=4),
    "gpt_tiny": dict(n_layer=2, n_embd=128, n_head=4, block_size=128, vocab_size=256, batch=4),
    "make_train": dict(n_layer=2, n_embd=128, n_head=4, block_size=128, vocab_size=256, batch=16),
    "dim256": dict(n_layer=2, n_embd=256, n_head=4, block_size=128, vocab_size=256, batch=4),
    "dim512": dict(n_layer=2, n_embd=512, n_head=8, block_size=128, vocab_size=256, batch=4),
    "350M": dict(n_layer=24, n_embd=1024, n_head=16, block_size=1024, vocab_size=50304, batch=8),
    # Llama-shaped decoder stacks (no vocabulary: hidden states in, mean-square loss out)
    "llama3_8b_x4": dict(n_layer=4, **LLAMA3_8B, block_size=1024, batch=8),
    "llama_tiny": dict(n_layer=2, n_embd=64, n_head=4, n_kv_head=2, ffn=224, block_size=64, batch=2),
}
LLAMA_KEYS = ("n_layer", "n_embd", "n_head", "n_kv_head", "ffn")
SUITES = {"cpu": ["dim64", "gpt_tiny", "dim256", "make_train"], "gpu": ["350M"]}
RECIPES = ["delayed", "tensorwise", "mxfp8"]


def build(spec: dict, device: torch.device, precision: str, compile_: bool):
    """(step function, model) for one precision: "fp32", "bf16", "fp8 <recipe>" or "torchao tensorwise"."""
    torch.manual_seed(0)
    llama = "ffn" in spec
    if llama:
        model = LlamaStack(**{k: spec[k] for k in LLAMA_KEYS}).to(device)
    else:
        dims = {k: v for k, v in spec.items() if k != "batch"}
        model = GPT(optimizer=functools.partial(torch.optim.AdamW, lr=1e-4), **dims).to(device)
    fp8 = precision.startswith("fp8")
    if fp8:
        convert_to_fp8(model, precision.split()[1], profitability=False)
    if precision.startswith("torchao"):
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model)  # every linear layer, as convert_to_fp8 above
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4) if llama else model.configure_optimizers()
    forward = torch.compile(model) if compile_ else model
    autocast = precision != "fp32" and (device.type == "cuda" or precision == "bf16")
    if llama:
        hidden = torch.randn(spec["batch"], spec["block_size"], spec["n_embd"], device=device)
    else:
        tokens = torch.randint(0, spec["vocab_size"], (spec["batch"], spec["block_size"] + 1), device=device)

    def loss_of_step():
        with torch.autocast(device.type, torch.bfloat16, enabled=autocast), fp8_autocast(enabled=fp8):
            if llama:
                return forward(hidden).float().pow(2).mean()
            logits = forward(tokens[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())

    def step():
        loss_of_step().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if fp8:
            sync_scales(model)

    return step, model


def peak_memory(step, device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) / 2**30


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=sorted(SUITES), default="gpu" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", nargs="*", choices=sorted(MODELS), help="override the suite's models")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (the CPU suite uses 1)")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--out", help="run folder (default benchmarks/results/perf-gpt-<device>-<date>)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if args.suite == "gpu" else "cpu")
    threads_before = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    head = header("gpt", device, argv)
    head["torchao"] = torchao_status()
    reference = "bf16" if device.type == "cuda" else "fp32"
    precisions = ["fp32", "bf16"] + [f"fp8 {r}" for r in RECIPES]
    if head["torchao"] == "installed":
        precisions.append("torchao tensorwise")
    rows = []
    for name in args.models or SUITES[args.suite]:
        spec = MODELS[name]
        built = {p: build(spec, device, p, args.compile) for p in precisions}
        host: dict = {}
        medians = interleaved_medians({p: s for p, (s, _) in built.items()}, device, args.warmup, args.rounds, host)
        tokens = spec["batch"] * spec["block_size"]
        params = built["fp32"][1].num_parameters()
        for p, seconds in medians.items():
            rows.append({
                "model": name, "params": params, "tokens_per_step": tokens, "precision": p,
                "step_ms": seconds * 1e3, "tokens_per_s": tokens / seconds,
                "ratio": seconds / medians[reference], "peak_gib": peak_memory(built[p][0], device),
                "host_ms": host[p] * 1e3 if device.type == "cuda" else None,
            })  # fmt: skip
        del built
    torch.set_num_threads(threads_before)
    folder = run_folder("gpt", device, args.out)
    columns = [("model", "model", "{}"), ("params", "parameters", "{:,}"), ("precision", "precision", "{}"),
               ("step_ms", "step ms (median)", "{:.1f}"), ("tokens_per_s", "tokens/s", "{:,.0f}"),
               ("ratio", f"step time / {reference}", "{:.2f}"), ("peak_gib", "peak GiB", "{:.2f}"),
               ("host_ms", "host ms", "{:.1f}")]  # fmt: skip
    threads = f", {args.threads} CPU thread(s)" if device.type == "cpu" else ""
    notes = (
        f"GPT training step (forward, loss, backward, AdamW, sync_scales), {args.rounds} interleaved rounds, "
        f"median{threads}. torch.compile: {'on' if args.compile else 'off'}. torchao.float8 peer: {head['torchao']}."
    )
    if device.type == "cuda":
        notes += (" host ms: median time until the step returns, before the GPU is synchronized (close to the "
                  "step time: the host, not the GPU, sets the pace).")
        notes += "".join(f" {r['model']} {r['precision']}: {1 / r['ratio']:.2f}x bf16 speed (target >= 1.3)."
                         for r in rows if r["precision"].startswith("fp8"))  # fmt: skip
        notes += versus_torchao(rows)
    write_results(folder, head, rows, markdown_table(columns, rows), notes)
    models = list(dict.fromkeys(r["model"] for r in rows))
    plotted = [p for p in precisions if p != reference and not (device.type == "cpu" and p == "bf16")]  # CPU bf16: table
    series = {p: [next(r["ratio"] for r in rows if r["model"] == m and r["precision"] == p) for m in models]
              for p in plotted}  # fmt: skip
    bar_plot(folder / "gpt.png", models, series, f"step time / {reference} step (lower is faster)",
             f"GPT training step, {head['device']}", target=1.3 if device.type == "cpu" else 1 / 1.3)  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
