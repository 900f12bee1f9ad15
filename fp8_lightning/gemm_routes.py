"""Which GEMM serves a recipe on a CUDA architecture, and at what rate: the facts the capability table is made of.

Each recipe answers :meth:`~fp8_lightning.recipes.base.Recipe.gemm_route` for a simulated device (compute
capability, CUDA version, whether torch has the v2 ``scaled_mm``); the answer is a :class:`GemmRoute`. The rates
are GEMM throughput relative to a bf16 GEMM on the same device, used by the profitability model:

* native FP8 tensor cores run at twice the dense bf16 rate (Ada, Hopper and Blackwell datasheets), FP4 tensor cores
  at four times it (B200 datasheet: 9 dense FP4 PFLOP/s against 2.25 bf16; not yet measured here);
* the Triton MX GEMM on Hopper, which has no MX tensor cores, ran at 213 TFLOP/s against bf16's 683 at 8192 cubed
  on an H100 (``benchmarks/results/gpu-h100-20261126/kernels_gpu.md``);
* a GEMM emulated in float32 runs at the float32 rate: 63.9 ms against bf16's 4.31 ms for an 8192 linear layer on
  the same H100 (``benchmarks/results/gpu-h100-20261126/linear-eager``);
* the rowwise grouped expert step through ``torch._scaled_grouped_mm`` ran at 0.37x of bf16 grouped GEMMs for
  DeepSeek-V3's gate_up experts at 32768 routed rows on an H200 (0.18x-0.40x over the measured shapes): the casts of
  every expert's weight and torch 2.11's FP8 grouped kernel, barely faster than bf16, cost more than the saving
  (``benchmarks/results/gpu-h200-grouped-20261126.md``).
"""

from __future__ import annotations

from typing import NamedTuple

NATIVE, FALLBACK, REFUSED, EMULATED, UNKNOWN = "native", "fallback", "refused", "emulated", "unknown"

# ScaledBlas.cpp (_scaled_rowwise_rowwise): cuBLAS's rowwise-scaled GEMM needs sm_90 and cuBLAS 12.9; otherwise torch
# runs its CUTLASS kernel
CUBLAS_ROWWISE_MIN_CUDA = (12, 9)

NATIVE_FP8_RATE = 2.0
NATIVE_FP4_RATE = 4.0
TRITON_MX_RATE = 213 / 683
FLOAT32_RATE = 4.31 / 63.9
ROWWISE_GROUPED_STEP_RATE = 19.34 / 51.83  # DeepSeek-V3 gate_up at 32768 rows on an H200 (rowwise defaults)
# The rowwise grouped step through the Triton grouped GEMM: DeepSeek-V3 gate_up on an H100 (0.15x-0.19x measured)
TRITON_GROUPED_STEP_RATE = 4.867 / 25.008
TRITON_GROUPED_GEMM = "Triton grouped FP8 GEMM (fp8_lightning.kernels.grouped_gemm)"

Capability = tuple[int, int]
CudaVersion = tuple[int, int] | None


class GemmRoute(NamedTuple):
    """How a recipe's GEMMs run on one device.

    ``verdict``: :data:`NATIVE` (FP8 tensor cores through cuBLAS or CUTLASS), :data:`FALLBACK` (runs, slower: a
    Triton kernel or float32 emulation), :data:`REFUSED` (cannot run without ``emulate=True``), :data:`EMULATED`
    (the CPU: FP8 numerics, no speed) or :data:`UNKNOWN` (a recipe that does not say). ``gemm`` names what runs;
    ``why`` says why this route; ``rate_vs_bf16`` is the GEMM throughput relative to bf16 on the same device (0
    where it does not run)."""

    verdict: str
    gemm: str
    why: str
    rate_vs_bf16: float

    @property
    def runs(self) -> bool:
        return self.verdict != REFUSED


def native(gemm: str, why: str) -> GemmRoute:
    return GemmRoute(NATIVE, gemm, why, NATIVE_FP8_RATE)


def native_fp4(gemm: str, why: str) -> GemmRoute:
    return GemmRoute(NATIVE, gemm, why, NATIVE_FP4_RATE)


def native_grouped_rowwise(why: str) -> GemmRoute:
    """torch's CUTLASS rowwise grouped GEMM: native tensor cores, but the grouped step around it measured slower than
    bf16 (the rate the profitability gate reads)."""
    return GemmRoute(NATIVE, "CUTLASS rowwise grouped GEMM (torch._scaled_grouped_mm)", why, ROWWISE_GROUPED_STEP_RATE)


def native_grouped_triton(why: str) -> GemmRoute:
    """The Triton grouped FP8 GEMM (tensor cores, one launch per GEMM) at :data:`TRITON_GROUPED_STEP_RATE`."""
    return GemmRoute(NATIVE, TRITON_GROUPED_GEMM, why, TRITON_GROUPED_STEP_RATE)


def emulated_on_gpu(why: str) -> GemmRoute:
    """The GEMM on dequantized operands in float32, on the GPU: right results at the float32 rate."""
    return GemmRoute(FALLBACK, "float32 emulation (dequantized operands)", why, FLOAT32_RATE)


def triton_mx(why: str) -> GemmRoute:
    return GemmRoute(FALLBACK, "Triton MX GEMM (scales folded on the CUDA cores)", why, TRITON_MX_RATE)


def arch_name(capability: Capability) -> str:
    return f"sm_{capability[0]}{capability[1]}"


def cuda_name(cuda: CudaVersion) -> str:
    return "no CUDA" if cuda is None else f"CUDA {cuda[0]}.{cuda[1]}"
