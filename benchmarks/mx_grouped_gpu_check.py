"""The MXFP8 grouped GEMMs on sm_100 (``torch._scaled_grouped_mm``, torch's MSLK kernel): checked against the emulated
MX grouped GEMM on the same device and operands, then timed against bf16 ``torch._grouped_mm``.

Check: ``fp8_grouped_mm`` under ``MXFP8BlockScaling()`` forward + backward, once on the native route and once with it
switched off (the FP8 operands' exact values multiplied in float32), at small expert shapes with empty experts and
groups that are no multiple of 32: output, input and weight gradients within bf16 rounding (the kernel writes bf16),
empty experts' weight gradient exactly zero, exactly three grouped launches. Timing (after a passing check): the
whole forward + backward (casts included) against bf16 ``torch._grouped_mm`` forward + backward, and the fprop GEMM
alone against its bf16 twin, at Qwen3-30B-A3B and DeepSeek-V3 expert shapes with skewed routing (CUDA events, median
of ``--rounds``). Where the route cannot run (no CUDA, sm_90, a torch without the kernel) it prints why and exits 0.

Usage::

    python -m benchmarks mx-grouped-gpu [--rounds 10] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import sys
from unittest import mock

import torch

from benchmarks.bench_common import cuda_median_ms

from fp8_lightning import fp8_grouped_mm, mx_grouped
from fp8_lightning.recipes import MXFP8BlockScaling

CASES = {  # name: (tokens per expert, K, N)
    "ragged + empty": ([0, 5, 33, 17, 0, 40], 64, 96),
    "16 experts, skewed": ([200, 90, 0, 31, 7, 1, 0, 64, 3, 0, 18, 250, 2, 0, 9, 77], 256, 512),
    "all but one empty": ([0, 0, 0, 37, 0, 0], 64, 128),
}
SHAPES = {  # name: (experts, K, N, routed rows)
    "qwen3-30b-a3b gate_up": (128, 2048, 1536, 16384),
    "deepseek-v3 gate_up (32 local experts)": (32, 7168, 4096, 32768),
}


def _skewed(experts: int, rows: int) -> list[int]:
    weights = [0.0 if e % 8 == 7 else 1.0 / (1 + e % 5) for e in range(experts)]
    sizes = [int(rows * w / sum(weights)) for w in weights]
    sizes[0] += rows - sum(sizes)
    return sizes


def _inputs(sizes, k, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = sum(sizes)
    a = (torch.randn(m, k, generator=g) * torch.logspace(-1, 1, k)).cuda().bfloat16()
    b = (torch.randn(len(sizes), k, n, generator=g) / k**0.5).cuda().bfloat16()
    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32).cuda()
    return a, b, offs, torch.randn(m, n, generator=g).cuda().bfloat16()


def _step(a, b, offs, grad, native: bool):
    a_, b_ = a.clone().requires_grad_(), b.clone().requires_grad_()
    with mock.patch.object(MXFP8BlockScaling, "grouped_native",
                           MXFP8BlockScaling.grouped_native if native else (lambda self, device, experts: None)):
        y = fp8_grouped_mm(a_, b_, offs, recipe=MXFP8BlockScaling())
        y.backward(grad)
    return [t.float() for t in (y, a_.grad, b_.grad)]


def check(lines: list[str]) -> bool:
    ok = True
    launches = []
    original = mx_grouped._launch
    for name, (sizes, k, n) in CASES.items():
        a, b, offs, grad = _inputs(sizes, k, n)
        emulated = _step(a, b, offs, grad, native=False)
        launches.clear()
        with mock.patch.object(mx_grouped, "_launch", lambda *args: launches.append(1) or original(*args)):
            native = _step(a, b, offs, grad, native=True)
        for label, got, ref in zip(("y", "da", "db"), native, emulated):
            err = ((got - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()
            good = err <= 2**-7 and not got.isnan().any()
            ok &= good
            lines.append(f"| {name} | {label} | {err:.2e} | {'ok' if good else 'FAIL'} |")
        empty = [e for e, s in enumerate(sizes) if s == 0]
        zero = all(native[2][e].abs().max().item() == 0 for e in empty)
        ok &= zero and len(launches) == 3
        lines.append(f"| {name} | launches {len(launches)}, empty experts' dW zero: {zero} | | "
                     f"{'ok' if zero and len(launches) == 3 else 'FAIL'} |")
    return ok


def _time_shape(recipe, experts: int, k: int, n: int, rows: int, rounds: int) -> tuple[float, float, float, float]:
    """(bf16 step, MXFP8 step, bf16 fprop GEMM, MXFP8 fprop GEMM) milliseconds at one expert shape."""
    from fp8_lightning.groups import group_bounds

    a, b, offs, grad = _inputs(_skewed(experts, rows), k, n)
    a.requires_grad_(), b.requires_grad_()
    bf16_ms = cuda_median_ms(lambda: torch._grouped_mm(a, b, offs).backward(grad), rounds)
    mx_ms = cuda_median_ms(lambda: fp8_grouped_mm(a, b, offs, recipe=recipe).backward(grad), rounds)
    bounds = group_bounds(offs, a.shape[0], experts)
    x = recipe.grouped_operands("input", a.detach(), bounds, torch.float8_e4m3fn, False, None, False)[0]
    w = recipe.grouped_weight_operands(b.detach().transpose(1, 2), torch.float8_e4m3fn, [None] * experts, False)
    args = mx_grouped.mx_fprop_args(x, w, offs)
    gemm_mx = cuda_median_ms(lambda: mx_grouped._launch(*args, offs), rounds)
    gemm_bf16 = cuda_median_ms(lambda: torch._grouped_mm(a.detach(), b.detach(), offs), rounds)
    return bf16_ms, mx_ms, gemm_bf16, gemm_mx


def timings(lines: list[str], rounds: int) -> None:
    recipe = MXFP8BlockScaling()
    for name, (experts, k, n, rows) in SHAPES.items():
        bf16_ms, mx_ms, gemm_bf16, gemm_mx = _time_shape(recipe, experts, k, n, rows, rounds)
        lines.append(f"| {name} | {rows} | {bf16_ms:.3f} | {mx_ms:.3f} | {bf16_ms / mx_ms:.2f}x | {gemm_bf16:.3f} | "
                     f"{gemm_mx:.3f} | {gemm_bf16 / gemm_mx:.2f}x |")
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("skip: the MXFP8 grouped GEMM check needs a CUDA device (none here)")
        return 0
    reason = mx_grouped.mx_native_unavailable_reason(torch.device("cuda"), 8)
    name = torch.cuda.get_device_name()
    if reason is not None:
        print(f"skip on {name}, torch {torch.__version__}: {reason}")
        return 0
    lines = [f"# MXFP8 grouped GEMM on {name}, torch {torch.__version__}", "",
             "| case | tensor | max error / max | verdict |", "|---|---|---|---|"]
    ok = check(lines)
    if ok:
        lines += ["", "| shape | rows | bf16 step ms | MXFP8 step ms | speedup | bf16 fprop ms | MXFP8 fprop ms | "
                  "speedup |", "|---|---|---|---|---|---|---|---|"]
        timings(lines, args.rounds)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
