"""The native grouped FP8 GEMM on a GPU against the CPU emulation: ``fp8_grouped_mm`` under the rowwise recipe on CUDA
(``torch._scaled_grouped_mm``, one launch per GEMM) and on the CPU (FP8 operands' exact values in float32) at small
expert shapes with empty experts and groups that are no multiple of 16; output, input gradient and weight gradient
must agree within bf16 rounding (the kernel writes bf16), empty experts must get exactly zero weight gradient, and
the forward + backward must make exactly three grouped launches whatever the number of experts. It also records what
the installed torch says about the grouped API (schema, route per recipe). Exit status 1 on any failure.

Usage::

    python -m benchmarks grouped-gpu-check --out results/grouped-gpu-check.md
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch

from fp8_lightning import RowwiseScaling, fp8_grouped_mm, rowwise_grouped
from fp8_lightning.capability_table import recipe_grouped_route
from fp8_lightning.recipes import RECIPES

CASES = {  # name: (tokens per expert, K, N)
    "ragged + empty": ([0, 5, 33, 17, 0, 40], 64, 96),
    "one expert": ([48], 128, 64),
    "16 experts, skewed": ([200, 90, 0, 31, 7, 1, 0, 64, 3, 0, 18, 250, 2, 0, 9, 77], 256, 512),
    "all but one empty": ([0, 0, 0, 37, 0, 0], 64, 128),
}


def run(sizes, k, n, device, seed=0):
    """(y, da, db) of one fp8_grouped_mm forward + backward in bf16 on ``device`` (the same inputs everywhere)."""
    g = torch.Generator().manual_seed(seed)
    m = sum(sizes)
    a = torch.randn(m, k, generator=g) * torch.logspace(-1, 1, k)
    b = torch.randn(len(sizes), k, n, generator=g) / k**0.5
    grad = torch.randn(m, n, generator=g)
    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
    a_ = a.to(device, torch.bfloat16).requires_grad_()
    b_ = b.to(device, torch.bfloat16).requires_grad_()
    y = fp8_grouped_mm(a_, b_, offs.to(device), recipe=RowwiseScaling())
    y.backward(grad.to(device, torch.bfloat16))
    return [t.float().cpu() for t in (y, a_.grad, b_.grad)]


def counted_launches(sizes, k, n) -> int:
    """How many torch._scaled_grouped_mm calls one CUDA forward + backward makes."""
    calls, original = [], rowwise_grouped._launch

    def launch(*args):
        calls.append(1)
        return original(*args)

    rowwise_grouped._launch = launch
    try:
        run(sizes, k, n, "cuda")
    finally:
        rowwise_grouped._launch = original
    return len(calls)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the report (Markdown) here too")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("grouped-gpu-check: no CUDA device here; run it on a GPU machine")
        return 1
    lines = [f"# grouped GPU check: {torch.cuda.get_device_name()}, torch {torch.__version__}", ""]
    failures: list[str] = []
    lines.append("schemas: " + "; ".join(str(s) for s in torch._C._jit_get_schemas_for_operator(
        "aten::_scaled_grouped_mm")))
    lines.append(f"torch.nn.functional.scaled_grouped_mm: {hasattr(torch.nn.functional, 'scaled_grouped_mm')}")
    for name, cls in RECIPES.items():
        route = recipe_grouped_route(cls(), "cuda")
        lines.append(f"grouped route {name}: {route.verdict}: {route.gemm} ({route.why})")
    reason = rowwise_grouped.native_unavailable_reason(torch.device("cuda"), 8)
    if reason is not None:
        lines.append(f"FAIL: no native rowwise grouped route on this device: {reason}")
        failures.append("route")
    lines += ["", "| case | experts | tokens | K | N | tensor | max abs err | tolerance | result |",
              "|---|---|---|---|---|---|---|---|---|"]
    for case, (sizes, k, n) in CASES.items() if reason is None else ():
        cpu = run(sizes, k, n, "cpu")
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="fp8_grouped_mm on cuda")  # the emulated route's warning
            cuda = run(sizes, k, n, "cuda")
        for tensor, ref, got in zip(("y", "da", "db"), cpu, cuda):
            err = (got - ref).abs().max().item() if ref.numel() else 0.0
            tol = 2**-7 * ref.abs().max().item() if ref.numel() else 0.0
            ok = bool(torch.isfinite(got).all()) and err <= tol
            if tensor == "db":
                ok = ok and all(got[e].abs().max().item() == 0 for e, s in enumerate(sizes) if s == 0)
            failures += [] if ok else [f"{case} {tensor}"]
            lines.append(f"| {case} | {len(sizes)} | {sum(sizes)} | {k} | {n} | {tensor} | {err:.3g} | {tol:.3g} | "
                         f"{'ok' if ok else 'FAIL'} |")
    if reason is None:
        counts = {e: counted_launches([24, 0, 40, 16] * (e // 4), 64, 64) for e in (4, 64)}
        ok = set(counts.values()) == {3}
        failures += [] if ok else ["launch count"]
        lines.append(f"\ngrouped launches per forward + backward: {counts} (experts: launches): {'ok' if ok else 'FAIL'}")
    lines.append(f"\n{'FAILED: ' + ', '.join(failures) if failures else 'all checks passed'}")
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
