"""The NVFP4 layer's native GEMM route (cuBLAS's FP4 GEMM through ``torch.nn.functional.scaled_mm``), proved on CPU.

* An independent float64 interpreter of what ``scaled_mm`` computes from the exact keyword arguments the library
  builds (float4 bytes unpacked, the swizzled E4M3 scales un-swizzled by index arithmetic written here from cuBLAS's
  documented 128x4 tile layout, the global scales applied) equals the emulated GEMM within the output dtype's
  rounding, on the operands of real layer steps: fprop, dgrad and wgrad, 1x16 and 16x16 weights, RHT on and off,
  stochastic rounding, token counts that are not multiples of 16 or 128, K an odd number of 16-blocks.
* Those calls pass torch 2.11's rules (``cuda_contract.rules_nvfp4``), and the layer issues them on a simulated
  sm_100 (eager and traced) and none on sm_90.
* Routing: sm_100 and sm_120 pick the native route, sm_90 (or no CUDA 12.8, or no v2 call) the emulation.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fp8_lightning import FP8Linear, fp8_autocast
from fp8_lightning.cuda_contract import NATIVE, FALLBACK, check_layer
from fp8_lightning.cuda_contract.rules import Facts, Target
from fp8_lightning.cuda_contract.rules_nvfp4 import nvfp4_scaled_mm_v2
from fp8_lightning.cuda_contract.simulate import simulated_device
from fp8_lightning.gemm_routes import NATIVE as NATIVE_ROUTE
from fp8_lightning.nvfp4_gemm import nvfp4_scaled_mm_args
from fp8_lightning.quantize import Quantized
from fp8_lightning import nvfp4_gemm
from fp8_lightning.recipes.nvfp4 import NVFP4, NVFP4BlockScaling

SM100, SM90 = Target("sm_100", (12, 9), (2, 11)), Target("sm_90", (12, 9), (2, 11))
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
RECIPES = {
    "tiles-rht-sr": NVFP4BlockScaling(),
    "blocks-rht-rtn": NVFP4BlockScaling(fp4_2d_weights=False, disable_stochastic_rounding=True),
    "tiles-no-rht-rtn": NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True),
    "blocks-no-rht-sr": NVFP4BlockScaling(fp4_2d_weights=False, disable_rht=True, seed=7),
}


def _fp4_values(packed: torch.Tensor) -> torch.Tensor:
    """float64 values of packed E2M1 bytes, the even element in the low nibble, sign in bit 3."""
    b = packed.view(torch.uint8).to(torch.int64)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).reshape(b.shape[0], -1)
    mag = torch.tensor(E2M1, dtype=torch.float64)[codes & 7]
    return torch.where(codes >= 8, -mag, mag)


def _unswizzle(flat: torch.Tensor, rows: int, blocks: int) -> torch.Tensor:
    """float64 scales (rows, blocks) read from cuBLAS's 1D block-scaling layout: (r, c) sits at
    ``((r // 128) * ceil(blocks / 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4``."""
    col_tiles = -(-blocks // 4)
    r = torch.arange(rows).unsqueeze(1)
    c = torch.arange(blocks).unsqueeze(0)
    at = ((r // 128) * col_tiles + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    return flat.view(torch.float8_e4m3fn).to(torch.float64)[at]


def interpret_scaled_mm(kw: dict) -> torch.Tensor:
    """What ``scaled_mm(**kw)`` computes for [BlockWise1x16, TensorWise] FP4 operands, in float64."""
    assert [r.name for r in kw["scale_recipe_a"]] == [r.name for r in kw["scale_recipe_b"]] == [
        "BlockWise1x16", "TensorWise"]
    assert kw["swizzle_a"][0].name == kw["swizzle_b"][0].name == "SWIZZLE_32_4_4"
    a = _fp4_values(kw["mat_a"])  # (M, K)
    b = _fp4_values(kw["mat_b"].t())  # mat_b is (K / 2, N) column-major: its transpose is (N, K / 2) row-major
    (m, k), n = a.shape, b.shape[0]
    sa = _unswizzle(kw["scale_a"][0], m, k // 16).repeat_interleave(16, dim=1)
    sb = _unswizzle(kw["scale_b"][0], n, k // 16).repeat_interleave(16, dim=1)
    alpha = kw["scale_a"][1].double() * kw["scale_b"][1].double()
    return (a * sa) @ (b * sb).t() * alpha


def _layer_gemms(recipe, m: int, k: int, n: int, monkeypatch) -> list[tuple]:
    """(role, a, b, bias) of each NVFP4 GEMM of one training step of a ``k -> n`` layer on ``m`` tokens."""
    seen, original = [], NVFP4.gemm

    def record(a, b, out_dtype, emulate=False, bias=None, fast_accum=False):
        seen.append((a, b, bias))
        return original(a, b, out_dtype, emulate, bias, fast_accum)

    monkeypatch.setattr(NVFP4, "gemm", record)
    torch.manual_seed(m + k + n)
    layer = FP8Linear.from_linear(nn.Linear(k, n), recipe)
    x = (torch.randn(m, k) * torch.logspace(-2, 1, k)).requires_grad_()
    with fp8_autocast():
        layer(x).backward(torch.randn(m, n))
    assert len(seen) == 3
    return [(role, a, b, bias) for role, (a, b, bias) in zip(("fprop", "dgrad", "wgrad"), seen)]


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("m, k, n", [(77, 48, 32), (130, 64, 144), (20, 144, 48)])
def test_the_scaled_mm_call_computes_the_emulated_gemm(name, m, k, n, monkeypatch):
    for role, a, b, bias in _layer_gemms(RECIPES[name], m, k, n, monkeypatch):
        kk = a.data.shape[1] * 2
        for out_dtype, rel in ((torch.float32, 0.0), (torch.bfloat16, 2.0**-8)):
            kw = nvfp4_scaled_mm_args(a, b, out_dtype)
            exact = interpret_scaled_mm(kw)[:, : b.data.shape[0]]
            emulated = nvfp4_gemm.nvfp4_mm(a, b, out_dtype, emulate=True).double()
            # float32 sums (each dequantized value rounded once, then K additions) and the output's one rounding
            terms = (a.kind.to_f32(a).double().abs() @ b.kind.to_f32(b).double().abs().t())
            f32_error = (kk + 2) * 2.0**-24 * terms
            bound = f32_error + rel * (exact.abs() + f32_error)
            assert emulated.shape == exact.shape, (role, name)
            assert ((emulated - exact).abs() <= bound).all(), (role, name, out_dtype)
            assert kw["mat_a"].dtype == torch.float4_e2m1fn_x2 and kw["mat_a"].shape[1] % 16 == 0


def test_the_interpreter_sees_a_misplaced_scale(monkeypatch):
    """The comparison can fail: one block scale moved to a neighbouring row changes the interpreted product."""
    _, a, b, _ = _layer_gemms(RECIPES["blocks-rht-rtn"], 77, 64, 32, monkeypatch)[0]
    kw = nvfp4_scaled_mm_args(a, b, torch.float32)
    exact = interpret_scaled_mm(kw)
    flat = kw["scale_a"][0].view(torch.uint8).clone()
    flat[[0, 16]] = flat[[16, 0]]  # rows 0 and 1, first block
    if torch.equal(flat, kw["scale_a"][0].view(torch.uint8)):
        pytest.skip("the two scales are equal")
    moved = interpret_scaled_mm({**kw, "scale_a": [flat.view(torch.float8_e4m3fn), kw["scale_a"][1]]})
    assert not torch.allclose(moved, exact)


@pytest.mark.parametrize("name", list(RECIPES))
def test_the_built_calls_pass_torch_2_11s_rules(name, monkeypatch):
    for role, a, b, _ in _layer_gemms(RECIPES[name], 77, 48, 32, monkeypatch):
        kw = nvfp4_scaled_mm_args(a, b)
        facts = {s: [Facts.of(t) for t in kw[s]] for s in ("scale_a", "scale_b")}
        out = nvfp4_scaled_mm_v2(SM100, Facts.of(kw["mat_a"]), Facts.of(kw["mat_b"]), facts["scale_a"],
                                 kw["scale_recipe_a"], facts["scale_b"], kw["scale_recipe_b"], kw["swizzle_a"],
                                 kw["swizzle_b"])
        assert out.violation is None, (role, out)


@pytest.mark.parametrize("name", ["tiles-rht-sr", "blocks-no-rht-sr"])
@pytest.mark.parametrize("m, k, n", [(77, 144, 48), (130, 64, 1040)])
def test_the_simulated_layer_issues_legal_fp4_calls_on_sm100_and_none_on_sm90(name, m, k, n):
    for target, status in ((SM100, NATIVE), (SM90, FALLBACK)):
        verdicts = check_layer(target, RECIPES[name], m, k, n)
        assert len(verdicts) == 6  # three GEMMs, eager and traced
        for v in verdicts:
            assert v.status == status, (target, v.record.mode, v.record.role, v.reasons)
            if status == NATIVE:
                assert [c.api for c in v.record.calls] == ["torch.nn.functional.scaled_mm"]
                assert v.record.calls[0].args["mat_a"].dtype == torch.float4_e2m1fn_x2


def test_routes_sm100_native_below_or_without_the_call_emulated():
    """(The conversion warning on sm_90 and its absence on sm_100: tests/test_capabilities.py.)"""
    recipe = NVFP4BlockScaling()
    assert recipe.gemm_route((10, 0), (12, 9), True).verdict == NATIVE_ROUTE
    assert recipe.gemm_route((12, 0), (12, 8), True).verdict == NATIVE_ROUTE
    assert recipe.gemm_route((10, 0), (12, 6), True).verdict == FALLBACK
    assert recipe.gemm_route((10, 0), (12, 9), False).verdict == FALLBACK
    assert "no FP4 tensor cores" in recipe.gemm_route((9, 0), (12, 9), True).why


def test_an_operand_without_gemm_scales_is_emulated_with_the_reason(monkeypatch):
    monkeypatch.setattr(nvfp4_gemm, "_WARNED", set())
    calls = []
    with simulated_device(SM100):
        monkeypatch.setattr(torch.nn.functional, "scaled_mm", lambda **kw: calls.append(kw))
        codes = torch.empty(32, 32, dtype=torch.uint8, device="cuda")
        bare = Quantized(codes, torch.empty(32, 4, device="cuda"), NVFP4)
        with pytest.warns(UserWarning, match="carries no GEMM scales"):
            out = nvfp4_gemm.nvfp4_mm(bare, bare, torch.bfloat16)
    assert out.shape == (32, 32) and not calls


def test_fullgraph_compile_carries_the_gemm_scales_and_keeps_the_eager_bits(monkeypatch):
    """The traced step's casts hand each copy's GEMM scales to the GEMM op: one graph, the eager bits, and the
    compiled GEMMs see the same GEMM scales as the eager ones."""
    x = torch.randn(20, 64, requires_grad=True)
    out, scales, original = {}, {}, NVFP4.gemm
    for compiled in (False, True):
        seen = []

        def record(a, b, out_dtype, emulate=False, bias=None, fast_accum=False):
            seen.append((a.cache.native.clone(), b.cache.native.clone()))
            return original(a, b, out_dtype, emulate, bias, fast_accum)

        monkeypatch.setattr(NVFP4, "gemm", record)
        torch.manual_seed(0)
        layer = FP8Linear.from_linear(nn.Linear(64, 32), NVFP4BlockScaling())
        run = torch.compile(layer, backend="aot_eager", fullgraph=True) if compiled else layer
        with fp8_autocast():
            y = run(x)
        y.sum().backward()
        out[compiled], scales[compiled] = (y.detach(), layer.weight.grad.clone()), seen
    torch._dynamo.reset()
    assert torch.equal(out[False][0], out[True][0]) and torch.equal(out[False][1], out[True][1])
    assert len(scales[False]) == len(scales[True]) == 3 and all(torch.equal(p, q) for e, c in zip(scales[False], scales[True])
                                          for p, q in zip(e, c))
