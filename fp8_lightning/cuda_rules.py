"""torch's CUDA-side rules for block-scaled (1x128 / 128x128) FP8 GEMMs, ported as pure functions of shapes and
strides, and the choice of GEMM path that follows from them (:func:`blockwise_gemm_plan`).

No GPU is needed to run any of this: the rules are torch's C++ checks rewritten in Python, so that every GEMM the
library issues can be checked on a machine without one, and so that the path of each GEMM shape is decided by a pure
function (shapes, architecture, CUDA version, torch's API), never by an error in the middle of a training step.

The design in full: ``docs/design/notes.md``, section ``fp8_lightning.cuda_rules``.
"""

from __future__ import annotations

from typing import NamedTuple

from fp8_lightning.formats import BLOCKWISE_CAPABILITY_MAJOR
from fp8_lightning.quantize import LAYOUT_MULTIPLE

SCALE_BLOCK = 128  # ScaledBlas.cpp: the long edge of a 1x128 tile and of a 128x128 block
CUBLAS_SCALE_ROW_MULTIPLE = 4  # what cuBLASLt reads of 128x128 scale rows: padded to 4 floats (torch PR #166752)

BLOCKWISE_MAJOR = BLOCKWISE_CAPABILITY_MAJOR  # _check_deepseek_support: sm_90 only
BLOCKWISE_MIN_CUDA = (12, 9)  # _check_deepseek_support: cuBLASLt >= 12.9

V1, V2, EMULATE = "v1", "v2", "emulate"
ROW_TILE, WEIGHT_BLOCK = "1x128", "128x128"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


class Layout(NamedTuple):
    """The (shape, strides) of a 2-D tensor: all the rules below look at."""

    shape: tuple[int, int]
    stride: tuple[int, int]

    @classmethod
    def of(cls, t) -> "Layout":
        return cls(tuple(t.shape), tuple(t.stride()))


# --------------------------------------------------------------------------------------------------------
# v1: torch._scaled_mm (ScaledBlas.cpp)
# --------------------------------------------------------------------------------------------------------


def check_size_stride(scale: Layout, dim: int, size: int, stride: int) -> bool:
    """``check_size_stride``: dimension ``dim`` of ``scale`` has ``size`` elements and, unless ``size <= 1``,
    stride ``stride``."""
    return scale.shape[dim] == size and (size <= 1 or scale.stride[dim] == stride)


def is_blockwise_1x128_scaling(t_shape: tuple[int, int], scale: Layout) -> bool:
    """``is_blockwise_1x128_scaling`` for an FP8 operand ``t`` (rows, K) and float32 ``scale``."""
    rows, k = t_shape
    return (
        len(scale.shape) == 2
        and check_size_stride(scale, 0, rows, 1)
        and check_size_stride(scale, 1, _ceil_div(k, SCALE_BLOCK), rows)
    )


def is_blockwise_128x128_scaling(t_shape: tuple[int, int], scale: Layout) -> bool:
    """``is_blockwise_128x128_scaling``: row stride exactly ceil(K/128) (v1 refuses cuBLAS's padded layout)."""
    rows, k = t_shape
    k_tiles = _ceil_div(k, SCALE_BLOCK)
    return (
        len(scale.shape) == 2
        and check_size_stride(scale, 0, _ceil_div(rows, SCALE_BLOCK), k_tiles)
        and check_size_stride(scale, 1, k_tiles, 1)
    )


_V1_PAIRS = ((WEIGHT_BLOCK, ROW_TILE), (ROW_TILE, WEIGHT_BLOCK), (ROW_TILE, ROW_TILE))  # get_joint_scaling's order
_IS_SCALING = {ROW_TILE: is_blockwise_1x128_scaling, WEIGHT_BLOCK: is_blockwise_128x128_scaling}


def _transposed(layout: Layout) -> Layout:
    return Layout(layout.shape[::-1], layout.stride[::-1])


def v1_joint_scaling(mat1: Layout, mat2: Layout, scale_a: Layout, scale_b: Layout) -> tuple[str, str] | None:
    """``get_joint_scaling`` over the blockwise pairs: the (scale_a, scale_b) kinds v1 recognises, or None (torch
    raises "Invalid scaling configuration"). The right operand is checked as ``mat2.t()`` with ``scale_b.t()``."""
    b_t, scale_b_t = mat2.shape[::-1], _transposed(scale_b)
    for lhs, rhs in _V1_PAIRS:
        if _IS_SCALING[lhs](mat1.shape, scale_a) and _IS_SCALING[rhs](b_t, scale_b_t):
            return lhs, rhs
    return None


def device_violation(capability: tuple[int, int], cuda: tuple[int, int] | None) -> str | None:
    """``_check_deepseek_support``: why 1x128 / 128x128 GEMMs do not run on this device, or None."""
    major, minor = capability
    if major != BLOCKWISE_MAJOR:
        return (
            f"compute capability {major}.{minor} has no 1x128/128x128 block-scaled GEMM (torch and cuBLAS run them "
            f"on compute capability {BLOCKWISE_MAJOR}.x, sm_90, only)"
        )
    if cuda is None or tuple(cuda) < BLOCKWISE_MIN_CUDA:
        have = "a torch without CUDA" if cuda is None else f"CUDA {cuda[0]}.{cuda[1]}"
        return f"{have} has no block-scaled GEMM (needs CUDA 12.9+)"  # cuBLASLt 12.9
    return None


def v1_violation(
    capability: tuple[int, int], cuda: tuple[int, int] | None, mat1: Layout, mat2: Layout, scale_a: Layout,
    scale_b: Layout,
) -> str | None:
    """Why v1 ``torch._scaled_mm`` refuses this blockwise call on CUDA (torch's message, shortened), or None. Only
    the rules that concern block scaling: device, the joint scaling and the multiples of 16."""
    reason = device_violation(capability, cuda)
    if reason is not None:
        return reason
    if v1_joint_scaling(mat1, mat2, scale_a, scale_b) is None:
        return (
            f"Invalid scaling configuration: scale_a {scale_a.shape} strides {scale_a.stride}, scale_b "
            f"{scale_b.shape} strides {scale_b.stride} for mat1 {mat1.shape} and mat2 {mat2.shape} (a 128x128 scale "
            "must have the row stride ceil(K/128) exactly; a 1x128 scale must be outer-dim-major)"
        )
    if mat1.shape[1] % LAYOUT_MULTIPLE or mat2.shape[0] % LAYOUT_MULTIPLE or mat2.shape[1] % LAYOUT_MULTIPLE:
        return f"mat1 {mat1.shape} and mat2 {mat2.shape} must have K and N divisible by 16"
    return None


def cublas_misreads_128x128(t_shape: tuple[int, int], scale: Layout) -> bool:
    """Whether cuBLASLt, which reads a 128x128 scale with row stride L4 = round_up(ceil(K/128), 4), reads ``scale``
    (the scale of ``t`` (rows, K), stored K-blocks last) at other places than where its values are (torch PR
    #166752). One row of blocks has no row stride to get wrong."""
    rows, k = t_shape
    padded_stride = round_up(_ceil_div(k, SCALE_BLOCK), CUBLAS_SCALE_ROW_MULTIPLE)
    return _ceil_div(rows, SCALE_BLOCK) > 1 and scale.stride[0] != padded_stride


# --------------------------------------------------------------------------------------------------------
# v2: torch.nn.functional.scaled_mm (ScaledBlas.cpp, kernel side, and _meta_registrations.py)
# --------------------------------------------------------------------------------------------------------


def _v2_scale_ok(kind: str, rows: int, k: int, scale: Layout, floor: bool) -> bool:
    """One operand's scale against the v2 rules: 1x128 (rows, K/128) strides (1, rows); 128x128 (L4, rows/128)
    strides (1, L4). ``floor``: the meta function's ``//`` where the kernel has _ceil_div."""
    div = (lambda a: a // SCALE_BLOCK) if floor else (lambda a: _ceil_div(a, SCALE_BLOCK))
    (s0, s1), (t0, t1) = scale.shape, scale.stride
    if kind == ROW_TILE:
        return s0 == rows and s1 == div(k) and t0 == 1 and (t1 == rows or (s1 == 1 and t1 == 1))
    l4 = round_up(_ceil_div(k, SCALE_BLOCK), CUBLAS_SCALE_ROW_MULTIPLE)
    return s0 == l4 and s1 == div(rows) and t0 == 1 and (t1 == l4 or (s1 == 1 and t1 == 1))


def v2_violation(
    capability: tuple[int, int], cuda: tuple[int, int] | None, mat_a: Layout, mat_b: Layout, kind_a: str,
    scale_a: Layout, kind_b: str, scale_b: Layout, meta: bool = True,
) -> str | None:
    """Why v2 ``scaled_mm`` refuses this blockwise call, or None: the device gate, the kernel's layout rules
    (``_scaled_block*``) and, with ``meta``, the meta function's (what ``torch.compile`` checks on fake tensors)."""
    reason = device_violation(capability, cuda)
    if reason is not None:
        return reason
    if (kind_a, kind_b) not in _V1_PAIRS:
        return f"the pair ({kind_a}, {kind_b}) is not a blockwise recipe; allowed: {', '.join(map(str, _V1_PAIRS))}"
    (m, k), n = mat_a.shape, mat_b.shape[1]
    for floor in (False, True) if meta else (False,):
        if not (_v2_scale_ok(kind_a, m, k, scale_a, floor) and _v2_scale_ok(kind_b, n, k, scale_b, floor)):
            where = "meta function (K // 128)" if floor else "kernel"
            return (
                f"v2 {kind_a} x {kind_b} refused by the {where}: scale_a {scale_a.shape} strides {scale_a.stride}, "
                f"scale_b {scale_b.shape} strides {scale_b.stride} for mat_a {mat_a.shape}, mat_b {mat_b.shape}"
            )
    if k % LAYOUT_MULTIPLE or n % LAYOUT_MULTIPLE:
        return f"mat_a {mat_a.shape} and mat_b {mat_b.shape} must have K and N divisible by 16"
    return None


# --------------------------------------------------------------------------------------------------------
# Rowwise: which output dtypes torch's rowwise GEMM writes itself
# --------------------------------------------------------------------------------------------------------

ROWWISE_CUBLAS_MAJOR = 9  # cuBLASLt's outer-vector (rowwise) scales: compute capability 9.x ...
ROWWISE_CUBLAS_MIN_CUDA = (12, 9)  # ... with cuBLAS 12.9+; elsewhere torch runs CUTLASS's f8f8bf16_rowwise


def rowwise_direct_output(capability: tuple[int, int], cuda: tuple[int, int] | None, out_dtype) -> bool:
    """Whether ``torch._scaled_mm`` with rowwise scales writes ``out_dtype`` itself, correctly, in every torch the
    library supports (2.11 on). ScaledBlas.cpp ``_scaled_mm_out_cuda``: rowwise GEMMs run cuBLASLt on compute
    capability 9.x with cuBLAS >= 12.9, which writes bf16, fp16 and fp32; elsewhere they run CUTLASS
    (``f8f8bf16_rowwise``), which in torch 2.11 takes bf16 and fp16 only ("Only bf16 and fp16 high precision output
    types are supported for row-wise scaling.") and, without a bias, writes bf16 whatever the output dtype (fp16
    and fp32 became right with torch PR #187569, after 2.11). So: bf16 everywhere; fp16 and fp32 on the cuBLASLt
    path only."""
    name = str(out_dtype).rpartition(".")[2]
    if name == "bfloat16":
        return True
    on_cublas = capability[0] == ROWWISE_CUBLAS_MAJOR and cuda is not None and tuple(cuda) >= ROWWISE_CUBLAS_MIN_CUDA
    return on_cublas and name in ("float16", "float32")


# --------------------------------------------------------------------------------------------------------
# The plan: which path each GEMM shape takes
# --------------------------------------------------------------------------------------------------------


def blockwise_gemm_plan(
    m: int, k: int, n: int, capability: tuple[int, int], has_v2: bool, cuda: tuple[int, int] | None = (12, 9),
    block_operand: str | None = "b", e4m3: bool = True,
) -> tuple[str, str]:
    """``(path, reason)`` for ``out = a @ b.T`` with ``a`` (m, k) and ``b`` (n, k), block scales on
    ``block_operand`` ("b": the weight in fprop and dgrad, "a", or None: both 1x128, as in wgrad):

    * ``"emulate"`` off sm_90 or below CUDA 12.9 (``_check_deepseek_support`` would raise);
    * ``"v1"`` for two 1x128 operands: v1 takes them for every shape, and their layout has no padding to get wrong;
    * ``"v2"`` (``torch.nn.functional.scaled_mm`` with cuBLAS's padded layout) where torch has it, both operands
      are E4M3 (``e4m3``; ScaledBlasUtils.cpp ``check_deepseek_recipe`` takes no other FP8 format), and K and the
      128x128 operand's rows, padded to 16 as passed, are multiples of 128 (the only shapes its meta function and its
      kernel agree on);
    * ``"v1"`` where the padded 128x128 layout is also the exact one v1 demands, so that v1 accepts it and cuBLAS reads
      it right: ceil(k/128) % 4 == 0, or a single row of blocks (ceil(rows/128) == 1);
    * ``"emulate"`` otherwise: v1 either refuses the padded layout or computes wrong results on the exact one.

    A pure function of its arguments: the same shape always takes the same path."""
    reason = device_violation(capability, cuda)
    if reason is not None:
        return EMULATE, reason
    if block_operand is None:
        return V1, "1x128 x 1x128: torch._scaled_mm takes every shape in the outer-dim-major layout cuBLAS reads"
    if block_operand not in ("a", "b"):
        raise ValueError(f"block_operand={block_operand!r} is invalid; allowed: 'a', 'b' or None (both 1x128).")
    rows = n if block_operand == "b" else m
    rows_passed = round_up(rows, LAYOUT_MULTIPLE) if block_operand == "b" else rows  # mat2's N is padded, mat1's M not
    k_passed, k_tiles = round_up(k, LAYOUT_MULTIPLE), _ceil_div(k, SCALE_BLOCK)
    row_blocks = _ceil_div(rows, SCALE_BLOCK)
    shape = f"the 128x128-scaled operand ({rows} x {k}: {row_blocks} x {k_tiles} blocks)"
    if has_v2 and e4m3 and k_passed % SCALE_BLOCK == 0 and rows_passed % SCALE_BLOCK == 0:
        return V2, f"{shape}: torch.nn.functional.scaled_mm with the padded layout cuBLAS reads"
    if k_tiles % CUBLAS_SCALE_ROW_MULTIPLE == 0 or row_blocks == 1:
        return V1, f"{shape}: its padded layout is the exact one torch._scaled_mm (v1) demands"
    if not has_v2:
        v2_note = "this torch has no torch.nn.functional.scaled_mm (v2), which takes the padded layout"
    elif not e4m3:
        v2_note = "torch.nn.functional.scaled_mm (v2), which takes the padded layout, multiplies E4M3 operands only"
    else:
        v2_note = (
            "torch.nn.functional.scaled_mm (v2), which takes the padded layout, checks K // 128 and rows // 128 in its "
            "meta function, so it is used only where K and the rows are multiples of 128"
        )
    return EMULATE, (
        f"{shape}: ceil(K/128) = {k_tiles} is not a multiple of 4 and there is more than one row of blocks, so "
        f"torch._scaled_mm (v1) refuses cuBLAS's padded layout and computes wrong results on the unpadded one "
        f"(torch PR #166752); {v2_note}"
    )
