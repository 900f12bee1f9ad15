"""Shared test set-up: deterministic seeds, few threads (CI has 2 cores), and the GPU skip reason."""

import os

import pytest
import torch

# One thread per pytest worker under xdist (make test runs two), else up to two.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1)))


def cuda_fp8_reason() -> str | None:
    """Why CUDA FP8 tests cannot run here (None when they can)."""
    if not torch.cuda.is_available():
        return "needs an NVIDIA GPU with FP8 (sm89+): CUDA is not available"
    from fp8_lightning.gemm import fp8_gemm_support

    ok, reason = fp8_gemm_support("cuda")
    return None if ok else f"needs FP8 tensor cores: {reason}"


requires_cuda_fp8 = pytest.mark.skipif(cuda_fp8_reason() is not None, reason=str(cuda_fp8_reason()))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
