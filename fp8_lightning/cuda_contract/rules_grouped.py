"""torch 2.11's CUDA rules for ``torch._scaled_grouped_mm`` as pure functions, with torch's wording, and the check of
the rowwise expert GEMMs' calls (built by :mod:`fp8_lightning.rowwise_grouped` on meta tensors) against them.

Sources (pytorch/pytorch): ``_scaled_grouped_mm_cuda`` in ``aten/src/ATen/native/cuda/GroupedBlas.cpp`` (device
compute capability 9.x or 10.x, layouts, K and N multiples of 16, no bias, offs iff a 2-D operand, int32 1-D offs,
float32 or e8m0 scales, ``_check_scales_fp8_rowwise``, bf16 output); ``check_valid_strides_and_return_transposed``
in ``GroupedMMUtils.h`` (mat_a row-major, mat_b column-major, leading strides multiples of 16 bytes);
``f8f8bf16_grouped_gemm_impl_sm90`` in ``ScaledGroupMM.cu`` (fewer than 1024 groups; e4m3 operands);
``prepare_grouped_gemm_data`` in ``GroupMMCommon.cuh`` (2-D x 2-D: every group non-empty, every group but the last a
multiple of 16 bytes along the ragged K). torch PR #188063 (June 2026, after 2.11) brought the rowwise grouped kernel
to sm_100; before it the kernel is built for sm_90 only. MXFP8 calls (e8m0 scales, ``SWIZZLE_32_4_4`` blocked per
group, sm_100) have their own rules: :mod:`.rules_mx_grouped`.
"""

from __future__ import annotations

import torch

from fp8_lightning.cuda_contract.rules import Facts, Outcome, Target, c10_name

GROUPED_KERNEL = "CUTLASS rowwise grouped GEMM (sm_90)"
ROWWISE_GROUPED_SM100_TORCH = (2, 13)  # PR #188063; the rules assume it in releases after 2.11


def _transposed(name: str, mat: Facts) -> tuple[bool | None, str | None]:
    """``check_valid_strides_and_return_transposed``: (column-major?, violation)."""
    *_, rows, cols = mat.shape
    *_, s_rows, s_cols = mat.stride
    alignment = 16 // mat.dtype.itemsize
    if s_rows == 1 and s_cols >= max(1, rows):
        return True, None if s_cols % alignment == 0 else f"{name}: strides should be multiple of 16 bytes"
    if s_cols == 1 and s_rows >= max(1, cols):
        return False, None if s_rows % alignment == 0 else f"{name}: strides should be multiple of 16 bytes"
    return None, f"{name}: Invalid strides/sizes, got {list(mat.stride)} for strides and {list(mat.shape)} for sizes"


def _scale_violation(arg: int, mat: Facts, scale: Facts, dim: int, multiplier: int) -> str | None:
    """``_check_scales_fp8_rowwise`` for float32 scales."""
    if len(mat.shape) == 2:
        if len(scale.shape) != 1:
            return f"scale must be a 1D tensor, but got {len(scale.shape)}D, arg {arg}"
        if not scale.is_contiguous():
            return f"scale must be contiguous for arg {arg}"
        if scale.shape[0] != mat.shape[dim] * multiplier:
            return f"scale must have the same length as mat for arg {arg}"
        return None
    if len(scale.shape) != 2:
        return f"scale must be a 2D tensor, but got {len(scale.shape)}D for arg {arg}"
    if scale.stride[1] != 1:
        return f"scale must be contiguous in the last dimension for arg {arg}"
    if scale.shape[0] != mat.shape[0]:
        return f"scale must have the same batch dimension as mat for arg {arg}"
    if scale.shape[1] != mat.shape[1 + dim]:
        return f"scale must have the same first dimension as mat for arg {arg}"
    return None


def grouped_layout_reason(mat_a: Facts, mat_b: Facts, offs: Facts | None) -> str | None:
    """torch 2.11's layout checks of every FP8 grouped call (rowwise and MX alike, ``GroupedBlas.cpp``): the
    operands' majorness, the contraction, 16-element multiples and ``offs``; the error that stops the call, or None."""
    a_t, reason = _transposed("mat_a", mat_a)
    if reason is None and a_t:
        reason = "Expected mat1 to not be transposed"
    b_t, reason_b = _transposed("mat_b", mat_b)
    reason = reason or reason_b or (None if b_t else "Expected mat2 to be transposed")
    if reason:
        return reason
    a2, b2 = len(mat_a.shape) == 2, len(mat_b.shape) == 2
    if not (a2 and b2) and mat_a.shape[-1] != mat_b.shape[-2]:
        return "contraction dimension of mat_a and mat_b must match"
    if mat_a.shape[-1] % 16:
        return f"Expected trailing dimension of mat_a to be divisible by 16 but got mat1 shape: ({list(mat_a.shape)})."
    if mat_b.shape[-2] % 16 or mat_b.shape[-1] % 16:
        return f"Expected mat_b shape to be divisible by 16 but got mat_b shape: ({list(mat_b.shape)})."
    if (offs is not None) != (a2 or b2):
        return "Have to provide offsets if there is a 2d matrix"
    if offs is not None and (len(offs.shape) != 1 or offs.dtype != torch.int32):
        return "offs has to be 1D" if len(offs.shape) != 1 else "Offsets have to be int32"
    return None


def scaled_grouped_mm(
    target: Target, mat_a: Facts, mat_b: Facts, scale_a: Facts, scale_b: Facts, offs: Facts | None,
    out_dtype: torch.dtype | None = torch.bfloat16, group_sizes: list[int] | None = None,
) -> Outcome:
    """What ``torch._scaled_grouped_mm`` does with a rowwise call on ``target``: the kernel, or torch's error.
    ``group_sizes``: the groups' sizes along the ragged dimension (the device-side checks), when known."""
    major = target.capability[0]
    if major not in (9, 10):
        return Outcome("none", "torch._scaled_grouped_mm is only supported on CUDA devices with compute capability "
                               "= [9.0, 10.0], or ROCm MI300+")
    reason = grouped_layout_reason(mat_a, mat_b, offs)
    if reason:
        return Outcome("none", reason)
    a2, b2 = len(mat_a.shape) == 2, len(mat_b.shape) == 2
    if not (scale_a.dtype == scale_b.dtype == torch.float32):
        return Outcome("none", "For FP8 tensorwise and rowwise, both scales must both be float32 tensors. For MXFP8, "
                               "scales must both be float8_e8m0fnu tensors.")
    multiplier = offs.shape[0] if a2 and b2 else 1
    reason = _scale_violation(0, mat_a, scale_a, 0, multiplier) or _scale_violation(1, mat_b, scale_b, 1, multiplier)
    if reason:
        return Outcome("none", reason)
    if (out_dtype or torch.bfloat16) != torch.bfloat16:
        return Outcome("none", "Only bf16 high precision output types are supported for grouped gemm")
    for name, mat in (("mat_a", mat_a), ("mat_b", mat_b)):
        if mat.dtype != torch.float8_e4m3fn:
            return Outcome(GROUPED_KERNEL, f"Expected {name} to be Float8_e4m3 matrix got {c10_name(mat.dtype)}")
    groups = offs.shape[0] if offs is not None else mat_a.shape[0]
    if groups >= 1024:
        return Outcome(GROUPED_KERNEL, "Can't process more than 1024 groups")
    if major == 10 and target.torch < ROWWISE_GROUPED_SM100_TORCH:
        return Outcome(GROUPED_KERNEL, "the rowwise grouped kernel is built for sm_90 only in this torch (sm_100 "
                                       "support: PR #188063)")
    if a2 and b2 and group_sizes is not None:
        if any(size <= 0 for size in group_sizes):
            return Outcome(GROUPED_KERNEL, "device-side assert: expected offsets to be greater than 0")
        if any(size % 16 for size in group_sizes[:-1]):
            return Outcome(GROUPED_KERNEL, "device-side assert: expected input tensor dynamic dimension byte size to "
                                           "be non-negative multiple of 16")
    return Outcome(GROUPED_KERNEL)


def meta_error(mat_a, mat_b, scale_a, scale_b, offs, out_dtype=torch.bfloat16, use_fast_accum=False) -> str | None:
    """torch's meta function on the call (what ``torch.compile`` checks on fake tensors), on meta copies of the
    arguments with their shapes and strides; None when it accepts it."""

    def meta(t):
        return None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    try:
        torch._scaled_grouped_mm(meta(mat_a), meta(mat_b), meta(scale_a), meta(scale_b), offs=meta(offs),
                                 out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    except (RuntimeError, ValueError) as err:
        return str(err).splitlines()[0]
    return None
