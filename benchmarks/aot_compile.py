"""Compile every kernel launch configuration for sm_89, sm_90a and sm_100a on this machine (no GPU needed) and
tabulate ptxas's report: registers per thread, spilled bytes, shared memory.

The configurations are ``fp8_lightning.kernels.aot.launch_space()``: every dtype, constexpr and autotune config
the wrappers can launch (about 1,700 per target; some 20 minutes on one core). The test suite compiles a covering
subset (``tests/kernels/test_aot_compile.py``); this is the full sweep. Exits 1 when a configuration fails to
compile or spills.

Usage::

    python -m benchmarks aot [--kernel NAME ...] [--target sm_89 ...] [--cover] [--jobs N] [--out FILE.md]

``--cover`` compiles the suite's pairwise covering only (about 100 compiles, a minute with 2 processes).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import subprocess
import sys
import time
import traceback
from pathlib import Path

from benchmarks import command as front_door_command
from fp8_lightning.kernels.aot import TARGETS, Compiler, launch_space, pairwise_cover


def _cell(result) -> list[str]:
    if result is None:
        return ["FAILED", "", ""]
    registers, spilled, shared = result
    return [str(registers), str(spilled) if not spilled else f"**{spilled}**", str(shared)]


def render(results: dict, command: str, seconds: float, cover: bool = False, targets=tuple(TARGETS)) -> str:
    """The markdown report: a summary per kernel and target (columns for ``targets``), then one row per
    configuration."""
    import torch
    import triton

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [
        f"# Ahead-of-time compilation of {'a pairwise covering of the' if cover else 'every'} kernel configuration"
        f"{'s' if cover else ''} for {', '.join(targets)}",
        "",
        f"- command: `{command}`",
        f"- machine: CPU only (no GPU); triton {triton.__version__} (its bundled ptxas), torch {torch.__version__}",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; commit {commit}; "
        f"{sum(len(row) for row in results.values())} compiles ({len(results)} configurations) in {seconds:.0f} s",
        "- registers per thread and spilled bytes (stores + loads) from `ptxas -v`; shared memory (bytes) as "
        "Triton allocates it; \"-\": not compiled for that target (the wrapper never selects that configuration there, "
        "or a covering run left it out)",
        "",
        "## Summary",
        "",
        "| kernel | configurations compiled | " + " | ".join(f"{t} max registers | {t} spilling | {t} failed" for t in targets)
        + " |",
        "|---|---:|" + "---:|---:|---:|" * len(targets),
    ]
    by_kernel = collections.defaultdict(list)
    for variant, per_target in results.items():
        by_kernel[variant.kernel].append(per_target)
    for kernel, rows in by_kernel.items():
        cells = [kernel, str(len(rows))]
        for target in targets:
            launched = [row[target] for row in rows if target in row]
            done = [r for r in launched if r is not None]
            if not launched:  # never compiled for this target
                cells += ["-", "-", "-"]
                continue
            cells += [str(max((r[0] for r in done), default=0)), str(sum(1 for r in done if r[1])),
                      str(len(launched) - len(done))]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Every configuration", "",
              "| kernel | configuration | " + " | ".join(f"{t} registers | {t} spills | {t} shared" for t in targets)
              + " |", "|---|---|" + "---:|---:|---:|" * len(targets)]
    for variant, per_target in results.items():
        cells = [variant.kernel, variant.config]
        for target in targets:
            cells += _cell(per_target[target]) if target in per_target else ["-", "", ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", action="append", help="only this kernel (repeatable), e.g. _mx_gemm_kernel")
    parser.add_argument("--target", action="append", choices=sorted(TARGETS),
                        help="only this GPU (repeatable; default: every one)")
    parser.add_argument("--cover", action="store_true", help="only the test suite's pairwise covering")
    parser.add_argument("--jobs", type=int, default=1, help="compile worker processes (default 1)")
    parser.add_argument("--out", type=Path, help="write the markdown table here (default: print the summary)")
    args = parser.parse_args(argv)
    variants = [v for v in launch_space() if not args.kernel or v.kernel in args.kernel]
    if not variants:
        names = sorted({v.kernel for v in launch_space()})
        print(f"no kernel matches --kernel {args.kernel}; kernels: {', '.join(names)}")
        return 2
    targets = tuple(t for t in TARGETS if not args.target or t in args.target)
    jobs = pairwise_cover(variants) if args.cover else [(v, t) for v in variants for t in v.targets]
    jobs = [(variant, target) for variant, target in jobs if target in targets]
    results = {}
    for variant, target in jobs:  # rows in launch-space order, a cell per compiled target
        results.setdefault(variant, {})[target] = None
    start = time.perf_counter()
    failures = []
    with Compiler(args.jobs) as compiler:  # worker processes, whose exit messages stay out of this output
        for done, (variant, target, outcome) in enumerate(compiler.results(jobs), start=1):
            if isinstance(outcome, Exception):  # a kernel that does not compile is a row of the table
                failures.append(f"{variant.kernel} [{variant.config}] {target}:\n"
                                + "".join(traceback.format_exception_only(outcome)))
            else:
                results[variant][target] = (outcome.registers, outcome.spill_bytes, outcome.shared_bytes)
            if done % 200 == 0:
                print(f"{done}/{len(jobs)} compiled, {time.perf_counter() - start:.0f} s", flush=True)
    seconds = time.perf_counter() - start
    command = front_door_command("aot_compile", argv)
    text = render(results, command, seconds, args.cover, targets)
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}")
    print(text.split("## Every configuration")[0])
    spilling = [f"{v.kernel} [{v.config}] {t}" for v, row in results.items() for t, r in row.items() if r and r[1]]
    for line in failures + [f"spills: {s}" for s in spilling]:
        print(line)
    return 1 if failures or spilling else 0


if __name__ == "__main__":
    sys.exit(main())
