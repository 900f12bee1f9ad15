"""Compiled kernels on CUDA, bit for bit against the pure-torch twins (skipped without an sm89+ GPU).

The checks are those of ``benchmarks/kernels_gpu.py`` (one list, run by both); here they gate CI on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks import kernels_gpu
from fp8_lightning import FP8Linear, fp8_autocast
from fp8_lightning.kernels.availability import DISABLE_ENV
from fp8_lightning.recipes import DelayedScaling
from tests.kernels.conftest import requires_cuda_kernels
from tests.environment import set_env

pytestmark = [pytest.mark.gpu, requires_cuda_kernels]


def test_every_kernel_matches_its_twin_on_cuda():
    failed = [name for name, ok in kernels_gpu.check_kernels() if not ok]
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
