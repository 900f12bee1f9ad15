"""The CUDA contract's rules (fp8_lightning.cuda_contract.rules, .rules_v2) against ScaledBlas.cpp: each rule's failing
case is refused with torch's own words, its passing neighbour is accepted, and where torch's meta function checks the
same thing (on fake CUDA tensors) it refuses the same calls."""

from __future__ import annotations

import pytest
import torch

from fp8_lightning import cuda_rules
from fp8_lightning.cuda_contract.rules import Facts, Target, scaled_mm_v1
from fp8_lightning.cuda_contract.rules_v2 import meta_violation, scaled_mm_v2
from tests.core.fake_cuda import fake_cuda

E4M3, E5M2, F32, BF16, F16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float32, torch.bfloat16, torch.float16
SM90 = Target("sm_90", (12, 9), (2, 11))


def facts(shape, dtype=E4M3, stride=None) -> Facts:
    """A tensor's facts; row-major unless ``stride`` is given."""
    if stride is None:
        stride = tuple(int(torch.tensor(shape[i + 1:]).prod()) for i in range(len(shape)))
    return Facts(tuple(shape), tuple(stride), dtype)


def column_major(rows: int, cols: int, dtype=E4M3) -> Facts:
    return facts((rows, cols), dtype, (1, rows))


def tensorwise(m=64, k=768, n=3072, a=E4M3, b=E4M3):
    return facts((m, k), a), column_major(k, n, b), facts((), F32), facts((), F32)


def rowwise(m=64, k=768, n=3072, a=E4M3, b=E4M3):
    return facts((m, k), a), column_major(k, n, b), facts((m, 1), F32), facts((1, n), F32)


# (name, target, args of scaled_mm_v1, keyword args, torch's words, whether torch's meta function refuses it too)
V1_CASES = [
    ("arch", Target("sm_80"), tensorwise(), {},
     "torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0 or 8.9", False),
    ("shapes", SM90, (facts((64, 768)), column_major(512, 3072), facts((), F32), facts((), F32)), {},
     "mat1 and mat2 shapes cannot be multiplied (64x768 and 512x3072)", False),  # torch 2.13's meta does not check
    ("rowwise scale not contiguous", SM90, rowwise()[:2] + (facts((64, 1), F32, (2, 7)), facts((1, 3072), F32)), {},
     "Invalid scaling configuration.", False),
    ("scale dtype", SM90, tensorwise()[:2] + (facts((), BF16), facts((), F32)), {},
     "Invalid scaling configuration.", True),
    ("K multiple of 16", SM90, tensorwise(k=40), {},
     "Expected trailing dimension of mat1 to be divisible by 16 but got mat1 shape: (64x40).", True),
    ("N multiple of 16", SM90, tensorwise(n=40), {}, "mat2 shape (768x40) must be divisible by 16", True),
    ("two e5m2", SM90, tensorwise(a=E5M2, b=E5M2), {}, "Multiplication of two Float8_e5m2 matrices is not supported",
     False),
    ("bias size", SM90, tensorwise(), {"bias": facts((100,), BF16)}, "Bias must be size 3072 but got 100", False),
    ("bias with fp32 out", SM90, tensorwise(), {"bias": facts((3072,), F32), "out_dtype": F32},
     "Bias is not supported when out_dtype is set to Float32", False),
    ("bias dtype", SM90, tensorwise(), {"bias": facts((3072,), F32)}, "Bias must be BFloat16 or Half, but got Float",
     False),
    ("bias for bf16 out", SM90, tensorwise(), {"bias": facts((3072,), F16)},
     "Bias must be BFloat16 to compute BFloat16 output, but got Half", False),
    ("bias for fp16 out", SM90, tensorwise(), {"bias": facts((3072,), BF16), "out_dtype": F16},
     "Bias must be Float16 to compute Half output, but got BFloat16", False),
    ("row-major mat2", SM90, (facts((64, 768)), facts((768, 3072)), facts((), F32), facts((), F32)), {},
     "Only multiplication of row-major and column-major matrices is supported by cuBLASLt", True),
    ("CUTLASS rowwise fp32 out (2.11)", Target("sm_89", (12, 9), (2, 11)), rowwise(), {"out_dtype": F32},
     "Only bf16 and fp16 high precision output types are supported for row-wise scaling.", False),
    ("CUTLASS rowwise fp32 out (old CUDA)", Target("sm_90", (12, 4), (2, 11)), rowwise(), {"out_dtype": F32},
     "Only bf16 and fp16 high precision output types are supported for row-wise scaling.", False),
    ("CUTLASS rowwise e5m2 mat2", Target("sm_100", (12, 9), (2, 11)), rowwise(b=E5M2), {},
     "Expected b.dtype() == at::kFloat8_e4m3fn", False),
    ("CUTLASS rowwise fp16 out without bias (2.11)", Target("sm_89", (12, 9), (2, 11)), rowwise(),
     {"out_dtype": F16}, "silently wrong", False),
    ("DeepSeek off sm_90", Target("sm_100", (12, 9)), (facts((64, 768)), column_major(768, 3072),
     column_major(64, 6, F32), facts((24, 6), F32, (6, 1)).t()), {},
     "DeepSeek style (1x128, 128x128) scaling only supported in CUDA for SM90", False),
    ("DeepSeek below cuBLASLt 12.9", Target("sm_90", (12, 4)), (facts((64, 768)), column_major(768, 3072),
     column_major(64, 6, F32), facts((24, 6), F32, (6, 1)).t()), {},
     "DeepSeek style (1x128, 128x128) scaling requires cublasLt >= 12.9", False),
    ("misaligned mat1", SM90, (Facts((64, 768), (768, 1), E4M3, 8),) + tensorwise()[1:], {},
     "cuBLASLt needs 16-byte aligned FP8 matrices: mat1 starts 8 bytes into its storage", False),
    ("MX below sm_100", SM90, (facts((128, 256)), column_major(256, 128), facts((128 * 8,), torch.float8_e8m0fnu),
     facts((128 * 8,), torch.float8_e8m0fnu)), {}, "cuBLASLt has no MX (1x32, e8m0) block scaling", False),
    ("MX scale size", Target("sm_100"), (facts((128, 256)), column_major(256, 128),
     facts((128 * 4,), torch.float8_e8m0fnu), facts((128 * 8,), torch.float8_e8m0fnu)), {},
     "Invalid scaling configuration.", False),
]


@pytest.mark.parametrize("name, target, args, kwargs, words, meta", V1_CASES, ids=[c[0] for c in V1_CASES])
def test_v1_refuses_each_rules_failing_case_in_torchs_words(name, target, args, kwargs, words, meta):
    outcome = scaled_mm_v1(target, *args, **kwargs)
    assert outcome.violation is not None and words in outcome.violation, outcome
    if meta:  # torch's own meta function on fake CUDA tensors: a second implementation of the same rule
        with fake_cuda(), pytest.raises(Exception):
            torch._scaled_mm(*_fake(args), out_dtype=kwargs.get("out_dtype", BF16))


def _fake(args):
    return [torch.empty_strided(f.shape, f.stride, dtype=f.dtype, device="cuda") for f in args]


@pytest.mark.parametrize(
    "target, args, kwargs, kernel",
    [
        (SM90, tensorwise(), {"bias": facts((3072,), BF16)}, "cuBLASLt tensorwise"),
        (SM90, tensorwise(a=E5M2), {"out_dtype": F32}, "cuBLASLt tensorwise"),
        (SM90, rowwise(), {"out_dtype": F32}, "cuBLASLt rowwise"),  # cuBLASLt writes fp32 (the library's fix)
        (SM90, rowwise(), {"out_dtype": F16}, "cuBLASLt rowwise"),
        (Target("sm_89", (12, 9), (2, 13)), rowwise(), {"out_dtype": F32}, "CUTLASS rowwise"),  # PR #187569
        (Target("sm_89", (12, 9), (2, 11)), rowwise(a=E5M2), {}, "CUTLASS rowwise"),
        (Target("sm_100"), rowwise(), {"bias": facts((3072,), F16), "out_dtype": F16}, "CUTLASS rowwise"),
        (Target("sm_100"), (facts((128, 256)), column_major(256, 128), facts((128 * 8,), torch.float8_e8m0fnu),
                            facts((128 * 8,), torch.float8_e8m0fnu)), {}, "cuBLASLt MX"),
    ],
)
def test_v1_accepts_the_passing_neighbours(target, args, kwargs, kernel):
    outcome = scaled_mm_v1(target, *args, **kwargs)
    assert outcome.violation is None and outcome.kernel.startswith(kernel), outcome
    with fake_cuda():
        torch._scaled_mm(*_fake(args), out_dtype=kwargs.get("out_dtype", BF16))  # torch's meta agrees


def test_v1_blockwise_hidden_768_padded_layout_refused_exact_layout_misread():
    """K = 768, N = 3072 on sm_90: the 128x128 weight scale padded to a row stride of 8 is refused by
    ``is_blockwise_128x128_scaling``; the exact stride 6 passes torch's check but cuBLASLt reads stride 8."""
    mat1, mat2, scale_a = facts((64, 768)), column_major(768, 3072), column_major(64, 6, F32)
    padded = facts((24, 6), F32, (8, 1)).t()  # scale_b as v1 gets it: the transpose of (N blocks, K blocks)
    exact = facts((24, 6), F32, (6, 1)).t()
    refused = scaled_mm_v1(SM90, mat1, mat2, scale_a, padded).violation
    assert refused.startswith("Invalid scaling configuration.") and "scale_b.stride()=[1, 8]" in refused
    misread = scaled_mm_v1(SM90, mat1, mat2, scale_a, exact)
    assert "silently wrong" in misread.violation and "#166752" in misread.violation
    ok = scaled_mm_v1(SM90, facts((64, 1024)), column_major(1024, 3072), column_major(64, 8, F32),
                      facts((24, 8), F32, (8, 1)).t())  # 8 K-blocks: padded == exact
    assert ok.violation is None and ok.kernel == "cuBLASLt 1x128 x 128x128"


def test_v1_wgrad_over_at_most_128_tokens_reads_as_rowwise():
    """With K <= 128 a 1x128 scale (rows, 1) is also a RowWise one, which ``get_joint_scaling`` tries first: the
    same arithmetic, one scale per row, so the call is legal (on cuBLASLt rowwise or CUTLASS)."""
    outcome = scaled_mm_v1(SM90, facts((3072, 64)), column_major(64, 768), facts((3072, 1), F32),
                           facts((1, 768), F32))
    assert outcome.violation is None and outcome.kernel.startswith("cuBLASLt rowwise")


# -- v2: torch.nn.functional.scaled_mm -----------------------------------------------------------------------

def v2_blockwise(k=768, n=3072, m=64, a=E4M3, b=E4M3, scale_b=None):
    l4 = -(-(-(-k // 128)) // 4) * 4
    scale_b = scale_b or facts((l4, -(-n // 128)), F32, (1, l4))
    return (facts((m, k), a), column_major(k, n, b), column_major(m, -(-k // 128), F32), "BlockWise1x128", scale_b,
            "BlockWise128x128")


V2_CASES = [
    ("e5m2 operand", SM90, v2_blockwise(a=E5M2), "Invalid scaling configuration."),
    ("scale shape", SM90, v2_blockwise(scale_b=facts((6, 24), F32, (1, 6))),
     "scale_b must have shape 8 x 24 Float elements, got [6, 24]"),
    ("scale strides", SM90, v2_blockwise(scale_b=facts((8, 24), F32, (24, 1))),
     "scale_b must have strides (1, 8); got [24, 1]"),
    ("off sm_90", Target("sm_120"), v2_blockwise(),
     "DeepSeek style (1x128, 128x128) scaling only supported in CUDA for SM90"),
    ("K multiple of 16", SM90, v2_blockwise(k=40), "Expected trailing dimension of mat1 to be divisible by 16"),
]


@pytest.mark.parametrize("name, target, args, words", V2_CASES, ids=[c[0] for c in V2_CASES])
def test_v2_refuses_each_rules_failing_case_in_torchs_words(name, target, args, words):
    outcome = scaled_mm_v2(target, *args)
    assert outcome.violation is not None and words in outcome.violation, outcome


def test_v2_takes_cublas_padded_layout_and_the_meta_rule_is_kept_apart():
    """The padded (L4, N/128) layout is v2's; for a ragged K (160) the kernel takes it and the meta function
    (``K // 128``, what ``torch.compile`` checks) does not, as ``cuda_rules.v2_violation`` says."""
    outcome = scaled_mm_v2(SM90, *v2_blockwise())
    assert outcome.violation is None and outcome.kernel == "cuBLASLt 1x128 x 128x128"
    assert meta_violation(SM90, *v2_blockwise()) is None
    ragged = v2_blockwise(k=160, n=144)
    assert scaled_mm_v2(SM90, *ragged).violation is None
    assert "meta function" in meta_violation(SM90, *ragged)
    kinds = torch.nn.functional.ScalingType
    with fake_cuda():
        for args, refused in ((v2_blockwise(), False), (ragged, True)):  # torch's meta function agrees
            mat_a, mat_b, scale_a, scale_b = _fake([args[0], args[1], args[2], args[4]])
            try:
                torch.nn.functional.scaled_mm(mat_a, mat_b, scale_a, kinds.BlockWise1x128, scale_b,
                                              kinds.BlockWise128x128)
            except Exception:
                assert refused
            else:
                assert not refused


def test_rowwise_direct_output_rule_agrees_with_the_contract_on_every_device():
    """The library's choice (cuda_rules.rowwise_direct_output) never asks torch for an output dtype the contract's
    rules refuse or compute wrong, on any architecture, CUDA or torch version."""
    for arch in ("sm_89", "sm_90", "sm_100", "sm_120"):
        for cuda in ((12, 4), (12, 9), (13, 0)):
            for version in ((2, 11), (2, 13)):
                target = Target(arch, cuda, version)
                for out_dtype in (BF16, F16, F32):
                    if cuda_rules.rowwise_direct_output(target.capability, cuda, out_dtype):
                        outcome = scaled_mm_v1(target, *rowwise(), out_dtype=out_dtype)
                        assert outcome.violation is None, (target, out_dtype, outcome)
    assert cuda_rules.rowwise_direct_output((9, 0), (12, 9), F32)
    assert not cuda_rules.rowwise_direct_output((8, 9), (12, 9), F32)
    assert not cuda_rules.rowwise_direct_output((9, 0), (12, 4), F16)
