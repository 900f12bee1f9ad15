"""torch's CUDA rules for NVFP4 GEMMs (``cuda_contract.rules_nvfp4``), and the call the NVFP4 recipe builds.

Each rule's failing case is refused with torch's words and its passing neighbour is taken (the rules as read in
ScaledBlas.cpp: packed K / 2 a multiple of 16 for v1, unpacked K for v2; swizzled E4M3 scale counts; no fast
accumulation; SWIZZLE_32_4_4; FP4 tensor cores on sm_100 with CUDA 12.8). The arguments
``nvfp4_gemm.nvfp4_scaled_mm_args`` builds from the recipe's NVFP4 operands on fake CUDA tensors pass both the contract and
torch's own meta function, and their swizzled scales sit where cuBLAS's documented 128x4 tile layout puts them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fp8_lightning import nvfp4
from fp8_lightning.cuda_contract.rules import Facts, Target
from fp8_lightning.cuda_contract.rules_nvfp4 import KERNEL, nvfp4_scaled_mm_v1, nvfp4_scaled_mm_v2, scale_elements
from fp8_lightning.nvfp4_gemm import nvfp4_scaled_mm_args
from fp8_lightning.recipes.nvfp4 import _operand
from fp8_lightning.cuda_contract.simulate import simulated_device

FP4, E4M3 = torch.float4_e2m1fn_x2, torch.float8_e4m3fn
SM100, SM90 = Target("sm_100", (12, 8), (2, 11)), Target("sm_90", (12, 9), (2, 11))
TWO_LEVEL = ["BlockWise1x16", "TensorWise"]
SWIZZLED = ["SWIZZLE_32_4_4", "NO_SWIZZLE"]


def mat(rows: int, packed_k: int) -> Facts:
    return Facts((rows, packed_k), (packed_k, 1), FP4)


def scale(count: int, dtype=E4M3) -> Facts:
    return Facts((count,), (1,), dtype)


GLOBAL = Facts((), (), torch.float32)


def v1(m=256, n=128, k=512, **kwargs):
    a, b = mat(m, k // 2), mat(n, k // 2).t()
    sa = kwargs.pop("scale_a", scale(scale_elements(m, k // 2)))
    sb = kwargs.pop("scale_b", scale(scale_elements(n, k // 2)))
    return nvfp4_scaled_mm_v1(kwargs.pop("target", SM100), a, b, sa, sb, **kwargs)


def v2(m=256, n=128, k=512, **kwargs):
    a, b = mat(m, k // 2), mat(n, k // 2).t()
    sa = [kwargs.pop("scale_a", scale(scale_elements(m, k // 2))), GLOBAL]
    sb = [scale(scale_elements(n, k // 2)), GLOBAL]
    swizzles = kwargs.pop("swizzles", SWIZZLED)
    return nvfp4_scaled_mm_v2(kwargs.pop("target", SM100), a, b, sa, TWO_LEVEL, sb, TWO_LEVEL, swizzles, swizzles,
                              **kwargs)


def test_v1_takes_the_swizzled_1x16_pair_on_sm100_and_says_the_global_scale_is_the_callers():
    out = v1()
    assert out.kernel == KERNEL and out.violation is None and "g_a * g_b" in out.note


@pytest.mark.parametrize("kwargs, words", [
    ({"k": 16}, "Expected trailing dimension of mat1 to be divisible by 16 but got mat1 shape: (256x8)."),
    ({"n": 120}, "mat2 shape (256x120) must be divisible by 16"),  # 120 rows pad to 128: the scales still fit
    ({"scale_a": scale(100)}, "scale_a should have 8192 elements"),
    ({"scale_a": scale(scale_elements(256, 256), torch.float8_e8m0fnu)}, "Invalid scaling configuration"),
    ({"use_fast_accum": True}, "`use_fast_accum` is not supported when `mat1` or `mat2`"),
    ({"out_dtype": torch.float32, "bias": Facts((128,), (1,), torch.bfloat16)},
     "Bias is not supported when out_dtype is set to Float32"),
    ({"target": SM90}, "cuBLASLt has no NVFP4 (1x16, e4m3) block scaling below compute capability 10.0"),
    ({"target": Target("sm_100", (12, 6), (2, 11))}, "or CUDA 12.8"),
])
def test_v1_refuses_each_rules_failing_case_in_torchs_words(kwargs, words):
    out = v1(**kwargs)
    assert out.violation is not None and words in out.violation, out


def test_v2_takes_k_16_where_v1_refuses_it_and_applies_the_global_scales():
    assert v1(k=16).violation is not None
    out = v2(k=16)
    assert out.kernel == KERNEL and out.violation is None and "alpha = g_a * g_b" in out.note


@pytest.mark.parametrize("kwargs, words", [
    ({"k": 24}, "Expected trailing dimension of mat1 to be divisible by 16 but got mat1 shape: (256x24)."),
    ({"n": 120}, "mat2 shape (256x120) must be divisible by 16"),
    ({"swizzles": ["NO_SWIZZLE", "NO_SWIZZLE"]}, "scale_a must be swizzled to SWIZZLE_32_4_4 format"),
    ({"scale_a": scale(64)}, "For Blockwise scaling scale_a should have 8192 elements, got: 64"),
    ({"use_fast_accum": True}, "`use_fast_accum` is not supported when `mat_a` or `mat_b`"),
    ({"target": SM90}, "below compute capability 10.0"),
])
def test_v2_refuses_each_rules_failing_case_in_torchs_words(kwargs, words):
    out = v2(**kwargs)
    assert out.violation is not None and words in out.violation, out


def test_v2_single_scale_form_and_wrong_recipes():
    a, b = mat(128, 64), mat(128, 64).t()
    s = scale(scale_elements(128, 64))
    single = nvfp4_scaled_mm_v2(SM100, a, b, [s], ["BlockWise1x16"], [s], ["BlockWise1x16"], ["SWIZZLE_32_4_4"],
                                ["SWIZZLE_32_4_4"])
    assert single.violation is None and "caller applies" in single.note
    wrong = nvfp4_scaled_mm_v2(SM100, a, b, [s, GLOBAL], ["BlockWise1x32", "TensorWise"], [s, GLOBAL], TWO_LEVEL,
                               SWIZZLED, SWIZZLED)
    assert wrong.kernel == "none" and wrong.violation.startswith("Invalid scaling configuration")


def _fake_nvfp4(rows: int, k: int, tile_rows: int) -> nvfp4.NVFP4Tensor:
    pr = -(-rows // tile_rows) * tile_rows
    codes = torch.empty((pr, k // 2), dtype=torch.uint8, device="cuda")
    scales = torch.empty((pr // tile_rows, k // 16), dtype=E4M3, device="cuda")
    return nvfp4.NVFP4Tensor(codes, scales, torch.empty((), device="cuda"), (rows, k), tile_rows)


@pytest.mark.parametrize("m, n, k", [(256, 128, 512), (40, 96, 64), (1000, 48, 4096)])
def test_the_recipes_call_passes_the_contract_and_torchs_meta_on_fake_cuda(m, n, k):
    with simulated_device(SM100):  # fake CUDA tensors, with the bridges a CPU build of torch needs
        a, b = _fake_nvfp4(m, k, 1), _fake_nvfp4(n, k, 16)  # activations 1x16, weight 16x16 tiles
        args = nvfp4_scaled_mm_args(_operand(a), _operand(b))
        y = F.scaled_mm(**args)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16 and y.device.type == "cuda"
        facts = {key: [Facts.of(t) for t in args[key]] for key in ("scale_a", "scale_b")}
        for target, ok in ((SM100, True), (Target("sm_120", (12, 9), (2, 11)), True), (SM90, False)):
            out = nvfp4_scaled_mm_v2(
                target, Facts.of(args["mat_a"]), Facts.of(args["mat_b"]), facts["scale_a"], args["scale_recipe_a"],
                facts["scale_b"], args["scale_recipe_b"], args["swizzle_a"], args["swizzle_b"])
            assert (out.violation is None) == ok, (target, out)


def test_swizzled_scales_sit_where_cublas_reads_them():
    """cuBLAS's 1D block-scaling layout (its documentation): rows padded to 128, scale columns to 4, each 128x4 tile
    stored as 32x16 with (r, c) at ``tile * 512 + (r % 32) * 16 + (r // 32) * 4 + c``, tiles row-major."""
    rows, k = 130, 96  # 2 row tiles, 6 -> 8 scale columns: 2 column tiles
    q = nvfp4.quantize_nvfp4(torch.randn(rows, k) * torch.logspace(-2, 2, k))
    q = q._replace(global_scale=torch.tensor(0.5))
    args = nvfp4_scaled_mm_args(_operand(q), _operand(q))
    swizzled = args["scale_a"][0].view(torch.uint8)
    assert swizzled.numel() == scale_elements(rows, k // 2) and swizzled.dtype == torch.uint8
    col_tiles = 2
    for r in range(rows):
        for c in range(k // 16):
            tile = (r // 128) * col_tiles + c // 4
            at = tile * 512 + (r % 128 % 32) * 16 + (r % 128 // 32) * 4 + c % 4
            assert swizzled[at] == q.block_scales[r, c].view(torch.uint8)
    assert args["scale_a"][1].item() == 0.5 and args["mat_b"].shape == (k // 2, rows)
