"""torch's CUDA rules for NVFP4 GEMMs (``float4_e2m1fn_x2`` operands, 1x16 E4M3 block scales), v1 and v2, as pure
functions with torch's wording, so that the FP4 calls the library builds are checked on a machine without a GPU.

Sources: ``aten/src/ATen/native/cuda/ScaledBlas.cpp`` at pytorch/pytorch 2bec3bdf, the 2.11-era copy (line numbers
counted in it), and ``ScaledBlasUtils.cpp`` ``check_nvfp4_recipe``. Packed operands hold K / 2 bytes per row:

* v1 ``torch._scaled_mm`` (``_scaled_mm_out_cuda``): the (BlockWise1x16, BlockWise1x16) pair comes last in
  ``get_joint_scaling``; ``is_blockwise_1x16_scaling`` (lines 168-176) wants E4M3 scales of
  ``round_up(rows, 128) * round_up(ceil(K / 16), 4)`` elements, contiguous (swizzled: ``scale_b`` is not transposed);
  the size checks read the *packed* sizes, so K / 2 and N must be multiples of 16 (K of 32); ``use_fast_accum`` is
  refused; there is no global scale (``scale_result`` only applies to float8 outputs): the caller multiplies the
  product by ``g_a * g_b``.
* v2 ``torch.nn.functional.scaled_mm`` (``_scaled_mm_cuda_v2_out``): ``K_multiplier = 2``, so K (unpacked) and N must
  be multiples of 16; ``check_nvfp4_recipe`` takes ``[block scales (E4M3), global scale (float32)]`` with recipes
  ``[BlockWise1x16, TensorWise]`` per operand (``nvfp4_nvfp4``: cuBLAS multiplies by ``alpha = g_a * g_b``), the
  single-scale form ``[BlockWise1x16]`` otherwise; ``_scaled_nvfp4_nvfp4`` checks the element counts, SWIZZLE_32_4_4
  and contiguity. Neither checks the device: cuBLASLt's VEC16_UE4M3 scaling needs compute capability 10.x/12.x and
  CUDA 12.8, or its call fails.
"""

from __future__ import annotations

import torch

from fp8_lightning.cuda_contract.rules import (
    ARCH_MESSAGE,
    Facts,
    Outcome,
    Target,
    alignment_violation,
    bias_violation,
    c10_name,
)

FP4 = torch.float4_e2m1fn_x2
NVFP4_MIN_CAPABILITY = (10, 0)
NVFP4_MIN_CUDA = (12, 8)
BLOCK_1X16 = "BlockWise1x16"
KERNEL = "cuBLASLt NVFP4 (VEC16_UE4M3)"
FAST_ACCUM = "`use_fast_accum` is not supported when `{0}` or `{1}` tensors have the `Float4_e2m1fn_x2` dtype."


def _name(dtype: torch.dtype) -> str:
    return "Float4_e2m1fn_x2" if dtype == FP4 else c10_name(dtype)


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def scale_elements(rows: int, packed_k: int) -> int:
    """The E4M3 scale count cuBLAS reads for a packed FP4 matrix (rows, K / 2): 128x4-padded, swizzled."""
    return _round_up(rows, 128) * _round_up(-(-(packed_k * 2) // 16), 4)


def is_1x16_scaling(t: Facts, scale: Facts) -> bool:
    """``is_blockwise_1x16_scaling``: FP4 ``t`` (rows, K / 2) and a contiguous E4M3 scale of the swizzled size."""
    return (t.dtype == FP4 and scale.dtype == torch.float8_e4m3fn
            and scale.numel() == scale_elements(*t.shape) and scale.is_contiguous())


def _device_violation(target: Target) -> str | None:
    if target.capability[0] not in (10, 12) or not target.cuda_at_least(NVFP4_MIN_CUDA):
        return ("cuBLASLt has no NVFP4 (1x16, e4m3) block scaling below compute capability 10.0 or CUDA 12.8 "
                f"({target})")
    return None


def _fp4_dtypes(mat_a: Facts, mat_b: Facts, names: tuple[str, str]) -> str | None:
    for name, f in zip(names, (mat_a, mat_b)):
        if f.dtype != FP4 and f.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            return f"Expected {name} to be Float8 or Float4_x2 matrix got {_name(f.dtype)}"
    return None


def nvfp4_scaled_mm_v1(
    target: Target, mat1: Facts, mat2: Facts, scale_a: Facts, scale_b: Facts, bias: Facts | None = None,
    out_dtype: torch.dtype = torch.bfloat16, use_fast_accum: bool = False, scale_result: Facts | None = None,
) -> Outcome:
    """What ``torch._scaled_mm(mat1, mat2, scale_a, scale_b, ...)`` does with packed FP4 operands on ``target``."""
    if target.capability < (8, 9):
        return Outcome("none", ARCH_MESSAGE)
    (m, k2), (k2b, n) = mat1.shape, mat2.shape
    if k2 != k2b:
        return Outcome("none", f"mat1 and mat2 shapes cannot be multiplied ({m}x{k2} and {k2b}x{n})")
    if not (is_1x16_scaling(mat1, scale_a) and is_1x16_scaling(mat2.t(), scale_b)):
        return Outcome("none", "Invalid scaling configuration. ... For Blockwise 1x16 scaling, a and b should be "
                               f"float4 (packed 2x), scales should be float8_e4m3fn, scale_a should have "
                               f"{scale_elements(m, k2)} elements and scale_b should have {scale_elements(n, k2)} "
                               f"elements, and both should be contiguous. Got {mat1.describe()}, scale_a "
                               f"{scale_a.describe()}, scale_b {scale_b.describe()}")
    if scale_result is not None and (scale_result.numel() != 1 or scale_result.dtype != torch.float32):
        return Outcome("none", "scale_result must be a float scalar")
    if bias is not None and bias.numel() != n:
        return Outcome("none", bias_violation(out_dtype, bias, n))
    if k2 % 16:
        return Outcome("none", f"Expected trailing dimension of mat1 to be divisible by 16 but got mat1 shape: "
                               f"({m}x{k2}).")
    if k2b % 16 or n % 16:
        return Outcome("none", f"mat2 shape ({k2b}x{n}) must be divisible by 16")
    reason = _fp4_dtypes(mat1, mat2, ("mat1", "mat2"))
    if reason is None and use_fast_accum:
        reason = FAST_ACCUM.format("mat1", "mat2")
    reason = reason or bias_violation(out_dtype, bias, n)
    if reason is not None:
        return Outcome("none", reason)
    misaligned = alignment_violation(mat1, mat2)
    if misaligned is not None:
        return Outcome(KERNEL, misaligned)
    note = "v1 applies no global scale: the caller multiplies the output by g_a * g_b"
    return Outcome(KERNEL, _device_violation(target), note)


def nvfp4_scaled_mm_v2(
    target: Target, mat_a: Facts, mat_b: Facts, scales_a: list, recipes_a: list, scales_b: list, recipes_b: list,
    swizzles_a: list | None = None, swizzles_b: list | None = None, bias: Facts | None = None,
    out_dtype: torch.dtype = torch.bfloat16, use_fast_accum: bool = False,
) -> Outcome:
    """What ``torch.nn.functional.scaled_mm`` does with packed FP4 operands and per-operand lists of scales (block
    scales, optionally the float32 global scale), recipes (names or ``ScalingType``) and swizzles."""
    if target.capability < (8, 9):
        return Outcome("none", ARCH_MESSAGE)
    (m, k2), (k2b, n) = mat_a.shape, mat_b.shape
    if k2 != k2b:
        return Outcome("none", f"mat_a and mat_b shapes cannot be multiplied ({m}x{k2} and {k2b}x{n})")
    mult = 2 if mat_a.dtype == FP4 else 1
    if bias is not None and bias.numel() != n:
        return Outcome("none", bias_violation(out_dtype, bias, n))
    if (mult * k2) % 16:
        return Outcome("none", f"Expected trailing dimension of mat1 to be divisible by 16 but got mat1 shape: "
                               f"({m}x{mult * k2}).")
    if (mult * k2b) % 16 or n % 16:
        return Outcome("none", f"mat2 shape ({k2b}x{n}) must be divisible by 16")
    reason = _fp4_dtypes(mat_a, mat_b, ("mat_a", "mat_b"))
    if reason is None and use_fast_accum and FP4 in (mat_a.dtype, mat_b.dtype):
        reason = FAST_ACCUM.format("mat_a", "mat_b")
    reason = reason or bias_violation(out_dtype, bias, n)
    if reason is not None:
        return Outcome("none", reason)
    names = lambda recipes: [getattr(r, "name", str(r)).rpartition(".")[2] for r in recipes]  # noqa: E731
    kinds_a, kinds_b = names(recipes_a), names(recipes_b)
    fp4 = mat_a.dtype == mat_b.dtype == FP4
    two_level = [BLOCK_1X16, "TensorWise"]
    accepted = fp4 and len(scales_a) == len(kinds_a) == len(scales_b) == len(kinds_b) and (
        (kinds_a == kinds_b == two_level and scales_a[0].dtype == scales_b[0].dtype == torch.float8_e4m3fn
         and scales_a[1].dtype == scales_b[1].dtype == torch.float32)
        or (kinds_a == kinds_b == [BLOCK_1X16] and scales_a[0].dtype == scales_b[0].dtype == torch.float8_e4m3fn))
    if not accepted:
        return Outcome("none", f"Invalid scaling configuration. ... Got {kinds_a} x {kinds_b} for "
                               f"{_name(mat_a.dtype)} and {_name(mat_b.dtype)} (NVFP4: Float4_e2m1fn_x2 operands, "
                               "[BlockWise1x16 e4m3] or [BlockWise1x16 e4m3, TensorWise float32] per operand)")
    for name, want, got in (("scale_a", scale_elements(m, k2), scales_a[0]), ("scale_b", scale_elements(n, k2),
                                                                             scales_b[0])):
        if got.numel() != want:
            return Outcome(KERNEL, f"For Blockwise scaling {name} should have {want} elements, got: {got.numel()}")
    for name, swizzles in (("scale_a", swizzles_a), ("scale_b", swizzles_b)):
        first = swizzles[0] if swizzles else None
        if "SWIZZLE_32_4_4" not in str(first):
            return Outcome(KERNEL, f"{name} must be swizzled to SWIZZLE_32_4_4 format")
    if not (scales_a[0].is_contiguous() and scales_b[0].is_contiguous()):
        return Outcome(KERNEL, "For Blockwise scaling both scales should be contiguous")
    reason = alignment_violation(mat_a, mat_b) or _device_violation(target)
    note = "cuBLAS multiplies by alpha = g_a * g_b" if len(kinds_a) == 2 else "no global scale: the caller applies it"
    return Outcome(KERNEL, reason, note)
