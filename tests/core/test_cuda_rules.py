"""torch's CUDA rules for blockwise GEMMs (fp8_lightning.cuda_rules) against the layouts the library passes, on fake
CUDA tensors: the 128x128 layout v1 ``torch._scaled_mm`` refuses (hidden 768), the path each GEMM shape takes on
sm_90, and the fallbacks on sm_100 and old CUDA, which warn once and never raise."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest
import torch

from fp8_lightning import blockwise, cuda_rules
from fp8_lightning.blockwise import (
    blockwise_gemm_path,
    blockwise_mm,
    blockwise_scaled_mm_args,
    blockwise_scaled_mm_v2_args,
)
from fp8_lightning.cuda_rules import EMULATE, V1, V2, Layout, blockwise_gemm_plan
from fp8_lightning.kernels.fine_grained_layout import ceil_div
from fp8_lightning.quantize import Quantized, row_major
from tests.core.fake_cuda import fake_cuda, fake_operand

SM90, SM100, CUDA_12_9 = (9, 0), (10, 0), (12, 9)
GPT2 = [(768, 2304), (768, 768), (768, 3072), (3072, 768), (768, 50304)]  # (in_features, out_features)
LLAMA3_8B = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096), (4096, 128256)]
FFN_11008 = [(4096, 11008), (11008, 4096)]
RAGGED = [(160, 144), (1000, 40), (300, 200), (120, 1000)]
TOKENS = [1, 77, 4113]


def _device(monkeypatch, capability=SM90, cuda="12.9", v2=True):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(blockwise, "has_scaled_mm_v2", lambda: v2)
    monkeypatch.setattr(blockwise, "_WARNED", set())


def _gemms(m: int, k: int, n: int) -> dict[str, tuple[Quantized, Quantized]]:
    """The layer's three GEMMs on fake CUDA operands (inside fake_cuda): fprop x @ W.T, dgrad g @ W (W.T's blocks),
    wgrad g.T @ x (1x128 along the tokens)."""
    x, w = fake_operand((m, k), (m, ceil_div(k, 128)), "block"), fake_operand(
        (n, k), (ceil_div(n, 128), ceil_div(k, 128)), "block"
    )
    g, w_t = fake_operand((m, n), (m, ceil_div(n, 128)), "block"), Quantized(w.data.t(), w.scale.t(), "block")
    g_t, x_t = fake_operand((n, m), (n, ceil_div(m, 128)), "block"), fake_operand((k, m), (k, ceil_div(m, 128)), "block")
    return {"fprop": (x, w), "dgrad": (g, w_t), "wgrad": (g_t, x_t)}


def _violation(path: str, a: Quantized, b: Quantized) -> str | None:
    """What torch (and cuBLAS) would refuse or misread in the call ``path`` makes for ``a @ b.T``, or None."""
    if path == V2:
        mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b = blockwise_scaled_mm_v2_args(a, b)
        kinds = {torch.nn.functional.ScalingType.BlockWise1x128: "1x128"}
        kind_a, kind_b = (kinds.get(r, "128x128") for r in (recipe_a, recipe_b))
        return cuda_rules.v2_violation(
            SM90, CUDA_12_9, Layout.of(mat_a), Layout.of(mat_b), kind_a, Layout.of(scale_a), kind_b, Layout.of(scale_b)
        )
    mat1, mat2, scale_a, scale_b = blockwise_scaled_mm_args(a, b)
    layouts = [Layout.of(t) for t in (mat1, mat2, scale_a, scale_b)]
    reason = cuda_rules.v1_violation(SM90, CUDA_12_9, *layouts)
    if reason is None and b.scale.shape[0] != b.data.shape[0]:  # b has 128x128 blocks: does cuBLAS read them right?
        if cuda_rules.cublas_misreads_128x128(tuple(mat2.t().shape), Layout.of(scale_b.t())):
            return f"cuBLAS reads scale_b {tuple(scale_b.shape)} strides {scale_b.stride()} at other places"
    return reason


def test_v1_refuses_the_padded_128x128_layout_at_hidden_768_and_misreads_the_exact_one():
    """Today's failure, K = 768, N = 3072 on sm_90: the cast's 128x128 scale has row stride 8 (6 K-blocks padded to
    4), which ``is_blockwise_128x128_scaling`` refuses (it wants 6); torch's meta function, which checks no strides,
    lets it through, so only a GPU would have raised. The stride-6 layout passes v1 but cuBLAS reads stride 8."""
    with fake_cuda():
        x, w = _gemms(64, 768, 3072)["fprop"]
        mat1, mat2, scale_a, scale_b = blockwise_scaled_mm_args(x, w)
        assert scale_b.t().stride() == (8, 1)
        torch._scaled_mm(mat1, mat2, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)  # meta: no error
        padded = [Layout.of(t) for t in (mat1, mat2, scale_a, scale_b)]
        reason = cuda_rules.v1_violation(SM90, CUDA_12_9, *padded)
        assert reason is not None and reason.startswith("Invalid scaling configuration")
        assert "ceil(K/128) exactly" in reason and "(1, 64)" in reason
        exact = row_major(w.inverse_scale())  # (24, 6), strides (6, 1)
        assert cuda_rules.v1_violation(SM90, CUDA_12_9, *padded[:3], Layout.of(exact.t())) is None
        assert cuda_rules.v1_joint_scaling(*padded[:3], Layout.of(exact.t())) == ("1x128", "128x128")
        assert cuda_rules.cublas_misreads_128x128((3072, 768), Layout.of(exact))
        assert not cuda_rules.cublas_misreads_128x128((3072, 768), Layout.of(scale_b.t()))
    # The rules where the padded stride is the exact one: 8 K-blocks, or one row of blocks.
    assert cuda_rules.is_blockwise_128x128_scaling((3072, 1024), Layout((24, 8), (8, 1)))
    assert cuda_rules.is_blockwise_128x128_scaling((128, 768), Layout((1, 6), (8, 1)))
    assert not cuda_rules.is_blockwise_128x128_scaling((3072, 768), Layout((24, 6), (8, 1)))
    assert cuda_rules.is_blockwise_1x128_scaling((64, 768), Layout((64, 6), (1, 64)))
    assert not cuda_rules.is_blockwise_1x128_scaling((64, 768), Layout((64, 6), (6, 1)))


@pytest.mark.parametrize(
    "k, n, has_v2, block, path",
    [
        (768, 3072, True, "b", V2),  # GPT-2 fc1 fprop
        (768, 3072, False, "b", EMULATE),  # 6 K-blocks, 24 row blocks: v1 refuses or misreads
        (3072, 768, False, "b", V1),  # 24 K-blocks: the padded stride is exact
        (50304, 768, False, "b", EMULATE),  # GPT-2 lm_head dgrad: 393 K-blocks
        (50304, 768, True, "b", V2),
        (768, 128, False, "b", V1),  # one row of blocks
        (160, 144, True, "b", EMULATE),  # ragged K: v2's meta function checks K // 128
        (1000, 40, True, "b", V1),  # 8 K-blocks
        (768, 3072, True, None, V1),  # wgrad: 1x128 x 1x128
        (768, 3072, False, None, V1),
    ],
)
def test_plan_on_sm90(k, n, has_v2, block, path):
    got, reason = blockwise_gemm_plan(77, k, n, SM90, has_v2, CUDA_12_9, block)
    assert got == path, reason
    assert blockwise_gemm_plan(77, k, n, SM90, has_v2, CUDA_12_9, block) == (got, reason)  # a pure function
    if path == EMULATE:
        assert "PR #166752" in reason and f"ceil(K/128) = {ceil_div(k, 128)}" in reason


@pytest.mark.parametrize("has_v2", [True, False], ids=["v2", "no-v2"])
@pytest.mark.parametrize("model", ["gpt2", "llama3-8b", "ffn-11008", "ragged"])
def test_no_chosen_path_breaks_a_rule_and_the_fake_cuda_call_passes_torchs_meta(monkeypatch, model, has_v2):
    """Every GEMM of every layer shape, with ragged token counts: the path chosen on sm_90 never passes a layout
    torch's CUDA rules refuse or cuBLAS misreads, and :func:`blockwise_mm` itself runs on fake CUDA tensors (torch's
    meta checks of ``_scaled_mm`` / ``scaled_mm``, or the emulation) with the right output shape."""
    _device(monkeypatch, v2=has_v2)
    layers = {"gpt2": GPT2, "llama3-8b": LLAMA3_8B, "ffn-11008": FFN_11008, "ragged": RAGGED}[model]
    seen = set()
    with fake_cuda(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k, n in layers:
            for m in TOKENS:
                for role, (a, b) in _gemms(m, k, n).items():
                    path, reason = blockwise_gemm_path(a, b)
                    seen.add(path)
                    if path != EMULATE:
                        assert _violation(path, a, b) is None, (model, m, k, n, role, path, reason)
                    out = blockwise_mm(a, b, torch.bfloat16)
                    assert tuple(out.shape) == (a.data.shape[0], b.data.shape[0]) and out.dtype == torch.bfloat16
                    if role == "wgrad":
                        assert path == V1
                    elif has_v2 and model != "ragged":
                        assert path == V2, (model, m, k, n, role, reason)
    if model == "ffn-11008" and not has_v2:
        assert EMULATE in seen  # 86 K-blocks: fprop of the down projection, dgrad of the up projection


def test_v2_kernel_takes_ragged_shapes_its_meta_function_refuses():
    """Why v2 is used only for multiples of 128: for K = 160 the kernel's rule (ceil) accepts the padded scale, the
    meta function (K // 128) does not, and a traced step would fail on it."""
    with fake_cuda():
        x, w = _gemms(64, 160, 144)["fprop"]
        mat_a, mat_b, scale_a, _, scale_b, _ = blockwise_scaled_mm_v2_args(x, w)
        layouts = [Layout.of(t) for t in (mat_a, mat_b, scale_a, scale_b)]
        assert scale_b.shape == (4, 2) and scale_b.stride() == (1, 4)  # (L4, N blocks), strides (1, L4)
        args = (SM90, CUDA_12_9, layouts[0], layouts[1], "1x128", layouts[2], "128x128", layouts[3])
        assert cuda_rules.v2_violation(*args, meta=False) is None
        assert "meta function" in cuda_rules.v2_violation(*args)


def test_v2_layout_of_the_hidden_768_gemm_passes_torchs_meta():
    with fake_cuda():
        for a, b in list(_gemms(64, 768, 3072).values())[:2]:
            mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b = blockwise_scaled_mm_v2_args(a, b)
            out = torch.nn.functional.scaled_mm(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b)
            assert tuple(out.shape) == (a.data.shape[0], mat_b.shape[1])
            assert _violation(V2, a, b) is None


@pytest.mark.parametrize(
    "capability, cuda, words",
    [
        (SM100, "12.9", "compute capability 10.0 has no 1x128/128x128 block-scaled GEMM"),
        ((12, 0), "13.0", "compute capability 12.0"),
        ((8, 9), "12.9", "compute capability 8.9"),
        (SM90, "12.4", "CUDA 12.4 has no block-scaled GEMM (needs CUDA 12.9+"),
    ],
)
def test_unsupported_devices_fall_back_with_the_reason_once_and_never_raise(monkeypatch, capability, cuda, words):
    _device(monkeypatch, capability, cuda)
    major_minor = tuple(int(p) for p in cuda.split("."))
    path, reason = blockwise_gemm_plan(64, 768, 3072, capability, True, major_minor)
    assert path == EMULATE and words in reason
    with fake_cuda():
        gemms = _gemms(64, 768, 3072)
        with pytest.warns(UserWarning, match="emulates the GEMM") as record:
            for a, b in gemms.values():
                blockwise_mm(a, b, torch.bfloat16)
        assert len(record) == 1 and words in str(record[0].message)  # one reason, one warning
        assert "FP8_LIGHTNING_EMULATE=1" in str(record[0].message)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            blockwise_mm(*gemms["fprop"], torch.bfloat16)  # not again


def test_plan_refuses_an_unknown_operand_name():
    with pytest.raises(ValueError, match=r"block_operand='c' is invalid; allowed: 'a', 'b' or None"):
        blockwise_gemm_plan(1, 128, 128, SM90, True, CUDA_12_9, "c")


def test_the_gpu_check_runs_the_shapes_v1_refused():
    """``benchmarks/gpu_check.py --only blockwise-shapes`` (run in the GPU session's checks) covers hidden 768 in
    fprop and dgrad, the lm_head dgrad and FFN 11008: shapes where the padded 128x128 layout is not v1's, which now
    take v2 (or the emulation) and need a GPU to confirm."""
    source = (Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py").read_text()  # tests import no
    assigned = [node for node in ast.parse(source).body if isinstance(node, ast.Assign)]  # benchmarks: read its source
    shapes = next(ast.literal_eval(a.value) for a in assigned if a.targets[0].id == "BLOCKWISE_SHAPES")
    refused = set()
    for k, n, m in shapes:
        for role, (rows, red, cols) in {"fprop": (m, k, n), "dgrad": (m, n, k)}.items():
            if blockwise_gemm_plan(rows, red, cols, SM90, False, CUDA_12_9)[0] == EMULATE:
                refused.add((k, n, role))
    assert {(768, 3072, "fprop"), (3072, 768, "dgrad"), (768, 50304, "dgrad"), (4096, 11008, "dgrad")} <= refused


def test_e5m2_gradients_never_take_v2(monkeypatch):
    """HYBRID casts gradients to E5M2; v2's blockwise recipes take E4M3 operands only (``check_deepseek_recipe``),
    so dgrad and wgrad with E5M2 take v1 where its rule holds and the emulation elsewhere."""
    _device(monkeypatch)
    assert blockwise_gemm_plan(77, 3072, 768, SM90, True, CUDA_12_9, "b", e4m3=False)[0] == V1  # kt = 24
    path, reason = blockwise_gemm_plan(77, 768, 3072, SM90, True, CUDA_12_9, "b", e4m3=False)
    assert path == EMULATE and "E4M3 operands only" in reason
    with fake_cuda():
        w = fake_operand((768, 3072), (6, 24), "block")
        g = fake_operand((64, 768), (64, 6), "block", dtype=torch.float8_e5m2)
        w_t = Quantized(w.data.t(), w.scale.t(), "block")  # dgrad of a 3072 -> 768 layer: reduces over 768
        assert blockwise_gemm_path(g, w_t)[0] == EMULATE
        with pytest.warns(UserWarning, match="E4M3 operands only"):
            assert blockwise_mm(g, w_t, torch.bfloat16).shape == (64, 3072)
