"""The native rowwise grouped route (torch._scaled_grouped_mm): its arguments against an independent float64 model of
what the kernel computes from them, torch's meta function and the CUDA contract's rules, the grouped columnwise cast
against per-group casts, the route per architecture, the layer wiring with the launch replaced by the float64 model
(one launch per GEMM whatever the number of experts), and on an sm_90 GPU the real kernel against the CPU run."""

from __future__ import annotations

import pytest
import torch

from fp8_lightning import RowwiseScaling, TensorwiseScaling, fp8_grouped_mm, rowwise_grouped
from fp8_lightning.capability_table import grouped_route_on
from fp8_lightning.gemm_routes import TRITON_GROUPED_GEMM
from fp8_lightning.triton_grouped import TritonRowwiseGroupedGemm
from fp8_lightning.cuda_contract.grouped import check_experts, expert_shapes, skewed_sizes
from fp8_lightning.cuda_contract.rules import Facts, Target
from fp8_lightning.cuda_contract.rules_grouped import meta_error, scaled_grouped_mm
from fp8_lightning.grouped.gemm import GroupedScaling, group_bounds
from fp8_lightning.recipes import Recipe
from fp8_lightning.rowwise_grouped import dgrad_args, fprop_args, grouped_columnwise, wgrad_args

SIZES = [0, 5, 33, 17, 0, 40]  # empty experts, groups that are no multiple of 16
K, N = 64, 96
E4M3 = torch.float8_e4m3fn
SM90 = Target("sm_90", (12, 9), (2, 11))


def kernel_f64(mat_a, mat_b, scale_a, scale_b, offs) -> torch.Tensor:
    """What torch._scaled_grouped_mm returns, modelled in float64 from its documented semantics: 2-D x 3-D, rows of
    mat_a grouped by offs, times mat_b[e], scaled by scale_a[row] * scale_b[e, col]; 2-D x 2-D, the columns of mat_a
    and rows of mat_b grouped by offs, the group's scales at scale_a[e * rows:], scale_b[e * cols:]."""
    a, b = mat_a.double(), mat_b.double()
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if b.dim() == 3:
        out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64)
        for e, (s, t) in enumerate(zip(starts, ends)):
            out[s:t] = (a[s:t] @ b[e]) * scale_a[s:t].double().unsqueeze(1) * scale_b[e].double()
        return out
    rows, cols = a.shape[0], b.shape[1]
    out = torch.zeros(len(ends), rows, cols, dtype=torch.float64)
    for e, (s, t) in enumerate(zip(starts, ends)):
        sa, sb = scale_a[e * rows : (e + 1) * rows].double(), scale_b[e * cols : (e + 1) * cols].double()
        out[e] = (a[:, s:t] @ b[s:t]) * sa.unsqueeze(1) * sb
    return out


def _inputs(sizes=SIZES, seed=0):
    torch.manual_seed(seed)
    a = torch.randn(sum(sizes), K) * torch.logspace(-1, 1, K)
    b = torch.randn(len(sizes), K, N) * torch.linspace(0.5, 4, len(sizes)).view(-1, 1, 1)
    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
    return a, b, offs, torch.randn(sum(sizes), N)


def _operands(recipe, a, b, offs, g):
    bounds = group_bounds(offs, a.shape[0], b.shape[0])
    x, x_cols = recipe.grouped_operands("input", a, bounds, E4M3, True, None, True)
    w = recipe.grouped_weight_operands(b.transpose(1, 2), E4M3, [None] * b.shape[0], True)
    gq, g_cols = recipe.grouped_operands("grad_output", g, bounds, E4M3, True, None, True)
    return bounds, x, x_cols, w, gq, g_cols


def _f64(q) -> torch.Tensor:
    """An operand's values in float64: codes over the multiplier that made them."""
    return q.data.double() / q.scale.double()


def test_the_arguments_give_each_gemm_of_the_operands():
    """Each GEMM's arguments, multiplied as the kernel multiplies them, give the float64 product of the recipe's own
    operands (fprop, dgrad per expert; wgrad per expert over its own tokens; empty experts give zero)."""
    recipe = RowwiseScaling()
    a, b, offs, g = _inputs()
    bounds, x, x_cols, w, gq, g_cols = _operands(recipe, a, b, offs, g)
    y = kernel_f64(*fprop_args(x, w), offs)
    da = kernel_f64(*dgrad_args(gq, w), offs)
    db = kernel_f64(*wgrad_args(g_cols, x_cols))
    for e, (s, t) in enumerate(bounds):
        ref_y = _f64(x)[s:t] @ _f64(w[e][0]).t()
        ref_da = _f64(gq)[s:t] @ _f64(w[e][1]).t()
        torch.testing.assert_close(y[s:t], ref_y, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(da[s:t], ref_da, rtol=1e-12, atol=1e-12)
        if s == t:
            assert db[e].abs().max() == 0 and g_cols[e] is None and x_cols[e] is None
            continue
        ref_db = _f64(g_cols[e]) @ _f64(x_cols[e]).t()  # (N, m) @ (m, K)
        torch.testing.assert_close(db[e], ref_db, rtol=1e-12, atol=1e-12)


def test_the_grouped_columnwise_cast_has_the_bits_of_per_group_casts():
    """One grouped cast equals casting each group's rows on its own (the recipe protocol's default, which casts
    group by group through the backend), with each group zero-padded to a multiple of 16 tokens."""
    recipe = RowwiseScaling()
    a, _, offs, _ = _inputs()
    bounds = group_bounds(offs, a.shape[0], len(SIZES))
    _, per_group = Recipe.grouped_operands(recipe, "input", a, bounds, E4M3, True, None, True)
    grouped = grouped_columnwise(a, bounds, E4M3, recipe.eps, recipe.power_of_2_scales)
    assert grouped.offs.tolist() == [16, 32, 80, 112, 128, 176]  # 0->16, 5->16, 33->48, 17->32, 0->16, 40->48
    for mine, theirs in zip(grouped, per_group):
        if theirs is None:
            assert mine is None
            continue
        assert torch.equal(mine.data.view(torch.uint8), theirs.data.view(torch.uint8))
        assert torch.equal(mine.scale.reshape(-1), theirs.scale.reshape(-1))
    used = torch.zeros(grouped.codes_t.shape[1], dtype=torch.bool)
    for (start, end), pad_start in zip(bounds, [0, 16, 32, 80, 112, 128]):
        used[pad_start : pad_start + end - start] = True
    assert not grouped.codes_t[:, ~used].view(torch.uint8).any()  # padding is zero codes


def test_torch_meta_function_and_the_contract_rules_accept_the_calls():
    """torch's meta function (torch.compile's check) and the contract's port of torch 2.11's CUDA checks accept the
    three calls, including the 2-D x 2-D call's padded group sizes."""
    recipe = RowwiseScaling()
    a, b, offs, g = _inputs()
    bounds, x, x_cols, w, gq, g_cols = _operands(recipe, a, b, offs, g)
    for args, sizes in ((fprop_args(x, w) + (offs,), None), (dgrad_args(gq, w) + (offs,), None),
                        (wgrad_args(g_cols, x_cols), [16, 16, 48, 32, 16, 48])):
        assert meta_error(*args) is None
        facts = [Facts.of(t) for t in args]
        assert scaled_grouped_mm(SM90, *facts, torch.bfloat16, sizes).violation is None


def _rowwise_facts(m=64, k=64, n=96, experts=4):
    return (Facts((m, k), (k, 1), E4M3), Facts((experts, k, n), (k * n, 1, k), E4M3), Facts((m,), (1,), torch.float32),
            Facts((experts, n), (n, 1), torch.float32), Facts((experts,), (1,), torch.int32))


@pytest.mark.parametrize("case, change, message", [
    ("sm_89", {"target": Target("sm_89")}, "compute capability = [9.0, 10.0]"),
    ("sm_100 in 2.11", {"target": Target("sm_100")}, "built for sm_90 only"),
    ("unaligned stride", {"mat_a": Facts((64, 40), (40, 1), E4M3)}, "strides should be multiple of 16 bytes"),
    ("row-major mat_b", {"mat_b": Facts((4, 64, 96), (64 * 96, 96, 1), E4M3)}, "Expected mat2 to be transposed"),
    ("K not of 16", {"mat_a": Facts((64, 40), (48, 1), E4M3), "mat_b": Facts((4, 40, 96), (48 * 96, 1, 48), E4M3)},
     "Expected trailing dimension of mat_a to be divisible by 16"),
    ("int64 offs", {"offs": Facts((4,), (1,), torch.int64)}, "Offsets have to be int32"),
    ("bf16 scales", {"scale_a": Facts((64,), (1,), torch.bfloat16)}, "both scales must both be float32"),
    ("scale_b per tensor", {"scale_b": Facts((4, 1), (1, 1), torch.float32)}, "same first dimension as mat for arg 1"),
    ("fp32 out", {"out_dtype": torch.float32}, "Only bf16 high precision output types"),
    ("e5m2 gradient", {"mat_a": Facts((64, 64), (64, 1), torch.float8_e5m2)}, "Expected mat_a to be Float8_e4m3"),
])
def test_each_rule_refuses_its_case_and_passes_its_neighbour(case, change, message):
    mat_a, mat_b, scale_a, scale_b, offs = _rowwise_facts()
    args = dict(target=SM90, mat_a=mat_a, mat_b=mat_b, scale_a=scale_a, scale_b=scale_b, offs=offs,
                out_dtype=torch.bfloat16)
    assert scaled_grouped_mm(**args).violation is None
    args.update(change)
    assert message in scaled_grouped_mm(**args).violation


@pytest.mark.parametrize("sizes, message", [([16, 0, 32], "greater than 0"), ([16, 8, 32], "multiple of 16")])
def test_ragged_k_groups_must_be_non_empty_and_aligned(sizes, message):
    """The 2-D x 2-D kernel's device-side checks: what the padded layout exists for."""
    e, m = len(sizes), sum(sizes) + (-sum(sizes) % 16)
    args = (Facts((96, m), (m, 1), E4M3), Facts((m, 64), (1, m), E4M3), Facts((e * 96,), (1,), torch.float32),
            Facts((e * 64,), (1,), torch.float32), Facts((e,), (1,), torch.int32))
    assert message in scaled_grouped_mm(SM90, *args, torch.bfloat16, sizes).violation
    assert scaled_grouped_mm(SM90, *args, torch.bfloat16, [16, 16, 32]).violation is None


def test_the_contract_finds_no_violation_over_expert_shapes():
    """Every recipe on every architecture over Qwen3-30B-A3B, DeepSeek-V3 and OLMoE expert shapes: rowwise is native
    on sm_90 (torch's kernel) and on sm_89 and sm_100 (the Triton kernel), the per-tensor recipes on all three (the
    Triton kernel), MXFP8 on sm_100 (torch's MXFP8 grouped kernel), everything else a documented fallback, nothing a
    violation."""
    from fp8_lightning.recipes import recipe_from

    seen = {}
    for arch in ("sm_89", "sm_90", "sm_100", "sm_120"):
        for name in ("delayed", "tensorwise", "rowwise", "blockwise", "mxfp8", "nvfp4"):  # not other tests' recipes
            for _, sizes, k, n in expert_shapes(tokens=(77,)):
                for v in check_experts(Target(arch), recipe_from(name), sizes, k, n):
                    assert v.status != "violation", v.reasons
                    seen.setdefault((arch, name), set()).add(v.status)
    native = {(arch, name) for arch in ("sm_89", "sm_90", "sm_100") for name in ("rowwise", "tensorwise", "delayed")
              if (arch, name) in seen} | {("sm_100", "mxfp8")}  # MXFP8: torch 2.11's MSLK kernel, sm_100 only
    assert {("sm_90", "rowwise"), ("sm_100", "rowwise"), ("sm_89", "tensorwise")} <= native
    assert all(seen[key] == {"native"} for key in native)
    assert all(status == {"fallback"} for key, status in seen.items() if key not in native)
    assert 0 in skewed_sizes(128, 616) and any(s % 16 for s in skewed_sizes(128, 616))


def test_the_route_is_native_for_e4m3_rowwise_torch_on_sm_90_triton_on_sm_89_and_sm_100():
    native = lambda recipe, arch: grouped_route_on(recipe, arch, (12, 9), True).verdict  # noqa: E731
    assert native(RowwiseScaling(), (9, 0)) == "native"
    assert "torch._scaled_grouped_mm" in grouped_route_on(RowwiseScaling(), (9, 0), (12, 9), True).gemm
    for arch in ((8, 9), (10, 0)):
        route = grouped_route_on(RowwiseScaling(), arch, (12, 9), True)
        assert route.verdict == "native" and route.gemm == TRITON_GROUPED_GEMM, route
    assert native(RowwiseScaling(), (12, 0)) == "fallback"  # no kernel compiled and checked for sm_120
    assert native(RowwiseScaling(fp8_format="HYBRID"), (9, 0)) == "fallback"  # e5m2 gradients
    assert native(RowwiseScaling(high_precision_wgrad=True), (9, 0)) == "fallback"
    assert grouped_route_on(TensorwiseScaling(), (9, 0), (12, 9), True).gemm == TRITON_GROUPED_GEMM
    assert native(TensorwiseScaling(), (12, 0)) == "fallback"
    no_api = grouped_route_on(RowwiseScaling(), (9, 0), (12, 9), False)  # no torch grouped API: Triton
    assert no_api.gemm == TRITON_GROUPED_GEMM and "no torch._scaled_grouped_mm" in no_api.why
    assert RowwiseScaling().grouped_native(torch.device("cpu"), 8) is None


def test_grouped_native_asks_the_device(monkeypatch):
    """On a (simulated) sm_90 the recipe hands out its grouped kernels; on sm_100, or past 1023 experts, not."""
    rowwise_grouped._device_reason.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    try:
        cuda = torch.device("cuda", 0)
        assert isinstance(RowwiseScaling().grouped_native(cuda, 128), rowwise_grouped.RowwiseGroupedGemm)
        assert RowwiseScaling().grouped_native(cuda, 1024) is None
        assert RowwiseScaling(fp8_format="HYBRID").grouped_native(cuda, 8) is None
        rowwise_grouped._device_reason.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
        assert "sm_100" in rowwise_grouped.native_unavailable_reason(cuda, 8)
    finally:
        rowwise_grouped._device_reason.cache_clear()


def test_the_gate_keeps_experts_in_bf16_while_the_native_grouped_step_measures_slower(monkeypatch):
    """On a (simulated) sm_90 the rowwise grouped route is native but its step measured 0.37x of bf16 on an H200:
    the gate keeps rowwise experts in bf16 with that reason, converts them with profitability=False, and keeps
    tensorwise experts in bf16, naming their Triton route (rated as torch's until measured)."""
    from fp8_lightning import GroupedExperts, ProfitabilityGate, capability_table, convert_to_fp8

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(capability_table, "device_facts", lambda device: ((9, 0), (12, 9), True))
    gate = ProfitabilityGate(device="cuda")
    experts = lambda: GroupedExperts(dim=64, hidden_dim=64, num_experts=2)  # noqa: E731
    report = convert_to_fp8(experts(), "rowwise", profitability=gate)
    assert report.experts == [] and "rated 0.37x the speed of bf16" in report.experts_skipped["<root>"]
    assert convert_to_fp8(experts(), "rowwise", profitability=False).experts == ["<root>"]
    report = convert_to_fp8(experts(), "tensorwise", profitability=gate)  # the Triton route: not measured yet
    assert report.experts == [] and "Triton grouped FP8 GEMM" in report.experts_skipped["<root>"]


def _modelled_launch(calls):
    def launch(mat_a, mat_b, scale_a, scale_b, offs, fast_accum):
        calls.append(mat_b.dim())
        return kernel_f64(mat_a, mat_b, scale_a, scale_b, offs).to(torch.bfloat16)

    return launch


@pytest.mark.parametrize("sizes", [SIZES, [7, 0, 16, 3] * 8], ids=["6 experts", "32 experts"])
def test_the_layer_runs_one_launch_per_gemm_and_matches_the_emulation(sizes, monkeypatch):
    """fp8_grouped_mm with the native route and its launch replaced by the float64 model: three launches per
    forward and backward whatever the number of experts, results within bf16 rounding of the emulated route, zero
    gradient for empty experts."""
    recipe = RowwiseScaling()
    a, b, offs, g = _inputs(sizes, seed=2)

    def run():
        a_, b_ = a.clone().requires_grad_(), b.clone().requires_grad_()
        y = fp8_grouped_mm(a_, b_, offs, recipe=recipe, scaling=GroupedScaling(recipe, len(sizes)))
        y.backward(g)
        return y, a_.grad, b_.grad

    emulated = run()
    calls = []
    monkeypatch.setattr(rowwise_grouped, "_launch", _modelled_launch(calls))
    monkeypatch.setattr(RowwiseScaling, "grouped_native", lambda self, device, experts:
                        rowwise_grouped.RowwiseGroupedGemm(True, False))
    native = run()
    assert calls == [3, 3, 2]  # fprop and dgrad 2-D x 3-D, wgrad 2-D x 2-D
    for name, got, ref in zip(("y", "da", "db"), native, emulated):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=2**-8, atol=2**-8 * ref.abs().max().item(), msg=name)
    for e, size in enumerate(sizes):
        if size == 0:
            assert native[2][e].abs().max() == 0


@pytest.mark.gpu
@pytest.mark.skipif(rowwise_grouped.native_unavailable_reason(torch.device("cuda"), 8) is not None
                    if torch.cuda.is_available() else True,
                    reason="needs a CUDA sm_90 device with torch._scaled_grouped_mm (the rowwise grouped kernel)")
def test_on_sm_90_the_grouped_kernel_matches_the_cpu_run():
    recipe = RowwiseScaling()
    a, b, offs, g = _inputs()
    results = []
    for device in ("cpu", "cuda"):
        a_ = a.to(device, torch.bfloat16).requires_grad_()
        b_ = b.to(device, torch.bfloat16).requires_grad_()
        y = fp8_grouped_mm(a_, b_, offs.to(device), recipe=recipe)
        y.backward(g.to(device, torch.bfloat16))
        results.append([t.float().cpu() for t in (y, a_.grad, b_.grad)])
    for name, ref, got in zip(("y", "da", "db"), *results):
        torch.testing.assert_close(got, ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item(), msg=name)


def test_the_grouped_gemm_setting_picks_triton_on_sm_90_and_triton_serves_where_torch_cannot(monkeypatch):
    """FP8_LIGHTNING_GROUPED_GEMM=triton routes sm_90 to the Triton kernel; on a (simulated) sm_100 with the Triton
    kernels usable the recipe hands out the Triton route, and with them unusable nothing (emulated)."""
    from fp8_lightning.recipes import rowwise as rowwise_recipe
    from fp8_lightning.settings import reload_settings

    monkeypatch.setenv("FP8_LIGHTNING_GROUPED_GEMM", "triton")
    try:
        reload_settings()
        route = grouped_route_on(RowwiseScaling(), (9, 0), (12, 9), True)
        assert route.gemm == TRITON_GROUPED_GEMM and "FP8_LIGHTNING_GROUPED_GEMM=triton" in route.why
    finally:
        monkeypatch.delenv("FP8_LIGHTNING_GROUPED_GEMM")
        reload_settings()
    rowwise_grouped._device_reason.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    cuda = torch.device("cuda", 0)
    try:
        monkeypatch.setattr(rowwise_recipe, "triton_unavailable_reason", lambda device: None)
        assert isinstance(RowwiseScaling().grouped_native(cuda, 8), TritonRowwiseGroupedGemm)
        monkeypatch.setattr(rowwise_recipe, "triton_unavailable_reason", lambda device: "no Triton")
        assert RowwiseScaling().grouped_native(cuda, 8) is None
    finally:
        rowwise_grouped._device_reason.cache_clear()
