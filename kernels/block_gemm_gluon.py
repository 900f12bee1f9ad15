"""The Hopper MX GEMM in Gluon, whose wgmma runs while the previous block's product is scaled (opt-in, sm_90 only).

Same operands, same result as :mod:`~fp8_lightning.kernels.block_gemm` (``out = a @ b.T`` for MX operands: FP8
``a`` (M, K) and ``b`` (N, K), E8M0 scales (M, K / bs) and (N, K / bs)), computed the same way: one K step per
scale block, each block's FP8 product accumulated in float32 by the tensor cores, then folded into the running
float32 accumulator as ``acc += (p * sa[:, None]) * sb[None, :]`` (row scale, then column scale; E8M0 decoded by
the same bit pattern, byte 0 as 2**-127 and 255 as NaN), blocks in increasing K order.

Why a second kernel: the shipped kernel is written in ``triton.language``, whose Hopper pipeliner waits for every
wgmma (``wgmma.wait_group 0``) before the scale math that reads its product, so the tensor cores idle while the
CUDA cores scale (``benchmarks/results/mx-gemm-overlap-20261124.md``). Gluon, Triton's lower-level dialect, says
where to wait: block k's wgmma is issued asynchronously, ``warpgroup_mma_wait(1)`` then waits only for block
k-1's, and block k-1 is scaled and added while block k's is in flight. Operand tiles arrive by TMA
(``cp.async.bulk.tensor``) into two shared-memory stages, each with its mbarrier: block k's tiles are loaded while
block k-1's wgmma runs, into the stage block k-2 used (its wgmma was waited for in the previous iteration).

The design in full: ``docs/design/notes.md``, section ``kernels.block_gemm_gluon``.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from fp8_lightning.kernels.descriptors import descriptor_ready

# (BLOCK_M, BLOCK_N, num_warps), largest first: each warp owns 16 rows (a warpgroup issues a 64-row wgmma).
GLUON_TILES = ((128, 128, 8), (64, 128, 4), (128, 64, 8), (64, 64, 4))
# The largest block size (K step) each tile takes: 128-wide tiles at block 128 spill 16 bytes under Triton 3.6
# (the GPU image's; not under 3.9), benchmarks/results/aot-compile-gluon-mx-gemm-*.md.
MAX_BLOCK_K = {(128, 128, 8): 64, (64, 128, 4): 64, (128, 64, 8): 128, (64, 64, 4): 128}
GROUP_M = 8  # rows of tiles swept before moving to the next columns (operand reuse in L2), as the shipped kernel
_GL_DTYPES = {torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5}
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # renamed after Triton 3.6


def tiles_for_block(block_k: int) -> tuple[tuple[int, int, int], ...]:
    """The tiles compiled (and selectable) for block size ``block_k``."""
    return tuple(tile for tile in GLUON_TILES if block_k <= MAX_BLOCK_K[tile])


def tile_for(m: int, n: int, block_k: int) -> tuple[int, int, int]:
    """The (BLOCK_M, BLOCK_N, num_warps) of an (m, n) output at ``block_k``: the largest tile the output fills."""
    tiles = tiles_for_block(block_k)
    return next((t for t in tiles if m >= t[0] and n >= t[1]), tiles[-1])


def shared_layout(rows: int, block_k: int, dtype: torch.dtype):
    """The swizzled shared-memory layout of an FP8 (rows, block_k) operand tile, as TMA writes it and wgmma reads."""
    return gl.NVMMASharedLayout.get_default_for([rows, block_k], _GL_DTYPES[dtype])


@gluon.jit
def _e8m0_to_float(byte):
    """E8M0 byte -> float32 power of two, bit for bit as ``block_gemm._e8m0_to_float``."""
    b = byte.to(gl.int32)
    bits = gl.where(b == 0, 0x00400000, gl.where(b == 255, 0x7FC00000, b << 23))
    return bits.to(gl.float32, bitcast=True)


@gluon.jit
def _fold(acc, p, a_scale_ptr, b_scale_ptr, rows, cols, kb, M, N, stride_asm, stride_bsn):
    """``acc + (p * sa[:, None]) * sb[None, :]`` with block ``kb``'s scales (rows past M / N wrapped: they only
    meet zero operand rows, and the store masks them out)."""
    sa = _e8m0_to_float(gl.load(a_scale_ptr + (rows % M) * stride_asm + kb))
    sb = _e8m0_to_float(gl.load(b_scale_ptr + (cols % N) * stride_bsn + kb))
    return acc + (p * sa[:, None]) * sb[None, :]


@gluon.jit
def _load_block(a_desc, b_desc, a_smem, b_smem, bars, off_m, off_n, kb, BLOCK_K: gl.constexpr):
    """TMA-load block ``kb``'s operand tiles into stage ``kb % 2`` and wait for them to land."""
    s = kb % 2
    mbarrier.expect(bars.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    _tma_load(a_desc, [off_m, kb * BLOCK_K], bars.index(s), a_smem.index(s))
    _tma_load(b_desc, [off_n, kb * BLOCK_K], bars.index(s), b_smem.index(s))
    mbarrier.wait(bars.index(s), (kb // 2) & 1)


@gluon.jit
def _gluon_mx_gemm_kernel(
    a_desc, a_scale_ptr, b_desc, b_scale_ptr, c_ptr, M, N, K, stride_asm, stride_bsn, stride_cm,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    num_warps: gl.constexpr,
):
    # Grouped program order, as the shipped kernel.
    pid = gl.program_id(0)
    grid_n = (N + BLOCK_N - 1) // BLOCK_N
    group_size = GROUP_M * grid_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = gl.minimum((M + BLOCK_M - 1) // BLOCK_M - first_m, GROUP_M)
    off_m = (first_m + (pid % group_size) % rows_in_group) * BLOCK_M
    off_n = ((pid % group_size) // rows_in_group) * BLOCK_N

    # The wgmma accumulator's register layout: 16 rows per warp, K 32 per FP8 wgmma instruction.
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_N, 32])  # fmt: skip
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [2, BLOCK_M, BLOCK_K], a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [2, BLOCK_N, BLOCK_K], b_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(0), count=1)
    mbarrier.init(bars.index(1), count=1)
    rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))
    cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, layout=mma)
    blocks = K // BLOCK_K

    _load_block(a_desc, b_desc, a_smem, b_smem, bars, off_m, off_n, 0, BLOCK_K)
    p = warpgroup_mma(a_smem.index(0), b_smem.index(0).permute((1, 0)), acc, use_acc=False, is_async=True)
    for kb in range(1, blocks):
        _load_block(a_desc, b_desc, a_smem, b_smem, bars, off_m, off_n, kb, BLOCK_K)
        s = kb % 2
        p_next = warpgroup_mma(a_smem.index(s), b_smem.index(s).permute((1, 0)), acc, use_acc=False, is_async=True)
        p = warpgroup_mma_wait(1, deps=(p,))  # block kb-1's product; block kb's stays in flight
        acc = _fold(acc, p, a_scale_ptr, b_scale_ptr, rows, cols, kb - 1, M, N, stride_asm, stride_bsn)
        p = p_next
    p = warpgroup_mma_wait(0, deps=(p,))
    acc = _fold(acc, p, a_scale_ptr, b_scale_ptr, rows, cols, blocks - 1, M, N, stride_asm, stride_bsn)
    mbarrier.invalidate(bars.index(0))
    mbarrier.invalidate(bars.index(1))

    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offsets = rows.to(gl.int64)[:, None] * stride_cm + cols.to(gl.int64)[None, :]
    gl.store(c_ptr + offsets, acc.to(c_ptr.dtype.element_ty), mask=mask)


def refusal(a_scale: torch.Tensor, b_scale: torch.Tensor) -> str | None:
    """Why the Gluon kernel does not take these scales (None: it does); the shipped kernel takes them instead.

    The kernel indexes scales with 32-bit offsets (64-bit ones cost the 128x128 tile its last registers: it spills)
    and reads them K-contiguous."""
    if a_scale.stride(-1) != 1 or b_scale.stride(-1) != 1:
        return f"it reads K-contiguous scales; got strides {a_scale.stride()} and {b_scale.stride()}"
    if max(a_scale.numel(), b_scale.numel()) >= 2**31:
        return f"it indexes scales with 32-bit offsets; got {max(a_scale.numel(), b_scale.numel())} scales"
    return None


def gluon_mx_gemm(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype,
    tile: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """``a @ b.T`` for validated MX operands (scales as K-contiguous uint8), on the Gluon kernel. ``tile``: one of
    :func:`tiles_for_block` (else :func:`tile_for`)."""
    m, k = a.shape
    n = b.shape[0]
    reason = refusal(a_scale, b_scale)
    if reason:
        raise ValueError(f"the Gluon MX GEMM cannot take these operands: {reason}. Use block_gemm.mx_gemm.")
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    block_k = k // a_scale.shape[1]
    if tile is not None and tuple(tile) not in tiles_for_block(block_k):
        raise ValueError(
            f"tile={tile} is not one of the tiles compiled for block size {block_k}: {tiles_for_block(block_k)} "
            "(BLOCK_M, BLOCK_N, num_warps)."
        )
    block_m, block_n, warps = tile or tile_for(m, n, block_k)
    a, b = descriptor_ready(a), descriptor_ready(b)
    a_desc = TensorDescriptor(a, [m, k], [a.stride(0), 1], [block_m, block_k], shared_layout(block_m, block_k, a.dtype))
    b_desc = TensorDescriptor(b, [n, k], [b.stride(0), 1], [block_n, block_k], shared_layout(block_n, block_k, b.dtype))
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _gluon_mx_gemm_kernel[grid](
        a_desc, a_scale, b_desc, b_scale, out, m, n, k, a_scale.stride(0), b_scale.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=GROUP_M, num_warps=warps,
    )
    return out
