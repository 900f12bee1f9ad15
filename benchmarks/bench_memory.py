"""Memory accounting per precision: saved activations, optimizer bytes per parameter, all-gather bytes per step.

Three independent measurements, each counted from real tensors (no formulas):

* **saved activations**: every tensor autograd saves for backward during one GPT forward, counted with
  ``torch.autograd.graph.saved_tensors_hooks`` (bytes of each saved tensor; views of one storage counted once
  per save, as autograd holds them). FP8 layers save 1-byte copies of their input and weight.
* **optimizer bytes per parameter**: ``benchmarks/optimizer_memory.py``'s counting (distinct storages of
  weights, gradients and optimizer state after a step) for plain AdamW and the FP8 optimizer presets.
* **all-gather bytes per step**: ``benchmarks/allgather_bytes.py`` (two gloo processes, FSDP2), FP8 weights
  versus fp32/bf16; skipped with ``--no-allgather``.

Usage::

    python -m benchmarks memory --suite cpu
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from benchmarks.bench_common import bar_plot, header, markdown_table, run_folder, write_results

from fp8_lightning import convert_to_fp8, fp8_autocast
from fp8_lightning.models import GPT

SUITES = {
    "cpu": dict(n_layer=2, n_embd=256, n_head=4, block_size=128, batch=4),
    "gpu": dict(n_layer=24, n_embd=1024, n_head=16, block_size=1024, batch=8),
}
PRECISIONS = ["fp32", "bf16", "fp8 delayed", "fp8 tensorwise", "fp8 mxfp8"]
PRECISIONS += [f"{p} + bf16 autocast" for p in PRECISIONS if p.startswith("fp8")]  # rest of the model in bf16


def saved_activation_bytes(spec: dict, precision: str, device: torch.device) -> int:
    """Bytes autograd saves for backward in one forward of the GPT under ``precision``."""
    torch.manual_seed(0)
    dims = {k: v for k, v in spec.items() if k != "batch"}
    model = GPT(vocab_size=256, **dims).to(device)
    fp8 = precision.startswith("fp8")
    if fp8:
        convert_to_fp8(model, precision.split()[1], profitability=False)
    tokens = torch.randint(0, 256, (spec["batch"], spec["block_size"]), device=device)
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    autocast = "bf16" in precision or (fp8 and device.type == "cuda")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(device.type, torch.bfloat16, enabled=autocast), fp8_autocast(enabled=fp8):
            logits = model(tokens)
        F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
    return total


def optimizer_rows(spec: dict) -> list[dict]:
    from benchmarks import optimizer_memory

    args = SimpleNamespace(n_layer=spec["n_layer"], n_embd=spec["n_embd"], n_head=spec["n_head"], block_size=64)
    return [optimizer_memory.measure(*scenario, args) for scenario in optimizer_memory.SCENARIOS]


def allgather_rows(folder, width: int, depth: int) -> list[dict]:
    import json

    from benchmarks import allgather_bytes

    out = folder / "allgather_bytes.md"
    allgather_bytes.main(["--width", str(width), "--depth", str(depth), "--out", str(out)])
    return json.loads(out.with_suffix(".json").read_text())["rows"]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=sorted(SUITES), default="gpu" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--n-embd", type=int, help="override the suite's model width")
    parser.add_argument("--no-allgather", action="store_true", help="skip the 2-process FSDP2 measurement")
    parser.add_argument("--allgather-width", type=int, default=256)
    parser.add_argument("--allgather-depth", type=int, default=4)
    parser.add_argument("--out", help="run folder (default benchmarks/results/perf-memory-<device>-<date>)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if args.suite == "gpu" else "cpu")
    spec = dict(SUITES[args.suite], **({"n_embd": args.n_embd} if args.n_embd else {}))
    head = header("memory", device, argv)
    folder = run_folder("memory", device, args.out)

    saved = {p: saved_activation_bytes(spec, p, device) for p in PRECISIONS}
    act_rows = [{"precision": p, "MiB": b / 2**20, "vs_fp32": b / saved["fp32"], "vs_bf16": b / saved["bf16"]}
                for p, b in saved.items()]  # fmt: skip
    opt_rows = optimizer_rows(spec)
    ag_rows = [] if args.no_allgather else allgather_rows(folder, args.allgather_width, args.allgather_depth)
    ag_table_rows = []
    for r in ag_rows:
        if r["model"] != "weights":
            continue
        base = {x["config"]: x["bytes"]["all_gather"] for x in ag_rows if x["model"] == "weights"}
        ag = r["bytes"]["all_gather"]
        ag_table_rows.append({"config": r["config"], "bytes": ag, "vs_fp32": ag / base["fp32"], "vs_bf16": ag / base["bf16"]})

    tables = [
        f"## Saved activations (one forward, GPT n_layer={spec['n_layer']}, n_embd={spec['n_embd']}, "
        f"{spec['batch']} x {spec['block_size']} tokens)\n",
        markdown_table([("precision", "precision", "{}"), ("MiB", "saved MiB", "{:.2f}"),
                        ("vs_fp32", "vs fp32", "{:.3f}"), ("vs_bf16", "vs bf16", "{:.3f}")], act_rows),  # fmt: skip
        "\n## Optimizer: bytes per parameter (optimizer_memory.py counting)\n",
        markdown_table([("label", "configuration", "{}"), ("weights", "weights", "{:.2f}"), ("grads", "grads", "{:.2f}"),
                        ("state", "state + master", "{:.2f}"), ("at_step", "at the step", "{:.2f}"),
                        ("between", "between steps", "{:.2f}")], opt_rows),  # fmt: skip
    ]
    if ag_table_rows:
        tables += [
            f"\n## FSDP2 all-gather bytes per step and rank (allgather_bytes.py, width {args.allgather_width}, "
            f"depth {args.allgather_depth}, Linear weights only; full table in allgather_bytes.md)\n",
            markdown_table([("config", "all-gather", "{}"), ("bytes", "bytes", "{:,}"), ("vs_fp32", "vs fp32", "{:.4f}"),
                            ("vs_bf16", "vs bf16", "{:.4f}")], ag_table_rows),  # fmt: skip
        ]
    rows = {"saved_activations": act_rows, "optimizer": opt_rows, "allgather": ag_table_rows}
    write_results(folder, head, rows, "\n".join(tables), "Every number is counted from real tensors (see the script).")
    series = {"saved activations": [r["vs_bf16"] for r in act_rows]}
    bar_plot(folder / "memory.png", [p.replace(" + bf16 autocast", "\n+ bf16") for p in PRECISIONS], series, "bytes / bf16 bytes", f"Saved activations, {head['device']}")
    return rows


if __name__ == "__main__":
    main()
