"""The examples run as documented (with fewer steps)."""

import os
import subprocess
import sys

import pytest
import torch

from tests.hydra.helpers import REPO


def run_example(name: str, *args: str, cwd) -> str:
    proc = subprocess.run([sys.executable, str(REPO / "examples" / name), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=240, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_plug_into_existing_converts_the_plain_module(tmp_path):
    out = run_example("plug_into_existing.py", "--steps", "8", cwd=tmp_path)
    assert "precision=fp8-hybrid:" in out and "FP8 layers: ['net.0', 'net.3', 'net.6']" in out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fabric_loop_saves_the_fp8_state(tmp_path):
    out = run_example("fabric_loop.py", "--steps", "3", "--checkpoint", str(tmp_path / "last.ckpt"), cwd=tmp_path)
    assert "val loss" in out
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert {"model", "optimizer", "fp8"} <= set(checkpoint)
    assert checkpoint["fp8"], "the FP8 scaling state is empty"
