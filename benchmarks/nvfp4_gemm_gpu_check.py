"""The NVFP4 layer's native GEMMs (cuBLAS FP4 through ``torch.nn.functional.scaled_mm``) on an sm_100+ GPU: checked
against the emulation and float64 math on the same operands, and timed against the emulation and bf16.

Each case runs one real training step of an NVFP4 layer on CUDA and keeps the operands of its three GEMMs (fprop,
dgrad, wgrad). Check: the native GEMM (``nvfp4_gemm.nvfp4_mm``) and the emulated one (``emulate=True``: the
dequantized operands multiplied in float32) each lie within float32 summation plus the bf16 output's rounding of
the float64 product of the dequantized operands. Timing (CUDA events, median of ``--iters`` after warm-up): the
native call, the float32 GEMM of the emulation (dequantized operands kept) and a bf16 ``torch.mm`` of the same
shapes. On a GPU without FP4 tensor cores (sm_90 and older), or a torch without the BlockWise1x16 call, it says why
it skips and exits 0. Exit status 1 on any check that fails.

Usage::

    python -m benchmarks nvfp4-gemm-gpu --out results/nvfp4_gemm_gpu.md
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from benchmarks.bench_common import cuda_median_ms, write_gpu_report
import torch.nn as nn

LAYERS = [(77, 4096, 4096), (4096, 4096, 4096), (4096, 4096, 14336), (4096, 14336, 4096)]  # (M, K, N), Llama-3-8B
RECIPES = {"16x16 tiles, RHT, stochastic": {}, "1x16 blocks, no RHT, nearest": {
    "fp4_2d_weights": False, "disable_rht": True, "disable_stochastic_rounding": True}}


def layer_operands(recipe, m: int, k: int, n: int) -> list[tuple]:
    """(role, a, b) of the three NVFP4 GEMMs of one training step of a ``k -> n`` CUDA layer on ``m`` tokens."""
    from fp8_lightning import FP8Linear, fp8_autocast
    from fp8_lightning.recipes.nvfp4 import NVFP4

    seen, original = [], NVFP4.gemm

    def record(a, b, out_dtype, emulate=False, bias=None, fast_accum=False):
        seen.append((a, b))
        return original(a, b, out_dtype, emulate, bias, fast_accum)

    torch.manual_seed(0)
    layer = FP8Linear.from_linear(nn.Linear(k, n, device="cuda", dtype=torch.bfloat16), recipe)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    NVFP4.gemm = record
    try:
        with fp8_autocast():
            layer(x).backward(torch.randn(m, n, device="cuda", dtype=torch.bfloat16))
    finally:
        NVFP4.gemm = original
    return [(role, a, b) for role, (a, b) in zip(("fprop", "dgrad", "wgrad"), seen)]


def check(a, b) -> tuple[float, float]:
    """(worst |native - exact| / bound, worst |emulated - exact| / bound): both at most 1 to pass."""
    from fp8_lightning.nvfp4_gemm import nvfp4_mm
    from fp8_lightning.ops.dispatch import operand_f32

    a64, b64 = operand_f32(a).double(), operand_f32(b).double()
    exact = a64 @ b64.t()
    bound = (a64.shape[1] + 2) * 2.0**-24 * (a64.abs() @ b64.abs().t())
    bound = bound + 2.0**-8 * (exact.abs() + bound) + 1e-30
    worst = []
    for emulate in (False, True):
        out = nvfp4_mm(a, b, torch.bfloat16, emulate=emulate).double()
        worst.append(((out - exact).abs() / bound).max().item())
    return worst[0], worst[1]


def timings(a, b, iters: int) -> tuple[float, float, float]:
    """(native ms, emulated float32 GEMM ms, bf16 mm ms) of ``a @ b.T``."""
    from fp8_lightning.nvfp4_gemm import nvfp4_scaled_mm_args
    from fp8_lightning.ops.dispatch import operand_f32

    args = nvfp4_scaled_mm_args(a, b)
    a32, b32 = operand_f32(a), operand_f32(b)
    a16, b16 = a32.bfloat16(), b32.bfloat16()
    native = cuda_median_ms(lambda: torch.nn.functional.scaled_mm(**args), iters)
    emulated = cuda_median_ms(lambda: a32 @ b32.t(), iters)
    bf16 = cuda_median_ms(lambda: a16 @ b16.t(), iters)
    return native, emulated, bf16


def skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (10, 0):
        return (f"sm_{major}{minor} ({torch.cuda.get_device_name()}) has no FP4 tensor cores (sm_100 and later have "
                "them): the native NVFP4 GEMM cannot run here, the layer emulates it")
    from fp8_lightning.nvfp4_gemm import native_nvfp4_gemm_support

    ok, reason = native_nvfp4_gemm_support("cuda")
    return None if ok else reason


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the markdown report here (also under $OUT when set)")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    reason = skip_reason()
    if reason is not None:
        print(f"nvfp4-gemm-gpu: skipped: {reason}")
        return 0
    from fp8_lightning.recipes.nvfp4 import NVFP4BlockScaling

    started = time.time()
    lines = [f"# NVFP4 layer GEMMs on {torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA "
             f"{torch.version.cuda})", "", "Error / bound: |out - float64 product of the dequantized operands| over "
             "float32 summation plus bf16 rounding (at most 1 passes). Times: median ms of "
             f"{args.iters} (CUDA events).", "",
             "| recipe | M, K, N | GEMM | native err/bound | emulated err/bound | native ms | emulated fp32 ms | "
             "bf16 ms | bf16 / native |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    failures = 0
    for name, fields in RECIPES.items():
        for m, k, n in LAYERS:
            for role, a, b in layer_operands(NVFP4BlockScaling(**fields), m, k, n):
                native_err, emulated_err = check(a, b)
                failures += native_err > 1 or emulated_err > 1
                native, emulated, bf16 = timings(a, b, args.iters)
                shape = f"{a.data.shape[0]}, {a.data.shape[1] * 2}, {b.data.shape[0]}"
                lines.append(f"| {name} | {shape} | {role} | {native_err:.3f} | {emulated_err:.3f} | {native:.4f} | "
                             f"{emulated:.4f} | {bf16:.4f} | {bf16 / native:.2f}x |")
    lines += ["", f"{failures} GEMMs outside the bound. Wall time {time.time() - started:.1f} s."]
    report = "\n".join(lines) + "\n"
    print(report)
    write_gpu_report(report, args.out, "nvfp4_gemm_gpu.md")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
