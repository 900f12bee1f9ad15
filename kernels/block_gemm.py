"""Block-scaled FP8 GEMM for MXFP8 operands, for GPUs without a native MX GEMM (sm89 Ada, sm90 Hopper).

``out = a @ b.T`` with ``a`` (M, K) and ``b`` (N, K), both FP8 with K last, and E8M0 scales ``a_scale``
(M, K / bs) and ``b_scale`` (N, K / bs): one scale per ``bs`` consecutive elements of K (bs = 32 in MXFP8).
The twin is ``fp8_lightning.gemm``'s emulation: dequantize both operands to float32, then matmul.

Why this shape of kernel: the tensor cores of sm89/sm90 multiply FP8 tiles but know nothing of per-block
scales, so every K step is exactly one scale block (``BLOCK_K = bs``). Each step's FP8 product is accumulated
in float32 by the tensor cores, then folded into the running float32 accumulator with the outer product of the
two blocks' scales:

    acc += dot(a[:, k:k+bs], b[:, k:k+bs].T) * (2**ea[:, None] * 2**eb[None, :])

Scales are powers of two, so the fold is one exact multiply (barring float32 under/overflow of the product)
and one add per output element and block. The result equals the twin up to float32 summation order.

The design in full: ``docs/design/notes.md``, section ``kernels.block_gemm``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8_lightning.kernels.descriptors import descriptor_ready

SUPPORTED_BLOCK_SIZES = (32, 64, 128)
SUPPORTED_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# A small fixed tile for the Triton interpreter (CPU), where autotuning has nothing to measure.
INTERPRETER_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "GROUP_M": 2}


def mx_gemm_configs(capability: tuple[int, int] | None = None) -> list[triton.Config]:
    """The tile configurations the autotuner chooses from on a GPU of ``capability`` (None: every one).

    Each program holds the running float32 accumulator *and* the block's partial product in registers (the fold
    needs both), so tiles are sized for two (BLOCK_M, BLOCK_N) float32 tensors per warpgroup. Compiled ahead of
    time (``benchmarks/aot_compile.py``), 128-row tiles fit on Hopper's wgmma (sm90) but spill on sm100 (the
    partial is copied out of tensor memory every K step); 256-wide tiles spill everywhere. Ada (sm89) has no TMA:
    Triton lowers the descriptors to plain loads into registers (no shared-memory pipelining, so ``num_stages``
    changes nothing there), and each tile of 64x64 or more tried there spills at block size 64 or 128, so Ada
    gets its own tiles of 2,048 outputs.
    """
    shapes = [
        # BLOCK_M, BLOCK_N, num_warps, num_stages, the GPUs that select it
        (128, 128, 8, 4, "sm90"),
        (128, 64, 4, 4, "sm90"),
        (64, 128, 4, 3, "sm90+"),
        (64, 128, 4, 4, "sm90+"),
        (64, 64, 4, 5, "sm90+"),
        (32, 64, 4, 3, "sm89"),
        (32, 64, 8, 3, "sm89"),
        (64, 32, 8, 3, "sm89"),
    ]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 8}, num_warps=warps, num_stages=stages,
                      pre_hook=_set_descriptor_blocks)
        for bm, bn, warps, stages, gpus in shapes
        if capability is None or _selects(gpus, capability)
    ]


def _selects(gpus: str, capability: tuple[int, int]) -> bool:
    """Whether a tile meant for ``gpus`` ("sm89": Ada; "sm90": Hopper; "sm90+": Hopper and later) runs on
    ``capability``."""
    ada, hopper = capability[0] == 8, capability[0] == 9
    return {"sm89": ada, "sm90": hopper, "sm90+": not ada}[gpus]


def _set_descriptor_blocks(args: dict) -> None:
    """Autotune pre-hook: the operands' tensor descriptors load (BLOCK_M or BLOCK_N, BLOCK_K) tiles."""
    args["a_desc"].block_shape = [args["BLOCK_M"], args["BLOCK_K"]]
    args["b_desc"].block_shape = [args["BLOCK_N"], args["BLOCK_K"]]


def _config_key(config: triton.Config) -> tuple:
    return tuple(sorted(config.kwargs.items())), config.num_warps, config.num_stages


def _prune_for_device(configs, named_args, **kwargs):
    """Autotune early prune: only the configurations :func:`mx_gemm_configs` selects for the output's GPU."""
    allowed = {_config_key(c) for c in mx_gemm_configs(torch.cuda.get_device_capability(named_args["c_ptr"].device))}
    return [config for config in configs if _config_key(config) in allowed]


@triton.jit
def _e8m0_to_float(byte):
    """E8M0 byte -> float32 power of two; byte 0 is 2**-127 (a subnormal), byte 255 is NaN."""
    b = byte.to(tl.int32)
    bits = tl.where(b == 0, 0x00400000, tl.where(b == 255, 0x7FC00000, b << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mx_gemm_kernel(
    a_desc, a_scale_ptr, b_desc, b_scale_ptr, c_ptr, M, N, K,
    stride_asm, stride_ask, stride_bsn, stride_bsk, stride_cm, stride_cn,
    BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):
    # Grouped program order: GROUP_M rows of tiles are swept before moving to the next columns.
    pid = tl.program_id(0)
    grid_m = (M + BLOCK_M - 1) // BLOCK_M
    grid_n = (N + BLOCK_N - 1) // BLOCK_N
    group_size = GROUP_M * grid_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N

    # Operand tiles come through tensor descriptors (TMA on sm90+; rows past M/N read as zeros). Scale rows
    # past M/N are wrapped (% M): they only meet those zero rows, and the store masks them out.
    a_scale_ptrs = a_scale_ptr + ((off_m + tl.arange(0, BLOCK_M)) % M).to(tl.int64) * stride_asm
    b_scale_ptrs = b_scale_ptr + ((off_n + tl.arange(0, BLOCK_N)) % N).to(tl.int64) * stride_bsn

    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for kb in range(0, K // BLOCK_K):
        a = a_desc.load([off_m, kb * BLOCK_K])
        b = b_desc.load([off_n, kb * BLOCK_K])
        sa = _e8m0_to_float(tl.load(a_scale_ptrs + kb * stride_ask))
        sb = _e8m0_to_float(tl.load(b_scale_ptrs + kb * stride_bsk))
        # Row scale, then column scale: two exact multiplies, without a (BLOCK_M, BLOCK_N) tensor of scales.
        acc += (tl.dot(a, tl.trans(b)) * sa[:, None]) * sb[None, :]

    cm = (off_m + tl.arange(0, BLOCK_M)).to(tl.int64)
    cn = (off_n + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask = (cm[:, None] < M) & (cn[None, :] < N)
    tl.store(c_ptr + cm[:, None] * stride_cm + cn[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty), mask=mask)


def m_bucket(m: int) -> int:
    """The token counts that share one tuned tile: a power of two (at least 64), so a new batch size or a ragged
    last batch reuses the tile of its bucket instead of autotuning again (each tuning times every candidate)."""
    return max(64, 1 << (m - 1).bit_length())


_TUNED: dict[tuple, dict] = {}  # (M bucket, N, K, BLOCK_K, dtypes, device) -> the tile the autotuner chose


def _pinned(config: triton.Config) -> dict:
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


_mx_gemm_autotuned = triton.autotune(
    configs=mx_gemm_configs(),
    key=["M", "N", "K", "BLOCK_K"],
    prune_configs_by={"early_config_prune": _prune_for_device},
)(_mx_gemm_kernel)


def mx_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    config: dict | None = None,
) -> torch.Tensor:
    """``a @ b.T`` for validated MX operands (scales as uint8). ``config`` pins a tile (else autotuned;
    under the interpreter a small fixed tile). Without ``config``, on Hopper, ``FP8_LIGHTNING_GLUON_MX_GEMM=1``
    hands the call to the Gluon kernel (:mod:`~fp8_lightning.kernels.block_gemm_gluon`)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from fp8_lightning.kernels.availability import gluon_mx_gemm_status, interpreting

    if config is None and gluon_mx_gemm_status(a.device)[0]:  # opt-in (FP8_LIGHTNING_GLUON_MX_GEMM), Hopper only
        from fp8_lightning.kernels import block_gemm_gluon

        if block_gemm_gluon.refusal(a_scale, b_scale) is None:
            return block_gemm_gluon.gluon_mx_gemm(a, a_scale, b, b_scale, out_dtype)
    m, k = a.shape
    n = b.shape[0]
    block_size = k // a_scale.shape[1]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    if config is None and interpreting():
        config = INTERPRETER_CONFIG
    tuning_key = (m_bucket(m), n, k, block_size, a.dtype, b.dtype, out_dtype, str(a.device))
    config = config or _TUNED.get(tuning_key)
    a, b = descriptor_ready(a), descriptor_ready(b)
    # Block shapes are set per config (the pre-hook when autotuning); these are placeholders of the right rank.
    blocks = config or INTERPRETER_CONFIG
    a_desc = TensorDescriptor(a, [m, k], [a.stride(0), 1], [blocks["BLOCK_M"], block_size])
    b_desc = TensorDescriptor(b, [n, k], [b.stride(0), 1], [blocks["BLOCK_N"], block_size])
    args = (
        a_desc, a_scale, b_desc, b_scale, out, m, n, k,
        a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1), out.stride(0), out.stride(1),
    )
    if config is None:

        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

        _mx_gemm_autotuned[grid](*args, BLOCK_K=block_size)
        _TUNED[tuning_key] = _pinned(_mx_gemm_autotuned.best_config)
    else:
        tiles = triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"])
        launch = {key: value for key, value in config.items() if key in ("num_warps", "num_stages")}
        meta = {key: value for key, value in config.items() if key not in launch}
        _mx_gemm_kernel[(tiles,)](*args, BLOCK_K=block_size, **meta, **launch)
    return out
