"""The CUDA paths against the CPU reference (skipped without an FP8-capable GPU; the reason names it)."""

import pytest
import torch

from tests.conftest import requires_cuda_fp8
from tests.environment import set_env
from tests.helpers.front_door import run_suite


def _gpu_check_failures(check: str) -> list[str]:
    """The failures ``python -m benchmarks gpu-check --only <check>`` reports (its exit code: 1 with failures)."""
    done = run_suite("gpu-check", "--only", check, check=False)
    assert done.returncode in (0, 1), done.stdout + done.stderr
    failures = [line.removeprefix("FAILED: ") for line in done.stdout.splitlines() if line.startswith("FAILED: ")]
    assert bool(failures) == (done.returncode == 1), done.stdout
    return failures


@requires_cuda_fp8
def test_cuda_casts_are_bit_identical_to_cpu():
    assert _gpu_check_failures("casts") == []


@requires_cuda_fp8
@pytest.mark.parametrize("name", ["tensorwise", "tensorwise-fast", "delayed", "delayed-e4m3", "mxfp8"])
def test_cuda_fp8_linear_matches_cpu(name):
    assert _gpu_check_failures(name) == []


def test_device_without_fp8_is_refused_with_its_capability_named(monkeypatch):
    from fp8_lightning import gemm

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    ok, reason = gemm.fp8_gemm_support("cuda")
    assert not ok and "compute capability 8.0" in reason and "A100" in reason
    with pytest.raises(RuntimeError, match="emulate=True"):
        gemm.check_device("cuda")
    gemm.check_device("cuda", emulate=True)  # opt-in emulation passes
    set_env(monkeypatch, **{gemm.EMULATE_ENV: "1"})
    gemm.check_device("cuda")
