"""The CUDA contract for the expert (grouped) GEMMs: every ``torch._scaled_grouped_mm`` call of an experts layer's
training step, built by the library's own argument functions on meta tensors, judged against torch 2.11's rules
(:mod:`.rules_grouped`) and the installed torch's meta function, over recipes, architectures and expert shapes with
skewed token counts (empty experts, groups that are no multiple of 16).

A recipe whose grouped route on the target is not native issues no grouped call: its GEMMs are a fallback (emulated
from the FP8 operands), with the route's reason.
"""

from __future__ import annotations

import torch

from fp8_lightning.cuda_contract.check import FALLBACK, NATIVE, VIOLATION, Verdict
from fp8_lightning.cuda_contract.rules import Facts, Target
from fp8_lightning.cuda_contract.rules_grouped import meta_error, scaled_grouped_mm
from fp8_lightning.cuda_contract.rules_mx_grouped import mx_scaled_grouped_mm
from fp8_lightning.cuda_contract.simulate import Call, GemmRecord
from fp8_lightning.gemm_routes import NATIVE as NATIVE_ROUTE
from fp8_lightning.gemm_routes import TRITON_GROUPED_GEMM
from fp8_lightning.groups import StackedWeights, padded_group_sizes
from fp8_lightning import mx_grouped
from fp8_lightning.quantize import MX, ROW, Quantized
from fp8_lightning.rowwise_grouped import (
    GROUP_ALIGN,
    GroupedColumns,
    dgrad_args,
    fprop_args,
    wgrad_args,
)

GROUPED_API = "torch._scaled_grouped_mm"
E4M3 = torch.float8_e4m3fn

# (experts, hidden, expert intermediate): each expert's gate_up (hidden -> 2 * intermediate) and down projections
EXPERT_MODELS = {
    "qwen3-30b-a3b": (128, 2048, 768),
    "deepseek-v3": (256, 7168, 2048),
    "olmoe-1b-7b": (64, 2048, 1024),
}
EXPERT_TOKENS = (77, 4113)  # tokens routed per step, times top-k below
TOP_K = 8


def skewed_sizes(experts: int, routed: int) -> list[int]:
    """A deterministic skewed split of ``routed`` tokens over ``experts``: weights falling as 1/rank, every fourth
    expert empty, the remainder on the first expert (so sizes are ragged and rarely multiples of 16)."""
    weights = [0.0 if e % 4 == 3 else 1.0 / (e + 1) for e in range(experts)]
    total = sum(weights)
    sizes = [int(routed * w / total) for w in weights]
    sizes[0] += routed - sum(sizes)
    return sizes


def _meta(shape, dtype, stride=None) -> torch.Tensor:
    if stride is None:
        return torch.empty(shape, dtype=dtype, device="meta")
    return torch.empty_strided(shape, stride, dtype=dtype, device="meta")


def _row_operand(rows: int, k: int) -> Quantized:
    """A rowwise cast's output as the CUDA cast kernels write it: (rows, K) codes, (rows, 1) float32 scales."""
    return Quantized(_meta((rows, k), E4M3), _meta((rows, 1), torch.float32), ROW)


def _columns(sizes: list[int], k: int) -> GroupedColumns:
    """:func:`~fp8_lightning.rowwise_grouped.grouped_columnwise`'s layout for ``sizes``: (K, M_pad) codes,
    (E, K) scales, (E,) int32 padded ends."""
    padded = sum(padded_group_sizes([(0, s) for s in sizes], GROUP_ALIGN))
    return GroupedColumns(_meta((k, padded), E4M3), _meta((len(sizes), k), torch.float32),
                          _meta((len(sizes),), torch.int32))


def expert_calls(sizes: list[int], k: int, n: int) -> list[tuple[str, dict, list[int] | None]]:
    """(role, arguments, ragged group sizes) of the three grouped calls of one (E, K -> N) expert projection."""
    experts, m = len(sizes), sum(sizes)
    weights = StackedWeights(_row_operand(experts * n, k), _row_operand(experts * k, n), experts)
    offs = _meta((experts,), torch.int32)
    calls = []
    for role, args in (("fprop", fprop_args(_row_operand(m, k), weights)),
                       ("dgrad", dgrad_args(_row_operand(m, n), weights))):
        calls.append((role, dict(zip(("mat_a", "mat_b", "scale_a", "scale_b"), args), offs=offs), None))
    wgrad = wgrad_args(_columns(sizes, n), _columns(sizes, k))
    padded = padded_group_sizes([(0, s) for s in sizes], GROUP_ALIGN)
    calls.append(("wgrad", dict(zip(("mat_a", "mat_b", "scale_a", "scale_b", "offs"), wgrad)), padded))
    return calls


def _mx_operand(rows: int, k: int) -> Quantized:
    """An MX cast's output as the CUDA cast kernels write it: (rows, K) codes, (rows, K/32) e8m0 scales."""
    return Quantized(_meta((rows, k), E4M3), _meta((rows, k // 32), torch.float8_e8m0fnu), MX)


def _mx_columns(sizes: list[int], k: int) -> mx_grouped.MXGroupedColumns:
    """:func:`~fp8_lightning.mx_grouped.grouped_mx_columns`'s layout for ``sizes``: (K, M_pad) codes, (K, M_pad/32)
    scales, (E,) int32 padded ends."""
    padded = padded_group_sizes([(0, s) for s in sizes], mx_grouped.MX_BLOCK)
    total = sum(padded)
    return mx_grouped.MXGroupedColumns(_meta((k, total), E4M3), _meta((k, total // 32), torch.float8_e8m0fnu),
                                       _meta((len(sizes),), torch.int32), [], sizes, padded)


def mx_expert_calls(sizes: list[int], k: int, n: int) -> list[tuple[str, dict, list[int] | None]]:
    """(role, arguments, ragged group sizes) of the three MXFP8 grouped calls of one (E, K -> N) expert projection."""
    experts, m = len(sizes), sum(sizes)
    weights = StackedWeights(_mx_operand(experts * n, k), _mx_operand(experts * k, n), experts)
    offs = _meta((experts,), torch.int32)
    names = ("mat_a", "mat_b", "scale_a", "scale_b")
    calls = [("fprop", dict(zip(names, mx_grouped.mx_fprop_args(_mx_operand(m, k), weights, offs)), offs=offs), sizes),
             ("dgrad", dict(zip(names, mx_grouped.mx_dgrad_args(_mx_operand(m, n), weights, offs)), offs=offs), sizes)]
    wgrad = mx_grouped.mx_wgrad_args(_mx_columns(sizes, n), _mx_columns(sizes, k))
    padded = padded_group_sizes([(0, s) for s in sizes], mx_grouped.MX_BLOCK)
    calls.append(("wgrad", dict(zip((*names, "offs"), wgrad)), padded))
    return calls


def judge_call(target: Target, role: str, args: dict, group_sizes: list[int] | None) -> Verdict:
    """The verdict on one grouped call: torch 2.11's rules (MXFP8's where the scales are e8m0), then the installed
    torch's meta function."""
    facts = {name: Facts.of(t) for name, t in args.items()}
    record = GemmRecord(role, "grouped", facts["mat_a"], facts["mat_b"], torch.bfloat16,
                        [Call(GROUPED_API, facts)])
    rules = mx_scaled_grouped_mm if facts["scale_a"].dtype == torch.float8_e8m0fnu else scaled_grouped_mm
    outcome = rules(target, facts["mat_a"], facts["mat_b"], facts["scale_a"], facts["scale_b"], facts["offs"],
                    torch.bfloat16, group_sizes)
    reasons = [f"{GROUPED_API}: {outcome.violation}"] if outcome.violation else []
    meta = meta_error(args["mat_a"], args["mat_b"], args["scale_a"], args["scale_b"], args["offs"])
    reasons += [f"{GROUPED_API}: torch's meta function: {meta}"] if meta else []
    return Verdict(record, VIOLATION if reasons else NATIVE, outcome.kernel, reasons, [])


def check_experts(target: Target, recipe, sizes: list[int], k: int, n: int) -> list[Verdict]:
    """The verdicts on the three grouped GEMMs of one expert projection (E experts of ``k -> n``, ``sizes`` tokens
    each) under ``recipe`` on ``target``."""
    route = recipe.grouped_gemm_route(target.capability, target.cuda, True)
    if route.verdict == NATIVE_ROUTE and route.gemm == TRITON_GROUPED_GEMM:  # no torch call: our kernel's own rules
        empty = Facts((0,), (1,), torch.float32)
        return [Verdict(GemmRecord(role, "grouped", empty, empty, torch.bfloat16), NATIVE, route.gemm, [route.why],
                        []) for role in ("fprop", "dgrad", "wgrad")]  # fmt: skip
    if route.verdict != NATIVE_ROUTE:
        empty = Facts((0,), (1,), torch.float32)
        return [Verdict(GemmRecord(role, "grouped", empty, empty, torch.bfloat16), FALLBACK, route.gemm,
                        [route.why], []) for role in ("fprop", "dgrad", "wgrad")]
    calls = mx_expert_calls if route.gemm == mx_grouped.MX_GROUPED_GEMM else expert_calls
    return [judge_call(target, role, args, groups) for role, args, groups in calls(sizes, k, n)]


def expert_shapes(models=EXPERT_MODELS, tokens=EXPERT_TOKENS):
    """(model, sizes, k, n) of each model's gate_up and down projections at each token count."""
    for model in models:
        experts, hidden, inter = EXPERT_MODELS[model]
        for t in tokens:
            sizes = skewed_sizes(experts, t * TOP_K)
            yield model, sizes, hidden, 2 * inter
            yield model, sizes, inter, hidden
