"""The CUDA contract run over the library's real GEMMs: every recipe's layer step (eager and traced) on fake CUDA
tensors with a simulated sm_89 / sm_90 / sm_100 / sm_120, over the shapes of GPT-2, Llama-3-8B and Qwen3 and ragged
token counts. No violation anywhere; every fallback is one the library documents; a planted violation is caught and
makes the command line exit 1."""

from __future__ import annotations

import pytest
import torch

from fp8_lightning import cuda_rules
from fp8_lightning.cuda_contract import FALLBACK, NATIVE, VIOLATION, Target, check_layer, run_layer
from fp8_lightning.cuda_contract.__main__ import main
from fp8_lightning.cuda_contract.check import contract_recipes, grid_shapes
from fp8_lightning.cuda_contract.rules import CONTRACT_ARCHS
from fp8_lightning.recipes import RECIPES, BlockwiseScaling, RowwiseScaling, TensorwiseScaling

SM90 = Target("sm_90", (12, 9), (2, 11))


def test_a_step_records_its_three_gemms_with_their_operands():
    """fprop x @ W.T, dgrad g @ W, wgrad g.T @ x, each ``a @ b.T`` with K last, in both step modes."""
    for mode in ("eager", "traced"):
        records = run_layer(SM90, TensorwiseScaling(), 77, 768, 3072, mode)
        assert [(r.role, r.a.shape, r.b.shape) for r in records] == [
            ("fprop", (77, 768), (3072, 768)), ("dgrad", (77, 3072), (768, 3072)), ("wgrad", (3072, 77), (768, 77)),
        ]
        assert all(len(r.calls) == 1 and r.calls[0].api == "torch._scaled_mm" for r in records)
        fprop = records[0].calls[0].args
        assert fprop["mat2"].stride == (1, 768) and fprop["bias"].shape == (3072,)  # column-major, bias fused


def test_a_simulation_leaves_no_fake_tensor_or_patch_behind():
    """The library's per-device constant caches and torch's functions are as they were after a simulation."""
    from fp8_lightning import mx
    from fp8_lightning.ops import dispatch

    to, is_available = torch.Tensor.to, torch.cuda.is_available
    run_layer(Target("sm_100"), RECIPES["mxfp8"](), 77, 768, 3072, "eager", triton=False)
    for cache in (mx._SMALLEST_SUBNORMALS, mx._E8M0_TABLES, dispatch._DECODE_TABLES):
        assert all(t.device.type == "cpu" for t in cache.values())
    assert torch.Tensor.to is to and torch.cuda.is_available is is_available


def _blockwise_fallback_is_planned(verdict, target: Target) -> bool:
    """A blockwise GEMM emulated where fp8_lightning.cuda_rules.blockwise_gemm_plan (the documented plan) says so."""
    r = verdict.record
    (m, k), n = r.a.shape, r.b.shape[0]
    block = None if r.role == "wgrad" else "b"
    e4m3 = r.a.dtype == r.b.dtype == torch.float8_e4m3fn
    plan = cuda_rules.blockwise_gemm_plan(m, k, n, target.capability, target.has_scaled_mm_v2, target.cuda, block,
                                          e4m3)
    return plan[0] == cuda_rules.EMULATE


def _native_route(name: str, target: Target) -> bool:
    """Whether the recipe's route on ``target`` is native (NVFP4 emulates below sm_100 or CUDA 12.8, as planned)."""
    return RECIPES[name]().gemm_route(target.capability, target.cuda, target.has_scaled_mm_v2).verdict == NATIVE


def _check_grid(target: Target, shapes, dtype=torch.bfloat16):
    counts = {}
    for name in contract_recipes():
        recipe = RECIPES[name]()
        for model, m, k, n in shapes:
            eager, traced = (check_layer(target, recipe, m, k, n, (mode,), dtype) for mode in ("eager", "traced"))
            for v in eager + traced:
                where = (str(target), name, model, m, k, n, v.record.mode, v.record.role, v.reasons)
                assert v.status != VIOLATION, where
                if v.status == FALLBACK and name == "nvfp4":
                    assert not _native_route(name, target), where
                elif v.status == FALLBACK:
                    assert name == "blockwise" and _blockwise_fallback_is_planned(v, target), where
                counts[name, v.status] = counts.get((name, v.status), 0) + 1
            assert [v.kernel for v in eager] == [v.kernel for v in traced], (name, model, m, k, n)
    return counts


@pytest.mark.parametrize("arch", CONTRACT_ARCHS)
def test_the_shape_grid_has_no_violation_and_only_planned_fallbacks(arch):
    """GPT-2, Llama-3-8B, Qwen3 (0.6B, 8B, 30B-A3B experts) and ragged feature counts, bf16, at 1, 77 and 4113
    tokens on sm_90 (where the blockwise path depends on the shape) and 77 elsewhere (``python -m
    fp8_lightning.cuda_contract --grid --arch all --recipe all`` runs them all): every GEMM of every recipe is legal
    where it runs natively; the only fallbacks are blockwise's planned ones and NVFP4's emulation below sm_100."""
    target = Target(arch, (12, 9), (2, 11))
    counts = _check_grid(target, list(grid_shapes(tokens=(1, 77, 4113) if arch == "sm_90" else (77,))))
    if arch == "sm_90":
        assert counts.get(("blockwise", NATIVE), 0) > counts.get(("blockwise", FALLBACK), 0) > 0  # ragged K only
    else:
        assert ("blockwise", NATIVE) not in counts  # emulated off sm_90, as planned
    assert all(counts.get((name, NATIVE), 0) > 0 for name in contract_recipes()
               if name != "blockwise" and _native_route(name, target))
    assert (counts.get(("nvfp4", NATIVE), 0) > 0) == (target.capability >= (10, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("target", [SM90, Target("sm_89", (12, 9), (2, 11)), Target("sm_100", (12, 9), (2, 13)),
                                    Target("sm_90", (12, 4), (2, 11))], ids=str)
def test_fp32_and_fp16_layers_have_no_violation(target, dtype):
    """fp32 and fp16 parameters and outputs (bias with fp32 output, rowwise fp16/fp32 outputs), older CUDA, torch
    2.13's rules."""
    _check_grid(target, list(grid_shapes(["gpt2", "ragged-features"], [77])), dtype)


def test_blockwise_hidden_768_passes_with_the_plan_and_the_old_padded_v1_layout_is_rejected(monkeypatch):
    """K = 768, N = 3072 on sm_90: fprop and dgrad take v2 with cuBLAS's padded layout, wgrad v1 1x128 x 1x128; the
    layout the library passed before (v1 with the 128x128 scale padded to a row stride of 8) is refused."""
    verdicts = check_layer(SM90, BlockwiseScaling(), 64, 768, 3072)
    assert {v.status for v in verdicts} == {NATIVE}
    assert [v.record.calls[0].api for v in verdicts[:3]] == [
        "torch.nn.functional.scaled_mm", "torch.nn.functional.scaled_mm", "torch._scaled_mm",
    ]
    monkeypatch.setattr(cuda_rules, "blockwise_gemm_plan", lambda *args, **kwargs: (cuda_rules.V1, "the old path"))
    old = check_layer(SM90, BlockwiseScaling(), 64, 768, 3072, ("eager",))
    assert [v.status for v in old] == [VIOLATION, NATIVE, NATIVE]  # fprop: 6 K-blocks; dgrad: 24, a multiple of 4
    assert "Invalid scaling configuration." in old[0].reasons[0] and "scale_b.stride()=[1, 8]" in old[0].reasons[0]
    down = check_layer(SM90, BlockwiseScaling(), 64, 3072, 768, ("eager",))  # its dgrad reduces over 768
    assert [v.status for v in down] == [NATIVE, VIOLATION, NATIVE]


def test_rowwise_fp32_outputs_take_the_rowwise_kernel_where_torch_writes_them(monkeypatch):
    """The fix: on sm_90 with CUDA 12.9+ an fp32 rowwise GEMM is one rowwise ``_scaled_mm`` (cuBLASLt writes fp32);
    on sm_89 it keeps the tensorwise kernel with unit scales, since torch 2.11's CUTLASS refuses fp32, which the
    contract catches when the choice is forced."""
    for target, kernel in ((SM90, "cuBLASLt rowwise"), (Target("sm_89"), "cuBLASLt tensorwise")):
        verdicts = check_layer(target, RowwiseScaling(), 77, 768, 3072, ("eager",), torch.float32)
        assert all(v.status == NATIVE and v.kernel.startswith(kernel) for v in verdicts), verdicts
        assert all(len(v.record.calls) == 1 for v in verdicts)
    monkeypatch.setattr(cuda_rules, "rowwise_direct_output", lambda *args: True)
    forced = check_layer(Target("sm_89"), RowwiseScaling(), 77, 768, 3072, ("eager",), torch.float32)
    assert all(v.status == VIOLATION and "Only bf16 and fp16" in v.reasons[0] for v in forced)


def test_mxfp8_on_blackwell_with_a_torch_below_cuda_12_8_does_not_call_cublas_mx(monkeypatch):
    """The contract found it: sm_100 with a torch built on CUDA 12.4 called cuBLAS's MX GEMM, which CUDA 12.8
    brought; now such a device takes the Triton MX GEMM (or the emulation without Triton), and the old gate is
    caught."""
    from fp8_lightning import gemm
    from fp8_lightning.recipes import MXFP8BlockScaling

    old_cuda = Target("sm_100", (12, 4), (2, 11))
    with_triton = check_layer(old_cuda, MXFP8BlockScaling(), 77, 768, 3072)
    assert {v.kernel for v in with_triton} == {"Triton MX GEMM"} and {v.status for v in with_triton} == {NATIVE}
    without = check_layer(old_cuda, MXFP8BlockScaling(), 77, 768, 3072, triton=False)
    assert {v.status for v in without} == {FALLBACK}
    assert {v.kernel for v in check_layer(Target("sm_100"), MXFP8BlockScaling(), 77, 768, 3072)} == {
        "cuBLASLt MX (VEC32_UE8M0)"}
    monkeypatch.setattr(gemm, "native_mx_gemm_support", lambda device: (True, "the capability alone"))
    old_gate = check_layer(old_cuda, MXFP8BlockScaling(), 77, 768, 3072, ("eager",))
    assert all(v.status == VIOLATION and "CUDA 12.8" in v.reasons[0] for v in old_gate)


def test_the_command_line_prints_each_gemm_and_exits_1_on_a_planted_violation(monkeypatch, capsys):
    args = ["--arch", "sm_90", "--cuda", "12.9", "--torch", "2.11", "--recipe", "blockwise", "--shape", "64,768,3072"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "eager fprop: native (cuBLASLt 1x128 x 128x128)" in out and "scale_b=(8, 24) strides (1, 8)" in out
    assert "summary: 6 native" in out
    monkeypatch.setattr(cuda_rules, "blockwise_gemm_plan", lambda *args, **kwargs: (cuda_rules.V1, "the old path"))
    assert main(args + ["--quiet"]) == 1
    out = capsys.readouterr().out
    assert "eager fprop: violation" in out and "Invalid scaling configuration." in out


@pytest.mark.parametrize("triton", [True, False], ids=["triton", "no-triton"])
@pytest.mark.parametrize("arch", CONTRACT_ARCHS)
def test_recipe_variants_have_no_violation(arch, triton):
    """HYBRID gradients (E5M2 in dgrad and wgrad), rowwise's high-precision wgrad, MX blocks of 64, E4M3 per-tensor
    recipes; with the Triton kernels and without them (the pure-PyTorch casts' layouts)."""
    from fp8_lightning.recipes import DelayedScaling, MXFP8BlockScaling

    variants = [
        RowwiseScaling(high_precision_wgrad=True), RowwiseScaling(fp8_format="HYBRID"), BlockwiseScaling(fp8_format="HYBRID"),
        MXFP8BlockScaling(fp8_format="HYBRID"), MXFP8BlockScaling(block_size=64), TensorwiseScaling(fp8_format="E4M3"),
        DelayedScaling(fp8_format="E4M3"),
    ]
    target = Target(arch, (12, 9), (2, 11))
    for recipe in variants:
        for m, k, n in ((77, 768, 3072), (4113, 3072, 768)):
            for v in check_layer(target, recipe, m, k, n, triton=triton):
                assert v.status != VIOLATION, (arch, triton, recipe, m, k, n, v.record.mode, v.record.role, v.reasons)
