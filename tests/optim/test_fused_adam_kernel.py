"""The fused Triton AdamW step against FP8Optimizer's torch step: interpreter on CPU, compiled on a GPU.

``TRITON_INTERPRET=1`` must be set before triton is imported, and must not leak into other tests, so the CPU
test runs the comparison (``fused_adam_check.py``) in a subprocess.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import requires_cuda_fp8

pytest.importorskip("triton", reason="needs Triton (pip install triton) to test the fused optimizer kernel")

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_fused_adam_kernel_matches_torch_step_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-m", "tests.optim.fused_adam_check", "cpu"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=280,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 problem(s)" in result.stdout


@pytest.mark.gpu
@requires_cuda_fp8
def test_fused_adam_kernel_matches_torch_step_on_gpu():
    from tests.optim.fused_adam_check import main

    assert main("cuda") == 0
