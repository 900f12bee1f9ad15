"""What every benchmark suite shares: the run folder, the record of command/device/date, timing, and the writers.

A suite writes into ``benchmarks/results/<suite>-<device>-<date>/``:

* ``results.json``: the command, device, date, software versions and every measured row;
* ``results.md``: the same as a markdown table, with the header a reader needs to reproduce it;
* ``<suite>.png``: a plot of the main ratio.

Timing rule: every configuration of a comparison is built first, then the configurations are run *interleaved*
(round-robin, one repetition each, many rounds, every other round in reverse order so that no configuration
always runs right after the same one, warm caches and all) and the median per configuration is reported. A machine
whose load changes during the run slows all configurations alike, so the ratios stay meaningful; that is why a
ratio is only ever taken between numbers of the same run.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from benchmarks import command as front_door_command

RESULTS = Path(__file__).resolve().parent / "results"


def device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s) of {os.cpu_count()}"


def device_slug(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).lower().replace("nvidia ", "").replace(" ", "")
    return "cpu"


def run_folder(suite: str, device: torch.device, out: str | None) -> Path:
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M")
    folder = Path(out) if out else RESULTS / f"perf-{suite}-{device_slug(device)}-{date}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def write_markdown_report(path: str, title: str, script: str, argv: list[str] | None, text: str) -> None:
    """A markdown result file headed by its command, the CPU machine and the date, then ``text``."""
    command = front_door_command(script.removesuffix(".py"), argv)
    machine = (f"{os.cpu_count()}-core {platform.machine()} CPU (shared with other jobs), "
               f"{torch.get_num_threads()} torch thread(s), torch {torch.__version__}, Python {platform.python_version()}")
    with open(path, "w") as f:
        f.write(f"# {title}\n\nCommand: `{command}`  \nMachine: {machine}  \nDate: {utc_now()}\n\n{text}")


def header(suite: str, device: torch.device, argv: list[str] | None) -> dict:
    return {
        "suite": suite,
        "command": front_door_command(f"bench_{suite}", argv),
        "device": device_label(device),
        "date": utc_now(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_medians(
    fns: dict[str, Callable[[], object]], device: torch.device, warmup: int, rounds: int, host: dict | None = None,
    after: dict[str, Callable[[], object]] | None = None,
) -> dict:
    """Median seconds per call of each function, run round-robin (see the module docstring). ``host``, when given,
    receives each function's median host time: until it returns, before the device is synchronized (on a GPU,
    a host time close to the total means the host, not the GPU, sets the pace). ``after``: per name, work run
    after each call of that function, outside the timing (e.g. what an optimizer does between steps)."""
    after = after or {}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
            if name in after:
                after[name]()
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    host_times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for round_index in range(rounds):  # every other round in reverse: no row always follows the same one
        for name in names if round_index % 2 == 0 else reversed(names):
            fn = fns[name]
            sync(device)
            start = time.perf_counter()
            fn()
            host_times[name].append(time.perf_counter() - start)
            sync(device)
            times[name].append(time.perf_counter() - start)
            if name in after:
                after[name]()
    if host is not None:
        host.update({name: statistics.median(ts) for name, ts in host_times.items()})
    return {name: statistics.median(ts) for name, ts in times.items()}


def loss_curve_table(curves: dict[str, list[tuple[int, float]]]) -> list[str]:
    """Markdown lines of validation-loss curves side by side: a row per evaluation step, a column per run (every
    run evaluated at the same steps)."""
    names = list(curves)
    lines = ["| step | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    for i, (step, _) in enumerate(curves[names[0]]):
        lines.append(f"| {step} | " + " | ".join(f"{curves[name][i][1]:.4f}" for name in names) + " |")
    return lines


def markdown_table(columns: list[tuple[str, str, str]], rows: list[dict]) -> str:
    """``columns``: (key, title, format) with format like ``{:.2f}``; missing values print as ``-``."""
    lines = ["| " + " | ".join(title for _, title, _ in columns) + " |"]
    lines.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(columns))) + "|")
    for r in rows:
        cells = [fmt.format(r[key]) if r.get(key) is not None else "-" for key, _, fmt in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_gloo_result(out: Path, suite: str, argv, title: str, setting: str, notes: str, table: str, rows) -> str:
    """Write a gloo byte-count result: ``out`` (Markdown: title, command, machine, torch, date, notes, table) and
    the same with ``rows`` as JSON next to it; returns the Markdown."""
    command = front_door_command(suite, argv)
    machine = f"{platform.node() or 'unknown host'}: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"  # noqa: E501
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = (f"# {title}\n\n- command: `{command}`\n- machine: {machine}\n- torch {torch.__version__}, {setting}\n"
            f"- date: {when}\n\n{notes}\n{table}\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(
        {"command": command, "machine": machine, "date": when, "torch": torch.__version__, "rows": rows}, indent=1))
    print(text)
    return text


def write_results(folder: Path, head: dict, rows: list[dict], table: str, notes: str = "") -> None:
    (folder / "results.json").write_text(json.dumps({**head, "rows": rows}, indent=1, default=str))
    text = (
        f"# {head['suite']} benchmark\n\n- command: `{head['command']}`\n- device: {head['device']}\n"
        f"- date: {head['date']}\n- torch {head['torch']}, Python {head['python']}, load average at start: "
        f"{head['load_average']}\n\n{notes}\n\n{table}\n"
    )
    (folder / "results.md").write_text(text)
    print(text)


def bar_plot(
    path: Path, groups: list[str], series: dict[str, list[float | None]], ylabel: str, title: str,
    target: float | None = None,
) -> None:
    """Grouped bars (one group per shape/model, one bar per configuration), a line at 1.0 and an optional target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(groups) * max(1, len(series)) / 3), 4))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [v if v is not None else 0 for v in values], width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    if target is not None:
        ax.axhline(target, color="gray", linestyle="--", linewidth=0.8, label=f"target {target}")
    ax.set_xticks(range(len(groups)), groups, rotation=20 if len(groups) > 4 else 0)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def route_cuda_branch_to_kernels(enabled: bool = True) -> None:
    """Point the core's CUDA dispatch (``dispatch.cuda_kernels``) at the Triton kernels for tensors on any device
    (``enabled``), or at nothing: the probes that run the CUDA branch on CPU tensors (``launch_count.py``,
    ``host_time.py --cuda-branch``). For the calling process only."""
    from fp8_lightning.ops import dispatch
    from fp8_lightning.ops import triton_ops

    dispatch.cuda_kernels = lambda x: triton_ops if enabled and triton_ops.supports_input(x) else None


def cuda_median_ms(fn: Callable[[], object], rounds: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` over ``rounds`` calls timed by CUDA events, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def write_gpu_report(report: str, out: str | None, name: str) -> None:
    """Write a GPU check's markdown ``report`` to ``out`` (when given) and to ``$OUT/name`` (when the device runner
    sets ``OUT``, whose files come back from the GPU machine)."""
    device_out = os.path.join(os.environ["OUT"], name) if os.environ.get("OUT") else None
    for path in filter(None, (out, device_out)):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(report)
