"""The torchrun recipe of examples/multinode/ on one machine: 2 CPU processes (gloo), FP8, a few steps."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.hydra.helpers import REPO
from fp8_lightning.testing import free_port

SCRIPT = REPO / "examples" / "multinode" / "torchrun_fp8_train.sh"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash to run the launcher script")
def test_torchrun_recipe_trains_fp8_with_two_processes(tmp_path):
    env = {**os.environ, "NNODES": "1", "NPROC_PER_NODE": "2", "ACCELERATOR": "cpu", "PYTHON": sys.executable,
           "MASTER_PORT": str(free_port()), "RUN_DIR": str(tmp_path / "run"), "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        ["bash", str(SCRIPT), "experiment=smoke", "precision=fp8_hybrid", "trainer.max_steps=4",
         "trainer.val_check_interval=4"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
    assert len(summary["layers"]["converted"]) == 5
    assert proc.stdout.count("==== fp8-train summary") == 1  # printed by rank 0 only
