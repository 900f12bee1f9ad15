"""Helpers for the config and CLI tests: where the configs are, composing them, running the CLI."""

import os
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"


def group_options(group: str) -> list[str]:
    """Every option of a config group, from the files in ``conf/<group>/``."""
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def compose_config(output_dir: Path, *overrides: str):
    """The composed root config (outputs under ``output_dir``), as ``fp8-train <overrides>`` would see it."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
            return compose("train", overrides=[f"paths.output_dir={output_dir}", *overrides])
    finally:
        GlobalHydra.instance().clear()


def run_cli(args: list[str], cwd: Path, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m fp8_lightning.train <args>`` in a fresh interpreter (2 torch threads)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONWARNINGS": "ignore", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "fp8_lightning.train", *args],
        cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout,
    )
