"""Kernel tests run the Triton kernels on CPU in Triton's interpreter, without leaking it to other tests.

Triton decides whether a ``@triton.jit`` function is interpreted when the function is *defined* (module import),
and the interpreter reads ``TRITON_INTERPRET`` again while it runs. So every kernel test gets
``TRITON_INTERPRET=1`` through ``monkeypatch`` (restored after each test: other test folders never see it), and
the kernel modules are (re)imported in the matching mode before the test body runs. Tests marked ``gpu`` get
the compiled kernels on CUDA instead (and are skipped, with the missing capability named, elsewhere).

Interpreter facts the tests work with (Triton 3.9): its float8 conversion is not round-to-nearest-even (the
kernels pre-round in float32 under it, so comparisons are bit for bit), it flushes bf16 *subnormal* inputs to
zero when loading them as float32 (bf16 test data stays above 2**-126; the GPU check covers subnormals), and
``tl.dot`` on FP8 operands is exact.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

pytest.importorskip("triton", reason="needs Triton (pip install triton) to test the kernels")

INTERPRET_ENV = "TRITON_INTERPRET"
KERNEL_MODULES = (
    "fp8_lightning.kernels.per_tensor",
    "fp8_lightning.kernels.mxfp8",
    "fp8_lightning.kernels.block_gemm",
    "fp8_lightning.kernels.fp8_adam",
    "fp8_lightning.kernels.fine_grained_cast",
    "fp8_lightning.kernels.grouped_cast",
    "fp8_lightning.kernels.grouped_gemm",
    "fp8_lightning.kernels.nvfp4_cast",
)


def ensure_kernel_modules(interpreted: bool) -> None:
    """Import the kernel modules so that their kernels are interpreted (or compiled), reloading when needed."""
    from triton.runtime.interpreter import InterpretedFunction

    loaded = [sys.modules.get(name) for name in KERNEL_MODULES]
    stale = any(
        isinstance(value, InterpretedFunction) != interpreted
        for module in loaded
        if module is not None
        for value in vars(module).values()
        if type(value).__name__ in ("JITFunction", "InterpretedFunction")
    )
    for name, module in zip(KERNEL_MODULES, loaded):  # dependency order: per_tensor first
        if module is None:
            importlib.import_module(name)
        elif stale:
            importlib.reload(module)


def cuda_kernel_reason() -> str | None:
    """Why the compiled kernels cannot be tested here (None when they can)."""
    from fp8_lightning.kernels.availability import MIN_CAPABILITY

    if not torch.cuda.is_available():
        return "needs an NVIDIA GPU with FP8 conversions (sm89+): CUDA is not available"
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        return f"needs compute capability 8.9+ for FP8 conversions; this GPU has {capability[0]}.{capability[1]}"
    return None


requires_cuda_kernels = pytest.mark.skipif(cuda_kernel_reason() is not None, reason=str(cuda_kernel_reason()))


@pytest.fixture(autouse=True)
def triton_mode(request, monkeypatch):
    """Interpreter for CPU kernel tests, compiled kernels for ``gpu`` tests; env restored afterwards."""
    on_gpu = request.node.get_closest_marker("gpu") is not None
    compiled = on_gpu or getattr(request.module, "COMPILED_KERNELS", False)  # ahead-of-time compile tests
    if compiled:
        monkeypatch.delenv(INTERPRET_ENV, raising=False)
    else:
        monkeypatch.setenv(INTERPRET_ENV, "1")
    ensure_kernel_modules(interpreted=not compiled)
    yield "cuda" if on_gpu else "cpu"
