"""GPU check of the CUDA paths of the FP8 core against the CPU reference.

Run on a machine with an NVIDIA GPU (sm89+ for per-tensor FP8 GEMMs): ``make gpu-check`` or
``python -m benchmarks gpu-check``. For each recipe it runs FP8Linear forward and backward on CUDA and on CPU
with the same weights and inputs and compares: the quantized operands must be bit-identical (the casts are
deterministic elementwise math), the GEMM results equal within float32 accumulation-order differences.
It exits non-zero on a mismatch and refuses clearly where there is no suitable GPU.
"""

from __future__ import annotations

import argparse
import sys
import traceback

import torch
import torch.nn as nn

from fp8_lightning import (
    BlockwiseScaling,
    DelayedScaling,
    FP8Linear,
    Format,
    MXFP8BlockScaling,
    RowwiseScaling,
    TensorwiseScaling,
    fp8_autocast,
)
from fp8_lightning.blockwise import blockwise_gemm_support, has_scaled_mm_v2
from fp8_lightning.cuda_rules import blockwise_gemm_plan
from fp8_lightning.gemm import fp8_gemm_support
from fp8_lightning.ops.dispatch import fast_quantize_mxfp8, fast_quantize_tensorwise
from fp8_lightning.scaling import OperandScaling

# The CPU accumulates in float32; cuBLAS's fast accumulation (the default for the forward GEMM) does not, so the
# strict comparisons turn it off and "tensorwise-fast" checks it within a looser bound (FAST_ACCUM_TOLERANCE).
EXACT = {"fprop_fast_accum": False}
RECIPES = {
    "tensorwise": TensorwiseScaling(**EXACT),
    "tensorwise-fast": TensorwiseScaling(),
    "delayed": DelayedScaling(**EXACT),
    "delayed-e4m3": DelayedScaling(fp8_format=Format.E4M3, **EXACT),
    "mxfp8": MXFP8BlockScaling(fp8_format=Format.HYBRID),
    "rowwise": RowwiseScaling(),
    "rowwise-hp-wgrad": RowwiseScaling(high_precision_wgrad=True),
    "blockwise": BlockwiseScaling(power_of_2_scales=False),
}


def check_casts() -> list[str]:
    failures = []
    x = torch.randn(512, 1024) * 7
    for fmt in ("E4M3", "E5M2"):
        cpu = fast_quantize_tensorwise(x, fmt)
        gpu = fast_quantize_tensorwise(x.cuda(), fmt)
        if not torch.equal(cpu[0].view(torch.uint8), gpu[0].cpu().view(torch.uint8)):
            failures.append(f"tensorwise cast {fmt}: bytes differ")
    for rounding in ("rceil", "floor"):
        cpu = fast_quantize_mxfp8(x, scale_rounding=rounding)
        gpu = fast_quantize_mxfp8(x.cuda(), scale_rounding=rounding)
        for name, a, b in zip(("data", "scale"), cpu, gpu):
            if not torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8)):
                failures.append(f"mxfp8 {rounding} {name}: bytes differ")
    return failures


def check_scaling_states() -> list[str]:
    """Per-tensor scaling states on CUDA, whose cast kernels also do the bookkeeping, against CPU: several steps,
    tensors spanning many programs, zero, NaN and inf tensors, one evaluation cast; casts and every state tensor
    equal bit for bit (NaN amaxes as NaN)."""
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(1000, 1024, generator=gen) * 10.0**k for k in (-3, 0, 3)]
    nan, inf = torch.randn(1000, 1024, generator=gen), torch.randn(1000, 1024, generator=gen)
    nan[999, 5], inf[0, 0] = float("nan"), float("-inf")
    inputs += [torch.zeros(64, 64), nan, inf, torch.randn(3, 5, generator=gen)]
    failures = []
    for name, recipe in (("delayed", DelayedScaling(amax_history_len=4)), ("tensorwise", TensorwiseScaling())):
        states = {d: OperandScaling(recipe, torch.float8_e5m2, d) for d in ("cpu", "cuda")}
        for i, x in enumerate(inputs):
            cpu, cuda = (states[d].quantize(x.to(d), record=i != 1) for d in ("cpu", "cuda"))
            if not torch.equal(cpu.data.view(torch.uint8), cuda.data.cpu().view(torch.uint8)):
                failures.append(f"{name} state, cast {i}: bytes differ")
            for field in OperandScaling._TENSORS:
                a, b = getattr(states["cpu"], field), getattr(states["cuda"], field).cpu()
                if not torch.allclose(a, b, rtol=0, atol=0, equal_nan=True):
                    failures.append(f"{name} state, cast {i}: {field} differs ({a} vs {b})")
            for state in states.values():
                state.update()
    return failures


# Relative to the largest output. The CPU emulation sums exact products in float32; Hopper's FP8 tensor cores keep
# about 14 mantissa bits in their accumulator (DeepSeek-V3 technical report, section 3.3.2), which cuBLAS promotes to
# float32 at intervals unless fast accumulation is on. Seen on an H100 (torch 2.11, 2026-11-26): up to 5.1e-4
# promoted, 1.4e-3 with fast accumulation; the rowwise (CUTLASS) forward GEMM reached 1.25e-3, as fast
# accumulation does, with the recipe's fast accumulation off.
PROMOTED_TOLERANCE = 2.0**-10
FAST_ACCUM_TOLERANCE = 2.0**-8


def check_linear(name, recipe, in_features: int = 1024, out_features: int = 512, tokens: int = 256) -> list[str]:
    torch.manual_seed(0)
    base = nn.Linear(in_features, out_features)
    x, g = torch.randn(tokens, in_features), torch.randn(tokens, out_features)
    results = {}
    for device in ("cpu", "cuda"):
        layer = FP8Linear.from_linear(nn.Linear(in_features, out_features).to(device), recipe)
        layer.load_state_dict(base.state_dict())
        xi = x.detach().to(device).requires_grad_()
        with fp8_autocast():
            y = layer(xi)
        y.backward(g.to(device))
        results[device] = [t.detach().double().cpu() for t in (y, xi.grad, layer.weight.grad)]
    failures = []
    for what, a, b in zip(("fprop", "dgrad", "wgrad"), results["cpu"], results["cuda"]):
        err = ((a - b).abs().max() / a.abs().max()).item()
        print(f"  {name:14s} {what}: max relative difference CPU vs CUDA {err:.2e}")
        fast = recipe.fprop_fast_accum if what == "fprop" else recipe.grad_fast_accum
        fast = fast or (what == "fprop" and recipe.name == "rowwise")
        if err > (FAST_ACCUM_TOLERANCE if fast else PROMOTED_TOLERANCE):
            failures.append(f"{name} {what}: CPU and CUDA differ by {err:.2e}")
    return failures


# (in_features, out_features, tokens) where v1 torch._scaled_mm refused the padded 128x128 scale (ceil(K/128) % 4 != 0
# with more than one row of blocks, in fprop or dgrad): hidden 768 (fc1 fprop, fc2 dgrad), GPT-2's lm_head (dgrad:
# 393 K-blocks), Llama-2's FFN 11008 (up projection dgrad: 86 K-blocks), and a ragged shape that the plan emulates.
# fp8_lightning.cuda_rules names the path of each GEMM; this runs them for real and compares them with the CPU.
BLOCKWISE_SHAPES = ((768, 3072, 256), (3072, 768, 200), (768, 50304, 256), (4096, 11008, 128), (160, 144, 77))


def check_blockwise_shapes() -> list[str]:
    """Blockwise FP8Linear at :data:`BLOCKWISE_SHAPES` on CUDA against CPU, printing the path of each GEMM first."""
    capability, has_v2 = torch.cuda.get_device_capability(), has_scaled_mm_v2()
    cuda = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
    print(f"  blockwise shapes: compute capability {capability}, CUDA {torch.version.cuda}, torch has v2 scaled_mm: "
          f"{has_v2}")
    failures = []
    for k, n, m in BLOCKWISE_SHAPES:
        for role, (rows, red, cols, block) in {"fprop": (m, k, n, "b"), "dgrad": (m, n, k, "b"),
                                               "wgrad": (n, m, k, None)}.items():
            path, why = blockwise_gemm_plan(rows, red, cols, capability, has_v2, cuda, block)
            print(f"    {k}->{n} x{m} {role}: {path} ({why})")
        failures += check_linear(f"blockwise {k}->{n}", RECIPES["blockwise"], k, n, m)
    return failures


def check_compiled(mode: str = "reduce-overhead") -> list[str]:
    """Per recipe, three training steps of one FP8Linear under ``torch.compile(mode=..., fullgraph=True)`` against the
    eager layer on CUDA (CUDA graphs under reduce-overhead replay the in-place scaling-state updates)."""
    failures = []
    for name in ("tensorwise", "delayed", "mxfp8", "rowwise", "blockwise"):
        torch.manual_seed(0)
        eager = FP8Linear.from_linear(nn.Linear(1024, 512).cuda(), RECIPES[name])
        compiled = FP8Linear.from_linear(nn.Linear(1024, 512).cuda(), RECIPES[name])
        compiled.load_state_dict(eager.state_dict())
        step = torch.compile(compiled, mode=mode, fullgraph=True)
        x = torch.randn(256, 1024, device="cuda")
        for layer in (eager, step):
            for _ in range(3):
                with fp8_autocast(), torch.autocast("cuda", torch.bfloat16):
                    layer(x).float().square().mean().backward()
        err = ((compiled.weight.grad - eager.weight.grad).abs().max() / eager.weight.grad.abs().max()).item()
        print(f"  compiled ({mode}) {name:10s} wgrad: max relative difference to eager {err:.2e}")
        if not err <= 2.0**-7:  # bf16 outputs: one bf16 rounding apart at most
            failures.append(f"compiled {name}: weight gradients differ from eager by {err:.2e}")
    return failures


def guarded(name: str, check, only: set[str]) -> list[str]:
    """The failures of ``check()`` if ``name`` was asked for; an exception is one failure, so the rest still run."""
    if name not in only:
        return []
    try:
        return check()
    except Exception as error:  # noqa: BLE001 - reported as a failure with its type and message
        traceback.print_exc()
        return [f"{name} raised {type(error).__name__}: {error}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    checks = ["casts", "scaling", "blockwise-shapes", *RECIPES, "compiled"]
    parser.add_argument("--only", nargs="+", choices=checks, metavar="CHECK",
                        help=f"run only these checks, of: {', '.join(checks)} (default: all)")
    only = set(parser.parse_args(argv).only or checks)
    if not torch.cuda.is_available():
        print("gpu_check: CUDA is not available on this machine; nothing to check (run it on an NVIDIA GPU).")
        return 2
    ok, reason = fp8_gemm_support("cuda")
    print(f"device: {torch.cuda.get_device_name()} ({reason}); torch {torch.__version__}")
    if not ok:
        print(f"gpu_check: {reason}")
        return 2
    failures = guarded("casts", check_casts, only) + guarded("scaling", check_scaling_states, only)
    failures += guarded("blockwise-shapes", check_blockwise_shapes, only)  # first: the shapes v1 refused
    for name, recipe in RECIPES.items():
        native, why = blockwise_gemm_support("cuda")
        if name in only and isinstance(recipe, BlockwiseScaling) and not native:
            print(f"  {name:14s} emulated (warned once): {why}")
        failures += guarded(name, lambda: check_linear(name, recipe), only)
    failures += guarded("compiled", check_compiled, only)
    print("\n".join(["FAILED: " + f for f in failures]) if failures else "all CUDA paths match the CPU reference")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
