"""Verdicts on the recorded GEMMs, and the runs over recipes, architectures, steps and shapes.

A GEMM is

* **native** when every torch call it made is legal on the simulated device (:mod:`.rules`, :mod:`.rules_v2`) and
  passed torch's meta function, or when it ran the Triton MX GEMM;
* a **fallback** when it made no FP8 GEMM call: the library emulated it in float32 (the reason is the library's own
  warning where it gives one), or the recipe computes it in high precision;
* a **violation** when a call breaks a rule: torch would raise on a GPU, cuBLAS would compute wrong results, or
  ``torch.compile``'s meta function would refuse it.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Iterator

import torch

from fp8_lightning.cuda_contract import rules_nvfp4, rules_v2
from fp8_lightning.cuda_contract.rules import CONTRACT_ARCHS, FLOAT8, Facts, Outcome, Target, scaled_mm_v1
from fp8_lightning.cuda_contract.simulate import MODES, TRITON_API, V1_API, Call, GemmRecord, run_layer
from fp8_lightning.recipes import RECIPES

NATIVE, FALLBACK, VIOLATION = "native", "fallback", "violation"

# (in_features, out_features) of the layers of each model; ragged token counts are in TOKENS.
MODELS = {
    "gpt2": [(768, 2304), (768, 768), (768, 3072), (3072, 768), (768, 50304)],
    "llama3-8b": [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096), (4096, 128256)],
    "qwen3-0.6b": [(1024, 2048), (1024, 1024), (2048, 1024), (1024, 3072), (3072, 1024), (1024, 151936)],
    "qwen3-8b": [(4096, 4096), (4096, 1024), (4096, 12288), (12288, 4096), (4096, 151936)],
    "qwen3-30b-a3b-experts": [(2048, 768), (768, 2048)],
    "ragged-features": [(160, 144), (1040, 48)],
}
TOKENS = (1, 77, 4113)


@dataclasses.dataclass
class Verdict:
    """A GEMM's verdict with the call lines that explain it."""

    record: GemmRecord
    status: str
    kernel: str
    reasons: list[str]
    notes: list[str]


def contract_recipes() -> list[str]:
    """The registered recipes whose GEMMs reach torch's scaled GEMMs on some architecture; a recipe emulated in
    float32 everywhere issues no call for the contract to check."""
    from fp8_lightning.capability_table import MATRIX_ARCHS, MATRIX_CUDA, route_on
    from fp8_lightning.gemm_routes import FLOAT32_RATE

    def reaches_a_scaled_gemm(cls) -> bool:
        return any(route_on(cls(), arch, MATRIX_CUDA, True).rate_vs_bf16 != FLOAT32_RATE for arch in MATRIX_ARCHS)

    return sorted(name for name, cls in RECIPES.items() if reaches_a_scaled_gemm(cls))


def _v1_outcome(target: Target, args: dict) -> Outcome:
    return scaled_mm_v1(target, args["mat1"], args["mat2"], args["scale_a"], args["scale_b"], args.get("bias"),
                        args["out_dtype"], args["use_fast_accum"], args.get("scale_result"))


def _v2_outcome(target: Target, args: dict) -> tuple[Outcome, str | None]:
    if rules_nvfp4.FP4 in (args["mat_a"].dtype, args["mat_b"].dtype):
        return _nvfp4_outcome(target, args), None
    scales = [args[k][0] if isinstance(args[k], list) else args[k] for k in ("scale_a", "scale_b")]
    recipes = [args[k][0] if isinstance(args[k], list) else args[k] for k in ("scale_recipe_a", "scale_recipe_b")]
    scale_a, scale_b = (s if isinstance(s, Facts) else Facts.of(s) for s in scales)
    outcome = rules_v2.scaled_mm_v2(
        target, args["mat_a"], args["mat_b"], scale_a, recipes[0], scale_b, recipes[1], args.get("swizzle_a"),
        args.get("swizzle_b"), args.get("bias"), args["out_dtype"], args["use_fast_accum"],
    )
    meta = rules_v2.meta_violation(target, args["mat_a"], args["mat_b"], scale_a, recipes[0], scale_b, recipes[1])
    return outcome, meta


def _nvfp4_outcome(target: Target, args: dict) -> Outcome:
    """The FP4 call's outcome under :mod:`.rules_nvfp4` (lists of block and global scales per operand)."""
    listed = [v if isinstance(v, list) else [v] for v in (args["scale_a"], args["scale_b"])]
    facts = [[f if isinstance(f, Facts) else Facts.of(f) for f in scales] for scales in listed]
    recipes = [v if isinstance(v, list) else [v] for v in (args["scale_recipe_a"], args["scale_recipe_b"])]
    return rules_nvfp4.nvfp4_scaled_mm_v2(
        target, args["mat_a"], args["mat_b"], facts[0], recipes[0], facts[1], recipes[1], args.get("swizzle_a"),
        args.get("swizzle_b"), args.get("bias"), args["out_dtype"], args["use_fast_accum"])


def call_outcome(target: Target, call: Call) -> tuple[str, str | None, str | None]:
    """(kernel, violation, note) of one recorded call."""
    if call.api == TRITON_API:
        return "Triton MX GEMM", None, None
    if call.api == V1_API:
        outcome, meta = _v1_outcome(target, call.args), None
    else:
        outcome, meta = _v2_outcome(target, call.args)
    violation = outcome.violation or (f"torch.compile's meta function: {meta}" if meta else None)
    if violation is None and call.meta_error:
        violation = f"torch's meta function: {call.meta_error}"
    return outcome.kernel, violation, outcome.note


def judge(record: GemmRecord, target: Target) -> Verdict:
    """The verdict on one recorded GEMM for ``target``."""
    if not record.calls:
        if record.a.dtype.is_floating_point and record.a.dtype not in FLOAT8:  # (NVFP4's codes are uint8)
            return Verdict(record, FALLBACK, "high precision", ["the recipe computes this GEMM in high precision"], [])
        reasons = record.warnings or ["emulated: the operands dequantized and multiplied in float32"]
        return Verdict(record, FALLBACK, "float32 emulation", reasons, [])
    kernels, reasons, notes = [], [], []
    for call in record.calls:
        kernel, violation, note = call_outcome(target, call)
        kernels.append(kernel)
        reasons += [f"{call.api}: {violation}"] if violation else []
        notes += [note] if note else []
    return Verdict(record, VIOLATION if reasons else NATIVE, " + ".join(kernels), reasons, notes)


def check_layer(
    target: Target, recipe, m: int, k: int, n: int, modes: Iterable[str] = MODES, dtype: torch.dtype = torch.bfloat16,
    bias: bool = True, triton: bool = True,
) -> list[Verdict]:
    """The verdicts on every GEMM of one ``k -> n`` layer step on ``m`` tokens, for each step mode."""
    return [
        judge(record, target)
        for mode in modes
        for record in run_layer(target, recipe, m, k, n, mode, dtype, bias, triton)
    ]


def recipe_names(spec: str) -> list[str]:
    return contract_recipes() if spec == "all" else spec.split(",")


def arch_names(spec: str) -> list[str]:
    return list(CONTRACT_ARCHS) if spec == "all" else spec.split(",")


def grid_shapes(models: Iterable[str] = MODELS, tokens: Iterable[int] = TOKENS) -> Iterator[tuple[str, int, int, int]]:
    """(model, m, k, n) over the models' layers and the token counts."""
    for model in models:
        for k, n in MODELS[model]:
            for m in tokens:
                yield model, m, k, n


def _describe(value) -> str:
    if torch.is_tensor(value):
        value = Facts.of(value)
    return value.describe() if isinstance(value, Facts) else str(getattr(value, "name", value))


def describe_call(call: Call) -> str:
    """One line per call: each tensor argument's shape, strides and dtype."""
    parts = []
    for name, value in call.args.items():
        if name in ("mat1", "mat_a"):
            continue
        if isinstance(value, list):
            value = value[0] if len(value) == 1 else "[" + ", ".join(_describe(v) for v in value) + "]"
        if isinstance(value, Facts):
            parts.append(f"{name}={value.describe()}")
        elif value is not None:
            parts.append(f"{name}={getattr(value, 'name', value)}")
    first = next((n for n in ("mat1", "mat_a") if n in call.args), None)
    lead = f"{first}={call.args[first].describe()}, " if first else ""
    return f"{call.api}({lead}{', '.join(parts)})"
