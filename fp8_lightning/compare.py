"""``fp8-compare``: the same model, data and seed trained under several precisions, side by side.

Before trusting FP8 with a large run, one wants to see it next to fp32 and bf16 on the same job. This command
runs ``fp8-train`` once per precision, each in its own process (so peak memory is per run and nothing leaks
between runs), with identical overrides, then writes into the output folder:

* ``report.md``: a table (final validation loss and its gap to fp32, perplexity, tokens/s and the ratio to
  fp32, peak memory, converted layers), the exact command, the machine and the date;
* ``loss_curves.png``: training and validation loss against the step, one line per precision (matplotlib);
* ``results.json``: every run's summary, curves included;
* ``<precision>/``: each run's own folder (``summary.json``, Hydra config, CSV metrics, checkpoints, log).

Usage::

    fp8-compare                                    # all precisions, experiment=compare_cpu, ./outputs/compare-...
    fp8-compare --precisions fp32 fp8_hybrid --out runs/cmp trainer.max_steps=50 model.n_layer=4

Tokens/s are comparable only within one report (same machine, same load, measured in one invocation).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

ALL_PRECISIONS = (
    "fp32", "bf16_mixed", "fp8_hybrid", "fp8_e4m3", "fp8_tensorwise", "fp8_mxfp8", "fp8_rowwise", "fp8_blockwise",
)
BASELINE = "fp32"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="fp8-compare",
        description="Train the same job under several precisions and write report.md, loss_curves.png and "
        "results.json. Extra arguments are fp8-train overrides applied to every run.",
    )
    parser.add_argument("--precisions", nargs="+", default=list(ALL_PRECISIONS), metavar="NAME",
                        help=f"precision config names (default: {' '.join(ALL_PRECISIONS)})")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default: outputs/compare/<date>_<time>)")
    parser.add_argument("--experiment", default="compare_cpu",
                        help="experiment preset for every run (default: compare_cpu; 'none' for none)")
    parser.add_argument("overrides", nargs="*", help="fp8-train overrides, e.g. trainer.max_steps=50")
    args = parser.parse_args(argv)
    unknown = [p for p in args.precisions if not p.replace("-", "_").isidentifier()]
    if unknown:
        parser.error(f"invalid precision name(s) {unknown}; use config names such as {', '.join(ALL_PRECISIONS)}")
    args.precisions = [p.replace("-", "_") for p in args.precisions]
    return args


def known_precisions() -> list[str]:
    """Precision options of the configs that ``fp8-train`` uses (the checkout's or the packaged ones)."""
    from importlib import resources

    from fp8_lightning.train import config_path

    source = config_path()
    folder = resources.files("fp8_lightning.conf") if source.startswith("pkg://") else Path(source)
    return sorted(p.name[: -len(".yaml")] for p in (folder / "precision").iterdir() if p.name.endswith(".yaml"))


def train_command(precision: str, run_dir: Path, experiment: str, overrides: Sequence[str]) -> list[str]:
    cmd = [sys.executable, "-m", "fp8_lightning.train", f"precision={precision}", f"hydra.run.dir={run_dir}"]
    if experiment and experiment != "none":
        cmd.append(f"experiment={experiment}")
    return cmd + list(overrides) + ["trainer.enable_progress_bar=false"]


def run_one(precision: str, out: Path, experiment: str, overrides: Sequence[str]) -> dict[str, Any]:
    run_dir = out / precision
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = train_command(precision, run_dir, experiment, overrides)
    print(f"[fp8-compare] {precision}: {shlex.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    with open(run_dir / "stdout.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    wall = time.perf_counter() - start
    summary_file = run_dir / "summary.json"
    if proc.returncode != 0 or not summary_file.is_file():
        tail = (run_dir / "stdout.log").read_text().splitlines()[-40:]
        raise RuntimeError(f"fp8-train failed for precision={precision} (exit {proc.returncode}); last lines of "
                           f"{run_dir / 'stdout.log'}:\n" + "\n".join(tail))
    summary = json.loads(summary_file.read_text())
    summary["config_name"] = precision
    summary["wall_seconds"] = wall
    print(f"[fp8-compare] {precision}: val loss {summary['val_loss']:.4f}, "
          f"{summary['tokens_per_s'] or 0:,.0f} tokens/s, {wall:.0f} s", flush=True)
    return summary


# ----------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------


def add_comparisons(results: list[dict[str, Any]]) -> None:
    """Gap of the final validation loss and throughput ratio relative to the fp32 run (when there is one)."""
    base = next((r for r in results if r["config_name"] == BASELINE), None)
    for r in results:
        r["val_loss_gap"] = None if base is None else r["val_loss"] - base["val_loss"]
        r["val_loss_gap_pct"] = None if base is None else 100.0 * r["val_loss_gap"] / base["val_loss"]
        ok = base is not None and base["tokens_per_s"] and r["tokens_per_s"]
        r["speed_vs_fp32"] = r["tokens_per_s"] / base["tokens_per_s"] if ok else None


def machine_description() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{cpu}, {os.cpu_count()} logical CPUs, {gpu}; Python {platform.python_version()}, "
            f"torch {torch.__version__}, {torch.get_num_threads()} torch threads")


def _fmt(x: Any, spec: str, suffix: str = "") -> str:
    return "–" if x is None else format(x, spec) + suffix


def markdown_table(results: list[dict[str, Any]]) -> str:
    header = ("| precision | recipe | final val loss | gap to fp32 | val ppl | tokens/s | vs fp32 | peak memory (MiB) "
              "| FP8 layers |\n|---|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for r in results:
        recipe = r.get("recipe") or {}
        recipe_text = ", ".join(f"{k}={v}" for k, v in recipe.items() if k in ("name", "fp8_format")) or "–"
        layers = r["layers"]
        gap = None if r["val_loss_gap"] is None else f"{r['val_loss_gap']:+.4f} ({r['val_loss_gap_pct']:+.2f}%)"
        rows.append(
            f"| {r['precision']} | {recipe_text} | {_fmt(r['val_loss'], '.4f')} | {gap or '–'} | "
            f"{_fmt(r['val_ppl'], '.3f')} | {_fmt(r['tokens_per_s'], ',.0f')} | "
            f"{_fmt(r['speed_vs_fp32'], '.2f', 'x')} | "
            f"{_fmt(r['peak_memory_mib'], ',.0f')} | {len(layers['converted'])} / {len(layers['skipped'])} |"
        )
    return header + "\n" + "\n".join(rows)


def write_report(out: Path, results: list[dict[str, Any]], command: str, started: str, seconds: float) -> None:
    first = results[0]
    memory_kind = {"process_peak_rss": "peak resident memory of the training process (whole process: Python, "
                   "torch, data)", "cuda_max_allocated": "peak CUDA memory allocated by tensors"}
    text = f"""# Precision comparison

Same model, data and seed under each precision ({first['steps']} optimizer steps,
{first['parameters']:,} parameters).

{markdown_table(results)}

- **final val loss**: validation loss after the last step; **gap to fp32**: difference to the fp32 run.
- **tokens/s**: training tokens per second of step time (forward, backward, optimizer; validation and data
  loading excluded; the first steps skipped). Ratios are meaningful only inside this table (one machine,
  one invocation, runs one after another).
- **peak memory**: {memory_kind.get(first['peak_memory_kind'], first['peak_memory_kind'])}.
- **FP8 layers**: converted / skipped `nn.Linear` layers.

![loss curves](loss_curves.png)

Command: `{command}`

Machine: {machine_description()}

Date: {started} (total {seconds / 60:.1f} min). Each run's folder holds its Hydra config, log and metrics.
"""
    (out / "report.md").write_text(text)


def plot_curves(out: Path, results: list[dict[str, Any]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        steps, losses = zip(*r["train_loss_curve"]) if r["train_loss_curve"] else ((), ())
        (line,) = ax_train.plot(steps, losses, label=r["precision"], linewidth=1.2)
        if r["val_loss_curve"]:
            v_steps, v_losses = zip(*r["val_loss_curve"])
            ax_val.plot(v_steps, v_losses, marker="o", color=line.get_color(), label=r["precision"])
    ax_train.set(title="training loss", xlabel="optimizer step", ylabel="cross-entropy (nats/byte)")
    ax_val.set(title="validation loss", xlabel="optimizer step", ylabel="cross-entropy (nats/byte)")
    for ax in (ax_train, ax_val):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = out / "loss_curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    unknown = sorted(set(args.precisions) - set(known_precisions()))
    if unknown:
        print(f"fp8-compare: unknown precision(s) {unknown}; available: {', '.join(known_precisions())}.",
              file=sys.stderr)
        return 2
    started = dt.datetime.now(dt.timezone.utc)
    out = args.out or Path("outputs") / "compare" / started.strftime("%Y-%m-%d_%H-%M-%S")
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["fp8-compare", *(sys.argv[1:] if argv is None else argv)])
    t0 = time.perf_counter()
    try:
        results = [run_one(p, out, args.experiment, args.overrides) for p in args.precisions]
    except RuntimeError as err:
        print(f"fp8-compare: {err}", file=sys.stderr)
        return 1
    add_comparisons(results)
    (out / "results.json").write_text(json.dumps({"command": command, "date": started.isoformat(),
                                                  "machine": machine_description(), "runs": results}, indent=2))
    plot_curves(out, results)
    write_report(out, results, command, started.strftime("%Y-%m-%d %H:%M UTC"), time.perf_counter() - t0)
    print(f"[fp8-compare] wrote {out / 'report.md'}, {out / 'loss_curves.png'}, {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
