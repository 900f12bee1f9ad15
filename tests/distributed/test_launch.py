"""``strategy=fp8_fsdp`` end to end through the Hydra entry point under torchrun: 2 CPU processes (gloo)."""

import os
import shutil
import subprocess
import sys

import pytest

from fp8_lightning.testing import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "examples", "multinode", "torchrun_fp8_train.sh")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash to run the launcher script")
def test_torchrun_trains_with_fp8_fsdp_and_writes_a_sharded_checkpoint(tmp_path):
    env = {**os.environ, "NNODES": "1", "NPROC_PER_NODE": "2", "ACCELERATOR": "cpu", "PYTHON": sys.executable,
           "MASTER_PORT": str(free_port()), "RUN_DIR": str(tmp_path / "run"), "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        ["bash", SCRIPT, "experiment=smoke", "strategy=fp8_fsdp", "precision=fp8_mxfp8"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "FP8 all-gather: 4 weight(s) in FP8, 1 in high precision" in out  # lm_head is tied to the embedding
    checkpoints = list((tmp_path / "run" / "checkpoints").iterdir())
    assert checkpoints and all(c.is_dir() for c in checkpoints)  # torch distributed checkpoint folders
    assert any(f.suffix == ".distcp" for c in checkpoints for f in c.iterdir())
