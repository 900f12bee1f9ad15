"""torch 2.11's CUDA rules for MXFP8 grouped GEMMs (``torch._scaled_grouped_mm`` with e8m0 scales, and
``torch.nn.functional.scaled_grouped_mm`` with ``ScalingType.BlockWise1x32``) as pure functions with torch's wording.

Sources: ``GroupedBlas.cpp`` (pytorch/pytorch 00d4eaf9 and a later copy with MSLK naming; their MXFP8 paths match the
strings of the torch 2.11.0+cu130 wheel, git 70d99e99): ``_scaled_grouped_mm_cuda`` / ``_cuda_v2``,
``_check_scales_blocked``, ``_mx8_mx8_bf16_grouped_mm_mslk``; ``check_mxfp8_recipe`` (``ScaledBlasUtils.cpp``);
MSLK's ``mx8mx8bf16_grouped_mm`` (host checks) and ``set_grouped_gemm_args_kernel`` (device asserts, per-group scale
offsets; meta-pytorch/MSLK 5f29f688 and eaba100a, whose assert texts are in the wheel's sm_100a cubins). The wheel
builds the kernel (CUTLASS ``SM100_MMA_MXF8F6F4``) for sm_100a and sm_103a only, with ``USE_MSLK``; a build without
it raises ``mxfp8_mxfp8 grouped gemm requires compile with USE_MSLK`` (``USE_FBGEMM_GENAI`` in older copies).
"""

from __future__ import annotations

import torch

from fp8_lightning.cuda_contract.rules import E8M0, Facts, Outcome, Target, c10_name
from fp8_lightning.cuda_contract.rules_grouped import grouped_layout_reason

MX_GROUPED_KERNEL = "MSLK mx8mx8bf16_grouped_mm (sm_100a)"
DEVICE_MESSAGE = ("torch._scaled_grouped_mm is only supported on CUDA devices with compute capability = [9.0, 10.0], "
                  "or ROCm MI300+")


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def _blocked_violation(arg: int, mat: Facts, scale: Facts) -> str | None:
    """``_check_scales_blocked`` for MXFP8 (block 32) and the meta function's contiguity check."""
    if len(mat.shape) == 2:
        if len(scale.shape) != 2:
            return (f"for block-scaled, scale must have same number of dimensions as parent tensor, but got mat.dim() "
                    f"= 2 and scale.dim() = {len(scale.shape)} for arg {arg}")
        need = mat.shape[0 if arg == 0 else 1]
        if scale.shape[0] < need:
            return f"for block-scaled, arg {arg} must have scale.shape[0] >= {need} but got scale.shape={scale.shape}"
        return None if scale.is_contiguous() else f"Expected scale_{'ab'[arg]} to be contiguous."
    groups, k, n = mat.shape
    want = _round_up(k // 32, 4) * _round_up(n, 128)
    if len(scale.shape) != 2 or scale.shape[0] != groups or scale.shape[1] != want:
        return (f"for block-scaled grouped GEMM, the tensor shape ({groups}, {k}, {n}) must have scale shape "
                f"({groups},{_round_up(k // 32, 4)},{_round_up(n, 128)}) for arg {arg}, got: {scale.shape}")
    return None


def _v2_recipe_violation(mat_a: Facts, mat_b: Facts, scales: tuple, recipes: tuple, swizzles: tuple) -> str | None:
    """``check_mxfp8_recipe`` and the v2 swizzle checks: one e8m0 scale, ``BlockWise1x32``, one ``SWIZZLE_32_4_4``."""
    names = [[getattr(r, "name", str(r)).rpartition(".")[2] for r in rs] for rs in recipes]
    accepted = (mat_a.dtype == mat_b.dtype == torch.float8_e4m3fn and all(len(s) == 1 for s in scales)
                and names[0] == names[1] == ["BlockWise1x32"] and all(s[0].dtype == E8M0 for s in scales))
    if not accepted:
        return "No gemm implementation was found"
    if not all(len(s) == 1 for s in swizzles):
        return "Expected single swizzle argument"
    if not all("SWIZZLE_32_4_4" in str(s[0]) for s in swizzles):
        return "For CUDA MXFP8 grouped gemm, both scale swizzle types must be SWIZZLE_32_4_4"
    return None


def _group_violation(mat_a: Facts, mat_b: Facts, scale_a: Facts, sizes: list[int]) -> str | None:
    """The device-side asserts of ``set_grouped_gemm_args_kernel`` and the scale extents it reads."""
    if len(mat_b.shape) == 2:  # groups along K
        if any(s < 0 or s % 32 for s in sizes):
            return ("device-side assert: for 2d-2d grouped gemm, group sizes along K dim must be non-negative "
                    "multiple of 32 (mxfp8) or 16 (nvfp4)")
        if sum(sizes) > mat_a.shape[1]:
            return "device-side assert: for 2d-2d grouped gemm, group end offsets must be non-negative and must be <= K"
        if sum(_round_up(s // 32, 4) for s in sizes) * _round_up(mat_a.shape[0], 128) > scale_a.numel():
            return ("device-side assert: for 2d-2d grouped gemm, sum of scale group sizes along K dim, each padded to "
                    "nearest multiple of 4, must be <= x_scale_size")
        if 0 in sizes:
            return "an empty 2d-2d group's output is never written (the kernel skips it; the output is at::empty)"
        return None
    if sum(sizes) > mat_a.shape[0]:
        return "device-side assert: for 2d-3d grouped gemm, group end offsets must be non-negative and must be <= M"
    if sum(_round_up(s, 128) for s in sizes) * _round_up(mat_a.shape[1] // 32, 4) > scale_a.numel():
        return "scale_a is smaller than the groups' padded blocks: the kernel reads past its end"
    return None


def mx_scaled_grouped_mm(
    target: Target, mat_a: Facts, mat_b: Facts, scale_a: Facts, scale_b: Facts, offs: Facts | None,
    out_dtype: torch.dtype | None = torch.bfloat16, group_sizes: list[int] | None = None, v2: tuple | None = None,
) -> Outcome:
    """What torch 2.11 does with an MXFP8 grouped call on ``target``: the kernel, or the error that stops it.
    ``group_sizes``: the groups along the ragged dimension (device-side checks), when known; ``v2``: the
    ``(recipes_a, recipes_b, swizzles_a, swizzles_b)`` of a ``scaled_grouped_mm`` call (None: the v1 call)."""
    if target.capability[0] not in (9, 10):
        return Outcome("none", DEVICE_MESSAGE)
    reason = grouped_layout_reason(mat_a, mat_b, offs)
    if reason:
        return Outcome("none", reason)
    a2 = len(mat_a.shape) == 2
    if v2 is None and not (scale_a.dtype == scale_b.dtype == E8M0):
        return Outcome("none", "For FP8 tensorwise and rowwise, both scales must both be float32 tensors. For MXFP8, "
                               "scales must both be float8_e8m0fnu tensors.")
    if (out_dtype or torch.bfloat16) != torch.bfloat16:
        return Outcome("none", "Only bf16 high precision output types are supported for grouped gemm")
    if v2 is not None:
        reason = _v2_recipe_violation(mat_a, mat_b, ([scale_a], [scale_b]), v2[:2], v2[2:])
        if reason:
            return Outcome("none", reason)
    reason = _blocked_violation(0, mat_a, scale_a) or _blocked_violation(1, mat_b, scale_b)
    if reason:
        return Outcome("none", reason)
    if v2 is None and not (mat_a.dtype == mat_b.dtype == torch.float8_e4m3fn):  # the rowwise path takes the call
        return Outcome("CUTLASS rowwise grouped GEMM", "For grouped FP8 rowwise, both scales must be float32 tensors")
    if not a2:
        return Outcome(MX_GROUPED_KERNEL, "MXFP8 grouped GEMM currently only supports 2d-2d and 2d-3d cases")
    return _kernel_outcome(target, mat_a, mat_b, scale_a, scale_b, offs, group_sizes)


def _kernel_outcome(target, mat_a, mat_b, scale_a, scale_b, offs, group_sizes) -> Outcome:
    """MSLK's host checks, the built architectures and the device-side asserts."""
    kernel = MX_GROUPED_KERNEL
    if not mat_a.is_contiguous():
        return Outcome(kernel, "XQ must be row major.")
    if not mat_b.t().is_contiguous() if len(mat_b.shape) == 2 else not _batched_t_contiguous(mat_b):
        return Outcome(kernel, "WQ must be column major.")
    if not scale_a.is_contiguous() or not scale_b.is_contiguous():
        return Outcome(kernel, f"{'x' if not scale_a.is_contiguous() else 'w'}_scale must be contiguous.")
    groups = offs.shape[0]
    if len(mat_b.shape) == 3 and mat_b.shape[0] != groups:
        return Outcome(kernel, "for 2d-3d grouped GEMM, XQ shape must be (total_M, K) and WQ shape must be (G, K, N).")
    if groups > 1024:
        return Outcome(kernel, f"{groups} groups: set_grouped_gemm_args_kernel<<<1, G>>> launches one thread per group "
                               "in one block (at most 1024)")
    if target.capability[0] != 10:
        return Outcome(kernel, f"{target.arch}: the MXFP8 grouped kernel is built for sm_100a / sm_103a only (no "
                               "kernel image for this device)")
    if not target.cuda_at_least((12, 8)):
        return Outcome(kernel, "CUDA version is older than 12.8")
    if group_sizes is not None:
        reason = _group_violation(mat_a, mat_b, scale_a, group_sizes)
        if reason:
            return Outcome(kernel, reason)
    return Outcome(kernel, None, f"c10 {c10_name(mat_a.dtype)} x {c10_name(mat_b.dtype)} -> BFloat16")


def _batched_t_contiguous(mat: Facts) -> bool:
    """``WQ.transpose(-2, -1).is_contiguous()`` of a 3-D ``WQ``."""
    shape, stride = mat.shape, mat.stride
    return Facts((shape[0], shape[2], shape[1]), (stride[0], stride[2], stride[1]), mat.dtype).is_contiguous()
