"""Running a benchmark suite the way a user does, through its front door ``python -m benchmarks <suite>``, in a
subprocess from the repository root (the tests never import the benchmarks)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_suite(suite: str, *args: str, env: dict | None = None, timeout: float = 300,
              check: bool = True) -> subprocess.CompletedProcess:
    """``python -m benchmarks <suite> <args>``; ``env`` updates this process's environment (a value of None removes
    the variable). With ``check`` a non-zero exit fails with the suite's output."""
    environment = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            environment.pop(key, None)
        else:
            environment[key] = value
    done = subprocess.run([sys.executable, "-m", "benchmarks", suite, *args], cwd=REPO, env=environment,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    if check and done.returncode != 0:
        raise AssertionError(f"python -m benchmarks {suite} {' '.join(args)} exited {done.returncode}:\n"
                             f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}")  # fmt: skip
    return done
