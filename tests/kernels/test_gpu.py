"""Compiled kernels on CUDA, bit for bit against the pure-torch twins (skipped without an sm89+ GPU).

The checks are those of ``python -m benchmarks kernels-gpu`` (one list, run by both); here they gate CI on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from fp8_lightning import FP8Linear, fp8_autocast
from fp8_lightning.kernels.availability import DISABLE_ENV
from fp8_lightning.recipes import DelayedScaling
from tests.kernels.conftest import requires_cuda_kernels
from tests.environment import set_env
from tests.helpers.front_door import run_suite

pytestmark = [pytest.mark.gpu, requires_cuda_kernels]


def test_every_kernel_matches_its_twin_on_cuda(tmp_path):
    done = run_suite("kernels-gpu", "--check-only", "--out", str(tmp_path / "kernels_gpu.md"), check=False)
    assert done.returncode in (0, 1), done.stdout + done.stderr
    failed = [line.split("FAILED: ", 1)[1] for line in done.stdout.splitlines() if "FAILED: " in line]
    assert bool(failed) == (done.returncode == 1), done.stdout
    assert not failed, failed


def test_delayed_fp8_linear_steps_are_identical_with_and_without_the_kernels(monkeypatch):
    def steps():
        torch.manual_seed(0)
        layer = FP8Linear.from_linear(torch.nn.Linear(512, 256).cuda(), DelayedScaling())
        x = torch.randn(128, 512, device="cuda", requires_grad=True)
        for _ in range(3):  # the first cast scales just in time; the next ones use the fused cast + amax
            with fp8_autocast():
                layer(x).square().mean().backward()
            layer.fp8_scaling().update()
        return layer.weight.grad, x.grad

    with_kernels = steps()
    set_env(monkeypatch, **{DISABLE_ENV: "1"})
    without = steps()
    for a, b in zip(with_kernels, without):
        assert torch.equal(a, b)
