"""Grouped FP8 GEMMs of mixtures of experts in Triton: one launch per GEMM, the groups read on the device.

Two shapes, following ``torch._grouped_mm``'s convention (``offs``: int32 cumulative group ends, never read on the
host, so no launch waits for the GPU):

* 2-D x 3-D (fprop, dgrad): ``out[rows of group e] = a[rows of e] @ b[e]``, ``a`` (M, K), ``b`` (E, K, N) with any
  strides, so a weight stored (E, N, K) or (E, K, N) is read where it lies, with no transposed copy;
* 2-D x 2-D -> 3-D (wgrad): ``out[e] = a[:, cols of e] @ b[cols of e, :]``, ``a`` (N, M), ``b`` (M, K): each
  expert's product over its own tokens, the reduction dimension ragged (an empty group gives zeros).

Scales are applied in float32 in the epilogue: ``acc * sa[row] * sb[col]``, where ``sa`` and ``sb`` are dequantization
multipliers addressed as ``scale[group * stride_group + index * stride_index]``. Rowwise operands pass a scale per row
of ``a`` and per (expert, column) of ``b``; per-tensor operands (tensorwise, delayed: one scale per expert) pass the
same vectors with an index stride of 0. The pure-torch twins: ``fp8_lightning.grouped.gemm.grouped_product`` on the
dequantized operands.

A 2-D x 3-D launch covers an upper bound of the tiles, ``cdiv(M, BLOCK_M) + E`` row tiles per column tile; each
program finds its group from a cumulative sum of every group's tile count (one vector of ``E`` entries) and programs
past the last tile return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8_lightning.kernels.block_gemm import m_bucket  # token counts that share one tuned tile

# A small fixed tile for the Triton interpreter (CPU), where autotuning has nothing to measure.
GROUPED_INTERPRETER_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_gemm_configs(capability: tuple[int, int] | None = None) -> list[triton.Config]:
    """The tiles the autotuner chooses from on a GPU of ``capability`` (None: every one): few, so that a new M
    bucket tunes quickly. Ada (sm89) has no wgmma: smaller tiles keep its mma.sync accumulators in registers."""
    shapes = [
        # BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, the GPUs that select it
        (128, 128, 128, 8, 3, "sm90+"),
        (128, 256, 64, 8, 3, "sm90+"),
        (64, 128, 128, 8, 3, "sm90+"),
        (64, 128, 64, 4, 3, "any"),
        (64, 64, 128, 4, 3, "sm89"),
    ]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps, num_stages=stages)
        for bm, bn, bk, warps, stages, gpus in shapes
        if capability is None or gpus == "any" or (gpus == "sm89") == (capability[0] == 8)
    ]


def _config_key(config: triton.Config) -> tuple:
    return tuple(sorted(config.kwargs.items())), config.num_warps, config.num_stages


def _prune_for_device(configs, named_args, **kwargs):
    """Autotune early prune: only the tiles :func:`grouped_gemm_configs` selects for the output's GPU."""
    capability = torch.cuda.get_device_capability(named_args["c_ptr"].device)
    allowed = {_config_key(c) for c in grouped_gemm_configs(capability)}
    return [config for config in configs if _config_key(config) in allowed]


@triton.jit
def _add(x, y):
    # The standard library's jit functions (tl.sum, tl.cumsum, tl.cdiv) are not interpreted when Triton was
    # imported before TRITON_INTERPRET was set, as in the tests: the kernels use their own
    return x + y


@triton.jit
def _total(x, axis):
    return tl.reduce(x, axis, _add)  # tl.sum's reduction, with a combine of this module (see _add)


@triton.jit
def _dot(a, b, acc, FAST_ACCUM: tl.constexpr, BLOCK_K: tl.constexpr):
    # Hopper's FP8 tensor cores add products in less than float32 precision. Triton's default on sm_90 keeps the
    # whole K loop in that accumulator (cuBLAS's fast accumulation); otherwise each tile step's product goes into
    # the float32 accumulator on the CUDA cores, as cuBLAS does without fast accumulation (every 128 of K).
    if FAST_ACCUM:
        return tl.dot(a, b, acc)
    else:
        return tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)


@triton.jit
def _grouped_mm_2d3d_kernel(
    a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, offs_ptr, M, N, K, M_BUCKET,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn, stride_sam, stride_sbe, stride_sbn,
    E: tl.constexpr, E_PAD: tl.constexpr, EVEN_K: tl.constexpr, FAST_ACCUM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Row tile slot pid0 (of cdiv(M, BLOCK_M) + E) and column tile pid1 of a 2-D x 3-D grouped product."""
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    groups = tl.arange(0, E_PAD)
    real = groups < E
    ends = tl.where(real, tl.load(offs_ptr + groups, mask=real, other=0), M)
    starts = tl.where(real, tl.load(offs_ptr + groups - 1, mask=real & (groups > 0), other=0), M)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    last = tl.associative_scan(tiles, 0, _add)  # tl.cumsum's scan, with a combine of this module
    group = _total((last <= slot).to(tl.int32), 0)
    if group >= E:
        return
    first = _total(tl.where(groups == group, last - tiles, 0), 0)
    start = _total(tl.where(groups == group, starts, 0), 0)
    end = _total(tl.where(groups == group, ends, 0), 0)
    row0 = start + (slot - first) * BLOCK_M
    col0 = pid_n * BLOCK_N
    # 64-bit scalar bases, 32-bit offsets inside the tile: pointer tensors of 64-bit offsets spill registers
    rs = tl.arange(0, BLOCK_M)
    cs = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    in_rows = rs < end - row0
    in_cols = cs < N - col0
    a_ptrs = a_ptr + row0.to(tl.int64) * stride_am + (rs[:, None] * stride_am + ks[None, :] * stride_ak)
    b_base = b_ptr + group.to(tl.int64) * stride_be + col0.to(tl.int64) * stride_bn
    b_ptrs = b_base + (ks[:, None] * stride_bk + cs[None, :] * stride_bn)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=in_rows[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=in_cols[None, :], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=in_rows[:, None] & (k + ks[None, :] < K), other=0.0)
            b = tl.load(b_ptrs, mask=(k + ks[:, None] < K) & in_cols[None, :], other=0.0)
        acc = _dot(a, b, acc, FAST_ACCUM, BLOCK_K)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    sa = tl.load(sa_ptr + row0.to(tl.int64) * stride_sam + rs * stride_sam, mask=in_rows, other=0.0)
    sb = tl.load(sb_ptr + group.to(tl.int64) * stride_sbe + (col0 + cs) * stride_sbn, mask=in_cols, other=0.0)
    out = (acc * sa[:, None]) * sb[None, :]
    c_ptrs = c_ptr + row0.to(tl.int64) * stride_cm + col0.to(tl.int64) * stride_cn + (
        rs[:, None] * stride_cm + cs[None, :] * stride_cn)
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=in_rows[:, None] & in_cols[None, :])


@triton.jit
def _grouped_mm_2d2d_kernel(
    a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, offs_ptr, N, K, M_BUCKET,
    stride_an, stride_am, stride_bm, stride_bk, stride_ce, stride_cn, stride_ck,
    stride_sae, stride_san, stride_sbe, stride_sbk, ALIGNED: tl.constexpr, FAST_ACCUM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Output tile pid0 of group pid1's (N, K) product ``a[:, group] @ b[group, :]``; here BLOCK_M tiles N, BLOCK_N
    tiles K and BLOCK_K steps along the group's ragged token range."""
    tiles_k = (K + BLOCK_N - 1) // BLOCK_N
    pid_n = tl.program_id(0) // tiles_k
    pid_k = tl.program_id(0) % tiles_k
    group = tl.program_id(1)
    start = tl.load(offs_ptr + group - 1, mask=group > 0, other=0)
    end = tl.load(offs_ptr + group)
    if ALIGNED:  # every group starts at a multiple of 16 tokens (the padded layout): 16-byte vector loads
        start = tl.multiple_of(start, 16)
    row0 = pid_n * BLOCK_M
    col0 = pid_k * BLOCK_N
    rs = tl.arange(0, BLOCK_M)
    cs = tl.arange(0, BLOCK_N)
    ms = tl.arange(0, BLOCK_K)
    in_rows = rs < N - row0
    in_cols = cs < K - col0
    a_ptrs = a_ptr + row0.to(tl.int64) * stride_an + start.to(tl.int64) * stride_am + (
        rs[:, None] * stride_an + ms[None, :] * stride_am)
    b_ptrs = b_ptr + start.to(tl.int64) * stride_bm + col0.to(tl.int64) * stride_bk + (
        ms[:, None] * stride_bm + cs[None, :] * stride_bk)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for m in range(start, end, BLOCK_K):
        in_group = ms < end - m
        a = tl.load(a_ptrs, mask=in_rows[:, None] & in_group[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=in_group[:, None] & in_cols[None, :], other=0.0)
        acc = _dot(a, b, acc, FAST_ACCUM, BLOCK_K)
        a_ptrs += BLOCK_K * stride_am
        b_ptrs += BLOCK_K * stride_bm
    sa = tl.load(sa_ptr + group.to(tl.int64) * stride_sae + (row0 + rs) * stride_san, mask=in_rows, other=0.0)
    sb = tl.load(sb_ptr + group.to(tl.int64) * stride_sbe + (col0 + cs) * stride_sbk, mask=in_cols, other=0.0)
    out = (acc * sa[:, None]) * sb[None, :]
    c_ptrs = c_ptr + group.to(tl.int64) * stride_ce + row0.to(tl.int64) * stride_cn + col0.to(tl.int64) * stride_ck + (
        rs[:, None] * stride_cn + cs[None, :] * stride_ck)
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=in_rows[:, None] & in_cols[None, :])


_AUTOTUNE = dict(configs=grouped_gemm_configs(), key=["M_BUCKET", "N", "K", "FAST_ACCUM"],
                 prune_configs_by={"early_config_prune": _prune_for_device})  # fmt: skip
_2d3d_autotuned = triton.autotune(**_AUTOTUNE)(_grouped_mm_2d3d_kernel)
_2d2d_autotuned = triton.autotune(**_AUTOTUNE)(_grouped_mm_2d2d_kernel)


def _launch(kernel, autotuned, grid, args, config, **constexprs):
    from fp8_lightning.kernels.availability import interpreting

    if config is None and interpreting():
        config = GROUPED_INTERPRETER_CONFIG
    if config is None:
        autotuned[grid](*args, **constexprs)
        return
    launch = {key: value for key, value in config.items() if key in ("num_warps", "num_stages")}
    meta = {key: value for key, value in config.items() if key not in launch}
    kernel[grid(meta)](*args, **constexprs, **meta, **launch)


def grouped_mm_2d3d(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, offs: torch.Tensor,
    out_dtype: torch.dtype, fast_accum: bool = False, config: dict | None = None,
) -> torch.Tensor:
    """``out[rows of e] = (a[rows of e] @ b[e]) * scale_a[row] * scale_b[e, col]`` for FP8 ``a`` (M, K) and ``b``
    (E, K, N) of any strides; ``scale_a`` (M,) or (1,) float32 (a scale per row, or one), ``scale_b`` (E, N) or
    (E, 1) float32 (per expert and column, or per expert); ``offs`` int32 (E,) on the device, ending at M (not
    checked here: that would read it on the host). ``fast_accum``: keep the whole reduction in the tensor cores'
    accumulator on sm_90 (see :func:`_dot`). ``config`` pins a tile (else autotuned per M bucket)."""
    m, k = a.shape
    experts, _, n = b.shape
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0 or experts == 0:
        return out.zero_()
    stride_sam = scale_a.stride(0) if scale_a.numel() > 1 else 0
    stride_sbn = scale_b.stride(1) if scale_b.shape[1] > 1 else 0
    args = (a, b, out, scale_a, scale_b, offs, m, n, k, m_bucket(m), a.stride(0), a.stride(1), *b.stride(),
            *out.stride(), stride_sam, scale_b.stride(0), stride_sbn)  # fmt: skip

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) + experts, triton.cdiv(n, meta["BLOCK_N"]))

    even_k = k % 128 == 0  # every tile's BLOCK_K divides 128
    _launch(_grouped_mm_2d3d_kernel, _2d3d_autotuned, grid, args, config, E=experts,
            E_PAD=triton.next_power_of_2(experts), EVEN_K=even_k, FAST_ACCUM=fast_accum)  # fmt: skip
    return out


def grouped_mm_2d2d(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, offs: torch.Tensor,
    out_dtype: torch.dtype, aligned: bool = False, fast_accum: bool = False, config: dict | None = None,
) -> torch.Tensor:
    """``out[e] = (a[:, cols of e] @ b[cols of e, :]) * scale_a[e, row] * scale_b[e, col]`` for FP8 ``a`` (N, M)
    and ``b`` (M, K) of any strides, giving (E, N, K); ``scale_a`` (E, N) or (E, 1), ``scale_b`` (E, K) or (E, 1)
    float32; ``offs`` int32 (E,) on the device. An empty group's product is zero. ``aligned``: every group starts
    at a multiple of 16 tokens (the padded layout of ``fp8_lightning.rowwise_grouped``), which lets a GPU load 16
    codes at once; a wrong promise reads misaligned on a GPU. ``fast_accum`` as for :func:`grouped_mm_2d3d`."""
    n, m = a.shape
    k = b.shape[1]
    experts = offs.numel()
    out = torch.empty((experts, n, k), dtype=out_dtype, device=a.device)
    if experts == 0 or n == 0 or k == 0:
        return out
    if m == 0:
        return out.zero_()
    stride_san = scale_a.stride(1) if scale_a.shape[1] > 1 else 0
    stride_sbk = scale_b.stride(1) if scale_b.shape[1] > 1 else 0
    args = (a, b, out, scale_a, scale_b, offs, n, k, m_bucket(m // experts), a.stride(0), a.stride(1), *b.stride(),
            *out.stride(), scale_a.stride(0), stride_san, scale_b.stride(0), stride_sbk)  # fmt: skip

    def grid(meta):
        return (triton.cdiv(n, meta["BLOCK_M"]) * triton.cdiv(k, meta["BLOCK_N"]), experts)

    _launch(_grouped_mm_2d2d_kernel, _2d2d_autotuned, grid, args, config, ALIGNED=aligned, FAST_ACCUM=fast_accum)
    return out
