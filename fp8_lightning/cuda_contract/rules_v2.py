"""torch's CUDA rules for ``torch.nn.functional.scaled_mm`` (v2, ``_scaled_mm_cuda_v2_out`` in ScaledBlas.cpp), as
pure functions, with torch's wording.

Order of the checks (main at commit 0174dfab; the blockwise kernels' rules are the same in the 2.11-era copy):
``scaled_mm_arch_allowed``; K and N multiples of 16; float8 operands, not both e5m2; the bias rules (shared with
v1); ``find_scaled_gemm_impl`` over ScaledBlasUtils.cpp's acceptance functions (``check_tensorwise_recipe``,
``check_rowwise_recipe``, ``check_deepseek_recipe``: both operands ``Float8_e4m3fn``, one float32 scale each,
``check_mxfp8_recipe``: both ``Float8_e4m3fn``, e8m0 scales); then the chosen kernel's own checks:
``_scaled_block1x128_block128x128`` / ``_scaled_block128x128_block1x128`` / ``_scaled_block1x128_block1x128``
(``_check_deepseek_support``, scale shapes (M, ceil(K/128)) strides (1, M) for 1x128 and (L4, ceil(rows/128))
strides (1, L4) for 128x128, L4 = round_up(ceil(K/128), 4)), ``_scaled_mxfp8_mxfp8`` (element counts, SWIZZLE_32_4_4,
contiguous scales) and ``_scaled_rowwise_rowwise`` (as v1).

``torch/_meta_registrations.py`` ``_check_scaled_mm_sizes_v2`` (2.11 and 2.13, what ``torch.compile`` checks on fake
tensors) divides with ``//`` where the kernel takes ceil: :func:`fp8_lightning.cuda_rules.v2_violation` ports it.
"""

from __future__ import annotations

import torch

from fp8_lightning import cuda_rules
from fp8_lightning.cuda_contract.rules import (
    BLOCK_128X128,
    BLOCK_1X128,
    BLOCK_1X32,
    E8M0,
    FLOAT8,
    MX_MIN_CAPABILITY,
    MX_MIN_CUDA,
    ROWWISE,
    TENSORWISE,
    Facts,
    Outcome,
    Target,
    alignment_violation,
    bias_violation,
    deepseek_violation,
    major_violation,
    operand_violation,
    rowwise_outcome,
)

SCALING_NAMES = {
    "TensorWise": TENSORWISE, "RowWise": ROWWISE, "BlockWise1x128": BLOCK_1X128, "BlockWise128x128": BLOCK_128X128,
    "BlockWise1x32": BLOCK_1X32,
}
DEEPSEEK_PAIRS = ((BLOCK_1X128, BLOCK_128X128), (BLOCK_128X128, BLOCK_1X128), (BLOCK_1X128, BLOCK_1X128))


def scaling_name(scaling_type) -> str:
    """The rules' name of a ``torch.nn.functional.ScalingType`` (or of its name)."""
    name = getattr(scaling_type, "name", str(scaling_type)).rpartition(".")[2]
    return SCALING_NAMES.get(name, name)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _l4(k: int) -> int:
    return -(-_ceil_div(k, 128) // 4) * 4


def _block_scale_violation(name: str, kind: str, rows: int, k: int, scale: Facts) -> str | None:
    """One operand's scale in ``_scaled_block*``: ``name`` is scale_a or scale_b, ``rows`` M or N."""
    if kind == BLOCK_1X128:
        want, stride = (rows, _ceil_div(k, 128)), rows
    else:
        want, stride = (_l4(k), _ceil_div(rows, 128)), _l4(k)
    if tuple(scale.shape) != want or scale.dtype != torch.float32:
        return f"{name} must have shape {want[0]} x {want[1]} Float elements, got [{', '.join(map(str, scale.shape))}]"
    if scale.stride[0] != 1 or not (scale.stride[1] == stride or (scale.shape[1] == 1 and scale.stride[1] == 1)):
        return f"{name} must have strides (1, {stride}); got [{', '.join(map(str, scale.stride))}]"
    return None


def _impl(mat_a: Facts, mat_b: Facts, kinds: tuple[str, str], scale_a: Facts, scale_b: Facts) -> str | None:
    """``find_scaled_gemm_impl``: the pair's implementation when its acceptance function takes the call."""
    fp8 = mat_a.dtype in FLOAT8 and mat_b.dtype in FLOAT8
    e4m3 = mat_a.dtype == mat_b.dtype == torch.float8_e4m3fn
    if kinds == (TENSORWISE, TENSORWISE) and fp8 and scale_a.dtype == scale_b.dtype == torch.float32:
        return "tensorwise"
    if kinds == (ROWWISE, ROWWISE) and fp8 and scale_a.dtype == scale_b.dtype == torch.float32:
        return "rowwise"
    if kinds in DEEPSEEK_PAIRS and e4m3 and scale_a.dtype == scale_b.dtype == torch.float32:
        return "deepseek"
    if kinds == (BLOCK_1X32, BLOCK_1X32) and e4m3 and scale_a.dtype == scale_b.dtype == E8M0:
        return "mxfp8"
    return None


def scaled_mm_v2(
    target: Target, mat_a: Facts, mat_b: Facts, scale_a: Facts, recipe_a, scale_b: Facts, recipe_b,
    swizzle_a=None, swizzle_b=None, bias: Facts | None = None, out_dtype: torch.dtype = torch.bfloat16,
    use_fast_accum: bool = False,
) -> Outcome:
    """What ``torch.nn.functional.scaled_mm`` does with one scale per operand on ``target``: the kernel, or torch's
    error (kernel side; the meta function's stricter blockwise rule is :func:`meta_violation`)."""
    names = ("mat1", "mat2")
    reason = operand_violation(target, mat_a, mat_b, names) or bias_violation(out_dtype, bias, mat_b.shape[1])
    if reason is not None:
        return Outcome("none", reason.replace("Expected mat1 to", "Expected mat_a to").replace(
            "Expected mat2 to", "Expected mat_b to"))
    kinds = (scaling_name(recipe_a), scaling_name(recipe_b))
    impl = _impl(mat_a, mat_b, kinds, scale_a, scale_b)
    if impl is None:
        return Outcome("none", f"Invalid scaling configuration. ... Got {kinds[0]} x {kinds[1]} for "
                               f"{mat_a.describe()} and {mat_b.describe()} (blockwise and MX: Float8_e4m3fn only)")
    misaligned = alignment_violation(mat_a, mat_b)
    if misaligned is not None:
        return Outcome(f"cuBLASLt ({kinds[0]} x {kinds[1]})", misaligned)
    (m, k), n = mat_a.shape, mat_b.shape[1]
    if impl == "deepseek":
        kernel = f"cuBLASLt {kinds[0]} x {kinds[1]}"
        reason = deepseek_violation(target)
        reason = reason or _block_scale_violation("scale_a", kinds[0], m, k, scale_a)
        reason = reason or _block_scale_violation("scale_b", kinds[1], n, k, scale_b)
        note = None if out_dtype == torch.bfloat16 else f"{out_dtype} output of a 1x128/128x128 GEMM: not run on a GPU"
        return Outcome(kernel, reason or major_violation(target, mat_a, mat_b), note)
    if impl == "mxfp8":
        kernel = "cuBLASLt MX (VEC32_UE8M0)"
        want_a = -(-m // 128) * 128 * (-(-_ceil_div(k, 32) // 4) * 4)
        want_b = -(-n // 128) * 128 * (-(-_ceil_div(k, 32) // 4) * 4)
        swizzled = "SWIZZLE_32_4_4"
        for name, want, got in (("scale_a", want_a, scale_a.numel()), ("scale_b", want_b, scale_b.numel())):
            if got != want:
                return Outcome(kernel, f"For Blockwise scaling {name} should have {want} elements, got: {got}")
        for name, swizzle in (("scale_a", swizzle_a), ("scale_b", swizzle_b)):
            if swizzled not in str(swizzle):
                return Outcome(kernel, f"{name} must be swizzled to SWIZZLE_32_4_4 format")
        if not (scale_a.is_contiguous() and scale_b.is_contiguous()):
            return Outcome(kernel, "For Blockwise scaling both scales should be contiguous")
        if target.capability < MX_MIN_CAPABILITY or not target.cuda_at_least(MX_MIN_CUDA):
            return Outcome(kernel, "cuBLASLt has no MX (1x32, e8m0) block scaling below compute capability 10.0 and "
                                   "CUDA 12.8")
        return Outcome(kernel)
    if impl == "rowwise":
        if scale_a.numel() != m:
            return Outcome("none", f"scale_a must have {m} Float elements, got {scale_a.numel()}")
        if scale_b.numel() != n:
            return Outcome("none", f"scale_b must have {n} Float elements, got {scale_b.numel()}")
        return rowwise_outcome(target, mat_b, bias, out_dtype)
    if scale_a.numel() != 1 or scale_b.numel() != 1:
        return Outcome("none", f"scale_{'a' if scale_a.numel() != 1 else 'b'} must have 1 Float element")
    return Outcome("cuBLASLt tensorwise", major_violation(target, mat_a, mat_b))


def meta_violation(target: Target, mat_a: Facts, mat_b: Facts, scale_a: Facts, recipe_a, scale_b: Facts,
                   recipe_b) -> str | None:
    """The meta function's blockwise rule (``K // 128``, what ``torch.compile`` checks), for 1x128 / 128x128 calls;
    None for other pairs and where it agrees with the kernel."""
    kinds = (scaling_name(recipe_a), scaling_name(recipe_b))
    if kinds not in DEEPSEEK_PAIRS:
        return None
    args = (target.capability, target.cuda, mat_a.layout(), mat_b.layout(), kinds[0], scale_a.layout(), kinds[1],
            scale_b.layout())
    if cuda_rules.v2_violation(*args, meta=False) is not None:
        return None  # the kernel's own rule already refuses it (reported with torch's words)
    return cuda_rules.v2_violation(*args, meta=True)
