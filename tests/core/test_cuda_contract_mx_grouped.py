"""torch 2.11's MXFP8 grouped GEMM rules (fp8_lightning.cuda_contract.rules_mx_grouped) on fake tensors: each rule
refuses its case and accepts its neighbour, the meta function of the installed torch agrees on the layouts it checks,
and the contract judges the expert calls the library builds native on sm_100 only."""

import pytest
import torch

from fp8_lightning.cuda_contract.grouped import check_experts, expert_shapes, mx_expert_calls
from fp8_lightning.cuda_contract.rules import Facts, Target
from fp8_lightning.cuda_contract.rules_mx_grouped import mx_scaled_grouped_mm
from fp8_lightning.recipes import MXFP8BlockScaling

E4M3, E8M0 = torch.float8_e4m3fn, torch.float8_e8m0fnu
SM100 = Target("sm_100", (13, 0), (2, 11))


def _facts_2d_3d(m=64, k=64, n=96, experts=4, rows=None):
    """A valid 2-D x 3-D MXFP8 call: (M, K) row-major, (E, K, N) column-major, swizzled e8m0 scales."""
    rows = rows if rows is not None else 128 * experts
    return dict(mat_a=Facts((m, k), (k, 1), E4M3), mat_b=Facts((experts, k, n), (k * n, 1, k), E4M3),
                scale_a=Facts((rows, 4), (4, 1), E8M0), scale_b=Facts((experts, 4 * 128), (512, 1), E8M0),
                offs=Facts((experts,), (1,), torch.int32))


@pytest.mark.parametrize("case, change, message", [
    ("sm_89", {"target": Target("sm_89")}, "compute capability = [9.0, 10.0]"),
    ("sm_90", {"target": Target("sm_90")}, "built for sm_100a / sm_103a only"),
    ("float32 scales", {"scale_a": Facts((256, 4), (4, 1), torch.float32)}, "For MXFP8, scales must both be"),
    ("row-major mat_b", {"mat_b": Facts((4, 64, 96), (64 * 96, 96, 1), E4M3)}, "Expected mat2 to be transposed"),
    ("3-D scale of the wrong size", {"scale_b": Facts((4, 4 * 96), (384, 1), E8M0)}, "must have scale shape (4,4,128)"),
    ("1-D scale_a", {"scale_a": Facts((1024,), (1,), E8M0)}, "scale must have same number of dimensions"),
    ("too few scale rows", {"scale_a": Facts((32, 4), (4, 1), E8M0)}, "scale.shape[0] >= 64"),
    ("strided scale_a", {"scale_a": Facts((512, 4), (8, 1), E8M0)}, "Expected scale_a to be contiguous"),
    ("fp32 out", {"out_dtype": torch.float32}, "Only bf16 high precision output types"),
    ("e5m2 gradient", {"mat_a": Facts((64, 64), (64, 1), torch.float8_e5m2)}, "both scales must be float32"),
    ("1025 groups", {"offs": Facts((1025,), (1,), torch.int32)}, "WQ shape must be (G, K, N)"),
    ("padded mat_a rows", {"mat_a": Facts((64, 64), (80, 1), E4M3)}, "XQ must be row major"),
    ("scales of one 128-row block", {"scale_a": Facts((128, 4), (4, 1), E8M0)}, "reads past its end"),
    ("CUDA 12.6", {"target": Target("sm_100", (12, 6), (2, 11))}, "older than 12.8"),
])
def test_each_rule_refuses_its_case_and_passes_its_neighbour(case, change, message):
    args = dict(target=SM100, **_facts_2d_3d(), out_dtype=torch.bfloat16, group_sizes=[16, 0, 40, 8])
    assert mx_scaled_grouped_mm(**args).violation is None
    args.update(change)
    assert message in mx_scaled_grouped_mm(**args).violation


def _facts_2d_2d(sizes, n=96, k=64):
    """A valid 2-D x 2-D (wgrad) call over groups of ``sizes`` tokens (multiples of 32)."""
    m, chunks = sum(sizes), sum(-(-(s // 32) // 4) * 4 for s in sizes)
    return (Facts((n, m), (m, 1), E4M3), Facts((m, k), (1, m), E4M3), Facts((128, chunks), (chunks, 1), E8M0),
            Facts((128, chunks), (chunks, 1), E8M0), Facts((len(sizes),), (1,), torch.int32))


@pytest.mark.parametrize("sizes, message", [
    ([32, 16, 64], "multiple of 32 (mxfp8)"),
    ([32, 0, 64], "an empty 2d-2d group's output is never written"),
])
def test_ragged_k_groups_must_be_whole_blocks_and_non_empty(sizes, message):
    """The 2-D x 2-D kernel's device-side assert (groups of whole 32-token blocks) and its empty groups, left
    unwritten: what the padded wgrad layout (an empty group holding 32 zero tokens) exists for."""
    assert message in mx_scaled_grouped_mm(SM100, *_facts_2d_2d([32, 32, 64]), torch.bfloat16, sizes).violation
    assert mx_scaled_grouped_mm(SM100, *_facts_2d_2d([32, 32, 64]), torch.bfloat16, [32, 32, 64]).violation is None


def test_the_v2_api_wants_blockwise_1x32_and_one_swizzle_per_operand():
    """``torch.nn.functional.scaled_grouped_mm``: [BlockWise1x32] e8m0 per operand and one SWIZZLE_32_4_4 each."""
    from torch.nn.functional import ScalingType, SwizzleType

    args = _facts_2d_3d()
    one, swz = [ScalingType.BlockWise1x32], [SwizzleType.SWIZZLE_32_4_4]
    ok = mx_scaled_grouped_mm(SM100, *args.values(), v2=(one, one, swz, swz))
    assert ok.violation is None
    bad_recipe = mx_scaled_grouped_mm(SM100, *args.values(), v2=([ScalingType.RowWise], one, swz, swz))
    assert bad_recipe.violation == "No gemm implementation was found"
    no_swizzle = mx_scaled_grouped_mm(SM100, *args.values(), v2=(one, one, [SwizzleType.NO_SWIZZLE], swz))
    assert "SWIZZLE_32_4_4" in no_swizzle.violation
    assert "single swizzle" in mx_scaled_grouped_mm(SM100, *args.values(), v2=(one, one, swz * 2, swz)).violation


def test_the_expert_calls_pass_on_sm_100_and_fall_back_elsewhere():
    """The MXFP8 expert calls the library builds (on meta tensors) over the Qwen3, DeepSeek-V3 and OLMoE expert
    shapes with skewed token counts (empty experts, groups of no multiple of 32) pass torch 2.11's rules and torch's
    meta function on sm_100; on sm_90 the route is the emulation, with its reason."""
    recipe = MXFP8BlockScaling()
    for _, sizes, k, n in expert_shapes(tokens=(77,)):
        verdicts = check_experts(SM100, recipe, sizes, k, n)
        assert [v.status for v in verdicts] == ["native"] * 3, [v.reasons for v in verdicts]
        fallback = check_experts(Target("sm_90"), recipe, sizes, k, n)
        assert {v.status for v in fallback} == {"fallback"} and "10.x" in fallback[0].reasons[0]
    role, args, padded = mx_expert_calls([0, 5, 40], 64, 96)[2]
    assert role == "wgrad" and padded == [32, 32, 64] and args["mat_a"].shape == (96, 128)


def _meta_like(f: Facts) -> torch.Tensor:
    return torch.empty_strided(f.shape, f.stride, dtype=f.dtype, device="meta")


@pytest.mark.parametrize("change", [
    {},
    {"scale_b": Facts((4, 4 * 96), (384, 1), E8M0)},  # the 3-D scale's blocked size
    {"scale_a": Facts((1024,), (1,), E8M0)},  # 1-D scale of a 2-D operand
    {"scale_a": Facts((512, 4), (8, 1), E8M0)},  # a strided 2-D scale
    {"mat_b": Facts((4, 64, 96), (64 * 96, 96, 1), E4M3)},  # row-major mat_b
], ids=["valid", "3-D scale size", "1-D scale", "strided scale", "row-major mat_b"])
def test_torch_meta_function_agrees_with_the_rules_on_the_layouts_it_checks(change):
    """The installed torch's meta function (what torch.compile checks) and the port of torch 2.11's CUDA checks
    accept the same valid call and refuse the same broken layouts."""
    from fp8_lightning.cuda_contract.rules_grouped import meta_error

    facts = {**_facts_2d_3d(), **change}
    rules = mx_scaled_grouped_mm(SM100, *facts.values(), torch.bfloat16)
    meta = meta_error(*(_meta_like(f) for f in facts.values()))
    assert (rules.violation is None) == (meta is None) == (not change), (rules.violation, meta)
