"""Can the Triton kernels run here, and should the core use them? (Imports no Triton.)

Three questions, answered without importing Triton at module import time, so that ``fp8_lightning`` imports and
runs on machines without it:

* :func:`triton_status` -- is Triton importable at all (any device; under ``TRITON_INTERPRET=1`` the kernels
  run on CPU tensors, which is how they are tested without a GPU)?
* :func:`device_status` -- can the kernels run on a given device: CUDA with FP8 conversions (sm89+), or any
  device when the Triton interpreter is on?
* :func:`kernels_usable` -- should the *core* use the kernels for this tensor? Only for CUDA tensors, only when
  the device supports them, and never when ``FP8_LIGHTNING_DISABLE_TRITON=1`` asked for the pure-torch path.
  The core never sends CPU tensors here, so CPU behaviour is untouched.
* :func:`gluon_mx_gemm_status` -- should the MX GEMM run its Gluon form (``block_gemm_gluon``)? Only when
  ``FP8_LIGHTNING_GLUON_MX_GEMM=1`` opted in, on a CUDA device of capability 9.x (Hopper), with a Triton whose
  Gluon dialect imports (:func:`gluon_status`); otherwise the shipped ``block_gemm`` kernel runs.

Every check returns ``(ok, reason)``; the same reason feeds errors (:func:`require_triton`) and test skips.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings

import torch

from fp8_lightning.formats import FP8_MIN_CAPABILITY
from fp8_lightning.settings import settings

DISABLE_ENV = "FP8_LIGHTNING_DISABLE_TRITON"
GLUON_MX_GEMM_ENV = "FP8_LIGHTNING_GLUON_MX_GEMM"
GLUON_CAPABILITY_MAJOR = 9  # the Gluon MX GEMM is written for Hopper's wgmma and TMA
INTERPRET_ENV = "TRITON_INTERPRET"
EXPLICIT_ROUNDING_ENV = "FP8_LIGHTNING_TRITON_EXPLICIT_ROUNDING"
MIN_CAPABILITY = FP8_MIN_CAPABILITY  # hardware FP8 conversions (Ada, Hopper, Blackwell)
SUPPORTED_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the cast kernels read
MX_BLOCK_SIZES = (16, 32, 64, 128)  # MX quantization
SCALE_ROUNDINGS = ("rceil", "floor")  # MX scale rules (the reference: fp8_lightning.mx)
MX_GEMM_BLOCK_SIZES = (32, 64, 128)  # the block-scaled GEMM
GEMM_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def disabled_by_env() -> bool:
    """True when ``FP8_LIGHTNING_DISABLE_TRITON`` forces the pure-torch path (:mod:`fp8_lightning.settings`)."""
    return settings().disable_triton


def interpreting() -> bool:
    """True when Triton's CPU interpreter is on (``TRITON_INTERPRET=1``, Triton's own variable, read per call)."""
    return os.environ.get(INTERPRET_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def explicit_rounding() -> bool:
    """Whether the cast kernels round to the FP8 grid in float32 before converting (read at each launch).

    On under the interpreter, whose float8 conversion is not round-to-nearest-even (ties round up, a rounding
    carry into an odd exponent loses the carry, subnormals flush); after explicit rounding it only converts exact
    values, which it does correctly. GPUs convert with hardware round-to-nearest-even, so the extra arithmetic is
    never needed there, and ``FP8_LIGHTNING_TRITON_EXPLICIT_ROUNDING=1`` is ignored on a GPU with a warning: on an
    H100 with Triton 3.6 the transposed copies of the explicitly rounded casts came out wrong (constant bytes)
    while the row-major ones were exact.
    """
    if interpreting():
        return True
    if settings().triton_explicit_rounding:
        _warn_explicit_rounding_ignored()
    return False


@functools.lru_cache(maxsize=1)
def _warn_explicit_rounding_ignored() -> None:
    warnings.warn(
        "FP8_LIGHTNING_TRITON_EXPLICIT_ROUNDING=1 is ignored on a GPU: the hardware conversion already rounds to "
        "nearest even, and the explicitly rounded transposed casts were wrong on an H100 with Triton 3.6. Unset it "
        "to silence this warning.",
        stacklevel=3,
    )


@functools.lru_cache(maxsize=1)
def triton_status() -> tuple[bool, str]:
    """Whether ``import triton`` works, and the version or the import error."""
    try:
        triton = importlib.import_module("triton")
    except Exception as err:  # ImportError, or a broken install raising something else
        return False, f"Triton is not importable ({type(err).__name__}: {err})"
    return True, f"Triton {getattr(triton, '__version__', '?')}"


def device_status(device: torch.device | str) -> tuple[bool, str]:
    """Whether the kernels can run on ``device`` (ignores the disabling environment variable)."""
    ok, reason = triton_status()
    if not ok:
        return False, reason
    device = torch.device(device)
    if interpreting():
        return True, f"{reason}, interpreter ({INTERPRET_ENV}=1) on {device.type}"
    if device.type != "cuda":
        return False, (
            f"the Triton kernels run on CUDA devices; got a {device.type} tensor (set {INTERPRET_ENV}=1 before "
            "importing triton to run them in the interpreter, for testing)"
        )
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return False, (
            f"CUDA device '{torch.cuda.get_device_name(device)}' has compute capability "
            f"{capability[0]}.{capability[1]}; the FP8 kernels need {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+"
        )
    return True, f"{reason} on compute capability {capability[0]}.{capability[1]}"


def kernels_usable(x: torch.Tensor) -> bool:
    """Whether the core should use the kernels for ``x``: only CUDA tensors qualify (the interpreter is for
    testing the kernels directly, never for the core), on a device that runs them, unless disabled."""
    return x.is_cuda and cuda_kernels_enabled(x.device.index)


@torch.compiler.assume_constant_result
def cuda_kernels_enabled(index: int | None) -> bool:
    """Whether the core uses the kernels on CUDA device ``index``: usable there and not disabled.

    ``torch.compile`` evaluates this once while tracing and keeps the answer in the compiled graph; the settings it
    reads are fixed for the process anyway (:mod:`fp8_lightning.settings`).
    """
    return not disabled_by_env() and _cuda_usable(index)


@functools.lru_cache(maxsize=None)
def _cuda_usable(index: int | None) -> bool:
    return device_status(torch.device("cuda", index) if index is not None else torch.device("cuda"))[0]


def require_triton(what: str, device: torch.device | str) -> None:
    """Raise a clear error when the kernel ``what`` was requested but cannot run on ``device``."""
    ok, reason = device_status(device)
    if not ok:
        raise RuntimeError(
            f"fp8_lightning.kernels.{what} cannot run: {reason}. Install Triton (pip install triton, Linux) and use "
            "an NVIDIA GPU with compute capability 8.9+, or call the pure-PyTorch twin in fp8_lightning.quantize / "
            "fp8_lightning.gemm, which the library uses automatically when the kernels are unavailable."
        )


@functools.lru_cache(maxsize=1)
def gluon_status() -> tuple[bool, str]:
    """Whether the Gluon MX GEMM's module imports with this Triton (Gluon is experimental: its names move between
    versions, and older Tritons have none), and the import error when not."""
    ok, reason = triton_status()
    if not ok:
        return False, reason
    try:
        importlib.import_module("fp8_lightning.kernels.block_gemm_gluon")
    except Exception as err:  # ImportError, or a Gluon whose API differs (AttributeError at import)
        return False, f"{reason} has no usable Gluon dialect ({type(err).__name__}: {err})"
    return True, f"{reason} with Gluon"


def gluon_mx_gemm_status(device: torch.device | str) -> tuple[bool, str]:
    """Whether the MX GEMM on ``device`` runs the Gluon kernel, and why (not): opted in, not interpreting, a CUDA
    device of capability 9.x, Gluon importable. The shipped kernel runs whenever this says no."""
    if not settings().gluon_mx_gemm:
        return False, f"not opted in ({GLUON_MX_GEMM_ENV}=1 selects it on Hopper)"
    if interpreting():
        return False, f"the Triton interpreter ({INTERPRET_ENV}=1) cannot run Gluon kernels"
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"the Gluon MX GEMM runs on CUDA devices; got {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability[0] != GLUON_CAPABILITY_MAJOR:
        return False, (
            f"the Gluon MX GEMM is written for Hopper (capability {GLUON_CAPABILITY_MAJOR}.x); this device has "
            f"{capability[0]}.{capability[1]}"
        )
    ok, reason = gluon_status()
    return ok, reason if not ok else f"{GLUON_MX_GEMM_ENV}=1 on capability {capability[0]}.{capability[1]}, {reason}"
