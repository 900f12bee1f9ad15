"""torch's CUDA rules for ``torch._scaled_mm`` (v1), as pure functions of the operands' shapes, strides and dtypes and
of the device (capability, CUDA version, torch version).

:func:`scaled_mm_v1` follows ``_scaled_mm_out_cuda`` of ``aten/src/ATen/native/cuda/ScaledBlas.cpp`` check by check,
with torch's own wording, and names the kernel a legal call reaches. The 1x128 / 128x128 predicates are those of
:mod:`fp8_lightning.cuda_rules`; v2 (``torch.nn.functional.scaled_mm``) is in :mod:`.rules_v2`.

The sources, line by line, and where torch 2.11 and main differ: ``docs/design/notes.md``, section
``fp8_lightning.cuda_contract.rules``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from fp8_lightning import cuda_rules
from fp8_lightning.formats import NATIVE_MX_MIN_CAPABILITY, NATIVE_MX_MIN_CUDA

FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
E8M0 = torch.float8_e8m0fnu
ARCHS = {"sm_80": (8, 0), "sm_89": (8, 9), "sm_90": (9, 0), "sm_100": (10, 0), "sm_120": (12, 0)}
CONTRACT_ARCHS = ("sm_89", "sm_90", "sm_100", "sm_120")  # the FP8 architectures every GEMM is checked on
CUBLAS_ROWWISE_CUDA = (12, 9)  # cuBLASLt's outer-vector (rowwise) scales
MX_MIN_CAPABILITY, MX_MIN_CUDA = NATIVE_MX_MIN_CAPABILITY, NATIVE_MX_MIN_CUDA
ROWWISE_CUTLASS_ANY_OUT_TORCH = (2, 13)  # PR #187569: CUTLASS rowwise writes fp16 and fp32 right
SCALED_MM_V2_TORCH = (2, 10)  # torch.nn.functional.scaled_mm with the blockwise scaling types
ARCH_MESSAGE = (
    "torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0 or 8.9, or ROCm MI300+"
)

TENSORWISE, ROWWISE, BLOCK_1X128, BLOCK_128X128, BLOCK_1X32 = "TensorWise", "RowWise", "1x128", "128x128", "1x32"
V1_PAIRS = (
    (TENSORWISE, TENSORWISE), (ROWWISE, ROWWISE), (BLOCK_128X128, BLOCK_1X128), (BLOCK_1X128, BLOCK_128X128),
    (BLOCK_1X128, BLOCK_1X128), (BLOCK_1X32, BLOCK_1X32),
)  # get_joint_scaling's order in _scaled_mm_out_cuda (NVFP4's 1x16 pair follows; the library issues none)

_C10_NAMES = {
    torch.float8_e4m3fn: "Float8_e4m3fn", torch.float8_e5m2: "Float8_e5m2", E8M0: "Float8_e8m0fnu",
    torch.float32: "Float", torch.bfloat16: "BFloat16", torch.float16: "Half", torch.uint8: "Byte",
}


def c10_name(dtype: torch.dtype) -> str:
    """A dtype as torch's C++ messages print it (``Float8_e4m3fn``, ``BFloat16``, ``Float``)."""
    return _C10_NAMES.get(dtype, str(dtype).replace("torch.", ""))


class Facts(NamedTuple):
    """What the rules read of a tensor: its shape, strides, dtype and where it starts in its storage."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    offset: int = 0  # elements into its storage (allocations themselves are aligned)

    @classmethod
    def of(cls, t: torch.Tensor) -> "Facts":
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype, t.storage_offset())

    def t(self) -> "Facts":
        return Facts(self.shape[::-1], self.stride[::-1], self.dtype, self.offset)

    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    def is_contiguous(self) -> bool:
        """torch's rule: row-major strides, a dimension of size 1 may have any stride."""
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def layout(self) -> cuda_rules.Layout:
        return cuda_rules.Layout(self.shape, self.stride)

    def describe(self) -> str:
        return f"{tuple(self.shape)} strides {tuple(self.stride)} {c10_name(self.dtype)}"


@dataclasses.dataclass(frozen=True)
class Target:
    """A simulated device: architecture (``sm_90``), torch's CUDA version (None: a CPU build) and torch's version."""

    arch: str = "sm_90"
    cuda: tuple[int, int] | None = (12, 9)
    torch: tuple[int, int] = (2, 11)

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch={self.arch!r} is invalid; allowed: {', '.join(ARCHS)}.")

    @classmethod
    def parse(cls, arch: str, cuda: str | None = "12.9", torch_version: str = "2.11") -> "Target":
        def pair(text: str) -> tuple[int, int]:
            major, minor = (int(p) for p in text.split(".")[:2])
            return major, minor

        return cls(arch, None if cuda in (None, "", "none") else pair(cuda), pair(torch_version))

    @property
    def capability(self) -> tuple[int, int]:
        return ARCHS[self.arch]

    @property
    def has_scaled_mm_v2(self) -> bool:
        return self.torch >= SCALED_MM_V2_TORCH

    def cuda_at_least(self, version: tuple[int, int]) -> bool:
        return self.cuda is not None and self.cuda >= version

    def rowwise_on_cutlass(self) -> bool:
        """Whether v1 rowwise GEMMs run CUTLASS's ``f8f8bf16_rowwise`` (else cuBLASLt's outer-vector scales)."""
        major = self.capability[0]
        blackwell = major >= 10 if self.torch >= ROWWISE_CUTLASS_ANY_OUT_TORCH else major == 10
        return major < 9 or not self.cuda_at_least(CUBLAS_ROWWISE_CUDA) or blackwell

    def __str__(self) -> str:
        cuda = "no CUDA" if self.cuda is None else f"CUDA {self.cuda[0]}.{self.cuda[1]}"
        return f"{self.arch}, {cuda}, torch {self.torch[0]}.{self.torch[1]}"


class Outcome(NamedTuple):
    """What torch does with a call: the kernel it reaches, or the error (or silent misreading) that stops it."""

    kernel: str
    violation: str | None = None
    note: str | None = None


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


def is_scaling(kind: str, t: Facts, scale: Facts) -> bool:
    """``is_desired_scaling`` of ScaledBlas.cpp: does ``scale`` scale the float8 matrix ``t`` (rows, K) as ``kind``?"""
    if t.dtype not in FLOAT8:
        return False
    rows, k = t.shape
    if kind == BLOCK_1X32:
        want = _round_up(rows, 128) * _round_up(_ceil_div(k, 32), 4)
        return scale.dtype == E8M0 and scale.numel() == want and scale.is_contiguous()
    if scale.dtype != torch.float32:
        return False
    if kind == TENSORWISE:
        return scale.numel() == 1
    if kind == ROWWISE:
        return len(scale.shape) == 2 and scale.shape == (rows, 1) and scale.is_contiguous()
    if len(scale.shape) != 2:
        return False
    check = cuda_rules.is_blockwise_1x128_scaling if kind == BLOCK_1X128 else cuda_rules.is_blockwise_128x128_scaling
    return check((rows, k), scale.layout())


def joint_scaling(mat1: Facts, mat2: Facts, scale_a: Facts, scale_b: Facts) -> tuple[str, str] | None:
    """``get_joint_scaling``: the first pair that fits; mat2 is checked as ``mat2.t()`` with ``scale_b.t()`` (but an
    MX scale as given: it is swizzled)."""
    b_t = mat2.t()
    for lhs, rhs in V1_PAIRS:
        scale_b_check = scale_b if rhs == BLOCK_1X32 else scale_b.t()
        if is_scaling(lhs, mat1, scale_a) and is_scaling(rhs, b_t, scale_b_check):
            return lhs, rhs
    return None


def invalid_scaling_message(mat1: Facts, mat2: Facts, scale_a: Facts, scale_b: Facts) -> str:
    """The first and last lines of torch's "Invalid scaling configuration" error (its middle lists every rule)."""
    sizes = lambda f: "[" + ", ".join(map(str, f.shape)) + "]"  # noqa: E731
    strides = lambda f: "[" + ", ".join(map(str, f.stride)) + "]"  # noqa: E731
    return (
        "Invalid scaling configuration. ... Got "
        f"a.dtype()={c10_name(mat1.dtype)}, scale_a.dtype()={c10_name(scale_a.dtype)}, "
        f"scale_a.size()={sizes(scale_a)}, "
        f"scale_a.stride()={strides(scale_a)}, b.dtype()={c10_name(mat2.dtype)}, scale_b.dtype()="
        f"{c10_name(scale_b.dtype)}, scale_b.size()={sizes(scale_b)} and scale_b.stride()={strides(scale_b)}"
    )


def bias_violation(out_dtype: torch.dtype, bias: Facts | None, n: int) -> str | None:
    """The bias checks shared by v1 and v2 (size first, then dtypes, in torch's order)."""
    if bias is None:
        return None
    if bias.numel() != n:
        return f"Bias must be size {n} but got {bias.numel()}"
    if out_dtype == torch.float32:
        return "Bias is not supported when out_dtype is set to Float32"
    if bias.dtype not in (torch.bfloat16, torch.float16):
        return f"Bias must be BFloat16 or Half, but got {c10_name(bias.dtype)}"
    if out_dtype == torch.bfloat16 and bias.dtype != torch.bfloat16:
        return f"Bias must be BFloat16 to compute {c10_name(out_dtype)} output, but got {c10_name(bias.dtype)}"
    if out_dtype == torch.float16 and bias.dtype != torch.float16:
        return f"Bias must be Float16 to compute {c10_name(out_dtype)} output, but got {c10_name(bias.dtype)}"
    return None


def operand_violation(target: Target, mat1: Facts, mat2: Facts, names=("mat1", "mat2")) -> str | None:
    """Arch, shapes, multiples of 16 and float8 dtypes, in ``_scaled_mm_out_cuda``'s order."""
    if target.capability < (8, 9):
        return ARCH_MESSAGE
    (m, k), (k2, n) = mat1.shape, mat2.shape
    if k % 16:
        return f"Expected trailing dimension of {names[0]} to be divisible by 16 but got {names[0]} shape: ({m}x{k})."
    if k2 % 16 or n % 16:
        return f"{names[1]} shape ({k2}x{n}) must be divisible by 16"
    for name, f in zip(names, (mat1, mat2)):
        if f.dtype not in FLOAT8:
            return f"Expected {name} to be Float8 or Float4_x2 matrix got {c10_name(f.dtype)}"
    if mat1.dtype == mat2.dtype == torch.float8_e5m2:
        return "Multiplication of two Float8_e5m2 matrices is not supported"
    return None


def alignment_violation(mat1: Facts, mat2: Facts) -> str | None:
    """cuBLASLt's FP8 GEMMs read 16-byte aligned matrices (torch does not check; cuBLASLt finds no algorithm)."""
    for name, f in (("mat1", mat1), ("mat2", mat2)):
        start = f.offset * f.dtype.itemsize
        if start % 16:
            return f"cuBLASLt needs 16-byte aligned FP8 matrices: {name} starts {start} bytes into its storage"
    return None


def major_violation(target: Target, mat1: Facts, mat2: Facts) -> str | None:
    """``_scaled_gemm`` on sm_90 (and cuBLASLt's FP8 GEMMs on sm_89): mat1 row-major, mat2 column-major."""
    if target.capability[0] >= 10:
        return None
    row_major = mat1.stride[1] == 1 and mat1.stride[0] >= mat1.shape[1]
    column_major = mat2.stride[0] == 1 and mat2.stride[1] >= mat2.shape[0]
    if row_major and column_major:
        return None
    return "Only multiplication of row-major and column-major matrices is supported by cuBLASLt"


def deepseek_violation(target: Target) -> str | None:
    """``_check_deepseek_support`` with torch's wording."""
    if target.capability[0] != cuda_rules.BLOCKWISE_MAJOR:
        return "DeepSeek style (1x128, 128x128) scaling only supported in CUDA for SM90"
    if not target.cuda_at_least(cuda_rules.BLOCKWISE_MIN_CUDA):
        return "DeepSeek style (1x128, 128x128) scaling requires cublasLt >= 12.9"
    return None


def rowwise_outcome(target: Target, mat2: Facts, bias: Facts | None, out_dtype: torch.dtype) -> Outcome:
    """The rowwise kernel v1 and v2 reach on ``target`` and its output-dtype rules."""
    if not target.rowwise_on_cutlass():
        return Outcome("cuBLASLt rowwise (outer-vector scales)")
    kernel = "CUTLASS rowwise (f8f8bf16_rowwise)"
    any_out = target.torch >= ROWWISE_CUTLASS_ANY_OUT_TORCH
    allowed = (torch.bfloat16, torch.float16, torch.float32) if any_out else (torch.bfloat16, torch.float16)
    if out_dtype not in allowed:
        what = "bf16, fp16, and fp32" if any_out else "bf16 and fp16"
        return Outcome(kernel, f"Only {what} high precision output types are supported for row-wise scaling.")
    if mat2.dtype != torch.float8_e4m3fn:
        return Outcome(kernel, "Expected b.dtype() == at::kFloat8_e4m3fn to be true, but got false.")
    if out_dtype == torch.float16 and bias is None and not any_out:
        return Outcome(kernel, "silently wrong: this torch's CUTLASS rowwise kernel writes bfloat16 into a float16 "
                               "output when there is no bias (fixed by torch PR #187569)")
    return Outcome(kernel)


def scaled_mm_v1(
    target: Target, mat1: Facts, mat2: Facts, scale_a: Facts, scale_b: Facts, bias: Facts | None = None,
    out_dtype: torch.dtype = torch.bfloat16, use_fast_accum: bool = False, scale_result: Facts | None = None,
) -> Outcome:
    """What ``torch._scaled_mm(mat1, mat2, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum)`` does on
    ``target``: the kernel, or torch's error message (or a note that cuBLAS computes wrong results)."""
    if target.capability < (8, 9):
        return Outcome("none", operand_violation(target, mat1, mat2))
    if len(mat1.shape) != 2 or len(mat2.shape) != 2:
        return Outcome("none", f"{'mat1' if len(mat1.shape) != 2 else 'mat2'} must be a matrix")
    if mat1.shape[1] != mat2.shape[0]:
        (a0, a1), (b0, b1) = mat1.shape, mat2.shape
        return Outcome("none", f"mat1 and mat2 shapes cannot be multiplied ({a0}x{a1} and {b0}x{b1})")
    pair = joint_scaling(mat1, mat2, scale_a, scale_b)
    if pair is None:
        return Outcome("none", invalid_scaling_message(mat1, mat2, scale_a, scale_b))
    if scale_result is not None and (scale_result.numel() != 1 or scale_result.dtype != torch.float32):
        return Outcome("none", "scale_result must be a float scalar")
    n = mat2.shape[1]
    if bias is not None and bias.numel() != n:
        return Outcome("none", bias_violation(out_dtype, bias, n))
    reason = operand_violation(target, mat1, mat2) or bias_violation(out_dtype, bias, n)
    if reason is not None:
        return Outcome("none", reason)
    misaligned = alignment_violation(mat1, mat2)
    if misaligned is not None:
        return Outcome(f"cuBLASLt ({pair[0]} x {pair[1]})", misaligned)
    if pair == (ROWWISE, ROWWISE):
        outcome = rowwise_outcome(target, mat2, bias, out_dtype)
        return outcome if outcome.violation else Outcome(outcome.kernel, major_violation(target, mat1, mat2))
    if pair == (BLOCK_1X32, BLOCK_1X32):
        if target.capability < MX_MIN_CAPABILITY or not target.cuda_at_least(MX_MIN_CUDA):
            return Outcome("cuBLASLt MX (VEC32_UE8M0)", "cuBLASLt has no MX (1x32, e8m0) block scaling below compute "
                                                         "capability 10.0 and CUDA 12.8")
        note = None if out_dtype == torch.bfloat16 else f"{c10_name(out_dtype)} output of an MX GEMM: not run on a GPU"
        if torch.float8_e5m2 in (mat1.dtype, mat2.dtype):
            note = "an E5M2 operand in an MX GEMM: not run on a GPU"
        return Outcome("cuBLASLt MX (VEC32_UE8M0)", None, note)
    if pair[0] in (BLOCK_1X128, BLOCK_128X128):
        kernel = f"cuBLASLt {pair[0]} x {pair[1]}"
        reason = deepseek_violation(target) or major_violation(target, mat1, mat2)
        misread = "silently wrong: cuBLASLt reads the 128x128 {} with row stride round_up(ceil(K/128), 4) (torch PR " \
                  "#166752); got strides {}"
        if reason is None and pair[1] == BLOCK_128X128:
            if cuda_rules.cublas_misreads_128x128(mat2.t().shape, scale_b.t().layout()):
                reason = misread.format("scale_b", scale_b.stride)
        if reason is None and pair[0] == BLOCK_128X128:
            if cuda_rules.cublas_misreads_128x128(mat1.shape, scale_a.layout()):
                reason = misread.format("scale_a", scale_a.stride)
        note = None if out_dtype == torch.bfloat16 else f"{c10_name(out_dtype)} output of a 1x128/128x128 GEMM: not " \
                                                         "run on a GPU"
        return Outcome(kernel, reason, note)
    return Outcome("cuBLASLt tensorwise", major_violation(target, mat1, mat2))
