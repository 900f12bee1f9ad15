"""The NVFP4 cast in Triton: block scales, E2M1 codes packed two per byte, optional RHT and stochastic rounding.

The pure-torch twin is :func:`fp8_lightning.nvfp4.quantize_nvfp4` (with ``rht_signs`` and ``sr_key``); this kernel
computes its bits. A program loads one (BLOCK_R, BLOCK_K) tile of the 2-D ``x`` (any strides, zeros past the edges,
which is the reference's padding) and, from the same registers,

* applies the 16-point random Hadamard transform to each 16-element block along K when asked: the signs, the
  four butterfly stages and the final ``* 0.25`` in the order of :func:`fp8_lightning.nvfp4.rht_blocks`, so the
  float32 roundings are the reference's;
* takes each block's amax (1x16 blocks, or 16x16 tiles when ``TILE_ROWS=16``), the E4M3 block scale
  ``amax / 6 / s_global`` clamped to [2**-6, 448], and the encode factor ``(1 / s_global) / s_block`` (IEEE
  divisions, as torch's);
* rounds ``x * factor`` (clamped to +-6, NaN kept) to E2M1, to nearest even or stochastically with the uniform
  numbers of :func:`fp8_lightning.nvfp4.uniform_like` (the same counter hash of ``row * K_pad + column`` and the key),
  and stores the codes, the even element in the low nibble.

Without a given global scale a first launch of the same tile code measures the (transformed) tensor's amax with an
atomic max of its float32 bits; ``global_scale_from_amax`` turns it into the scale on the device (no host read).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8_lightning.kernels.per_tensor import _abs_bits, _reduce_max, _saturate, _to_fp8_values, format_constants

FP4_SCALE_BLOCK = 16
BLOCK_R = 32  # rows per program: two 16x16 weight tiles
BLOCK_K = 64  # columns per program: four 16-element blocks
NVFP4_NUM_WARPS = 4


@triton.jit
def _butterfly(v, N: tl.constexpr, H: tl.constexpr):
    """One stage of the fast Walsh-Hadamard transform on a flat ``v`` of N elements: each pair (i, i + H) with bit
    H of i clear becomes (a + b, a - b)."""
    pairs = tl.permute(tl.reshape(v, (N // (2 * H), 2, H)), (0, 2, 1))
    a, b = tl.split(pairs)
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (N,))


@triton.jit
def _load_tile(x_ptr, signs_ptr, R, K, stride_r, stride_k, RHT: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """This program's float32 tile of x (zeros outside it), through the RHT when ``RHT``; and its row and column
    indices."""
    rr = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    rk = (tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    mask = (rr[:, None] < R) & (rk[None, :] < K)
    x = tl.load(x_ptr + rr[:, None] * stride_r + rk[None, :] * stride_k, mask=mask, other=0.0).to(tl.float32)
    if RHT:
        N: tl.constexpr = BLOCK_R * BLOCK_K
        signs = tl.load(signs_ptr + tl.arange(0, 16))
        v = tl.reshape(tl.reshape(x, (BLOCK_R, BLOCK_K // 16, 16)) * signs[None, None, :], (N,))
        v = _butterfly(v, N, 1)
        v = _butterfly(v, N, 2)
        v = _butterfly(v, N, 4)
        v = _butterfly(v, N, 8)
        x = tl.reshape(v, (BLOCK_R, BLOCK_K)) * 0.25
        x = tl.where(rr[:, None] < R, x, 0.0)  # rows pad after the transform (negative signs made -0 there)
    return x, rr, rk


@triton.jit
def _nvfp4_amax_kernel(x_ptr, signs_ptr, amax_bits_ptr, R, K, stride_r, stride_k, RHT: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    x, _, _ = _load_tile(x_ptr, signs_ptr, R, K, stride_r, stride_k, RHT, BLOCK_R, BLOCK_K)
    tl.atomic_max(amax_bits_ptr, _reduce_max(_reduce_max(_abs_bits(x), 1), 0))


@triton.jit
def _nan_codes(abs_bits):
    """``nvfp4._nan_codes``: torchao's bit-level cast applied to a NaN's bits."""
    mant_odd = (abs_bits >> 22) & 1
    return ((abs_bits + (-126 << 23) + (1 << 21) - 1 + mant_odd) >> 22) & 0xFF


@triton.jit
def _uniform(rr, rk, PK, key):
    """``nvfp4.uniform_like`` at (rr, rk) of a (rows, PK) grid: murmur3's finaliser of ``index * golden + key``
    in 64-bit unsigned arithmetic (no product overflows), keeping the low 32 bits after each step."""
    index = (rr[:, None] * PK + rk[None, :]).to(tl.uint64)
    mask32 = tl.full((), 0xFFFFFFFF, tl.uint64)
    h = (index * tl.full((), 0x9E3779B1, tl.uint64) + key) & mask32
    h = h ^ (h >> 16)
    h = (h * tl.full((), 0x85EBCA6B, tl.uint64)) & mask32
    h = h ^ (h >> 13)
    h = (h * tl.full((), 0xC2B2AE35, tl.uint64)) & mask32
    h = h ^ (h >> 16)
    return (h >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _e2m1_magnitude_codes(mag, u, STOCHASTIC: tl.constexpr):
    """Codes 0-7 of ``mag`` (in [0, 6]): nearest, ties to even (``nvfp4.e2m1_codes``), or down/up with
    probability by distance (``nvfp4.stochastic_e2m1_codes``, uniform ``u``)."""
    if STOCHASTIC:
        lower = ((mag >= 0.5).to(tl.int32) + (mag >= 1.0).to(tl.int32) + (mag >= 1.5).to(tl.int32)
                 + (mag >= 2.0).to(tl.int32) + (mag >= 3.0).to(tl.int32) + (mag >= 4.0).to(tl.int32)
                 + (mag >= 6.0).to(tl.int32))
        low = tl.where(lower < 4, lower.to(tl.float32) * 0.5,
                       tl.where(lower == 4, 2.0, tl.where(lower == 5, 3.0, tl.where(lower == 6, 4.0, 6.0))))
        inv_gap = tl.where(lower < 4, 2.0, tl.where(lower < 6, 1.0, tl.where(lower == 6, 0.5, 1.0)))
        up = (u < (mag - low) * inv_gap) & (lower < 7)  # times 1 / gap: exact, gaps are powers of two
        code = lower + up.to(tl.int32)
    else:
        code = ((mag > 0.25).to(tl.int32) + (mag >= 0.75).to(tl.int32) + (mag > 1.25).to(tl.int32)
                + (mag >= 1.75).to(tl.int32) + (mag > 2.5).to(tl.int32) + (mag >= 3.5).to(tl.int32)
                + (mag > 5.0).to(tl.int32))
    return code


@triton.jit
def _nvfp4_cast_kernel(
    x_ptr, gscale_ptr, signs_ptr, key_ptr, codes_ptr, scales_ptr,
    R, K, PR, PK, stride_r, stride_k,
    TILE_ROWS: tl.constexpr, RHT: tl.constexpr, STOCHASTIC: tl.constexpr,
    FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, NAN_BITS: tl.constexpr,
    EXPLICIT_ROUNDING: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    x, rr, rk = _load_tile(x_ptr, signs_ptr, R, K, stride_r, stride_k, RHT, BLOCK_R, BLOCK_K)
    NB: tl.constexpr = BLOCK_K // 16
    NT: tl.constexpr = BLOCK_R // TILE_ROWS
    g = tl.load(gscale_ptr)
    tiles = tl.reshape(x, (NT, TILE_ROWS, NB, 16))
    amax_bits = _reduce_max(_reduce_max(_abs_bits(tiles), 3), 1)  # (NT, NB); NaN above inf, as torch's amax
    amax = amax_bits.to(tl.float32, bitcast=True)
    block_scale = tl.math.div_rn(tl.math.div_rn(amax, 6.0), g)
    block_scale = tl.where(block_scale != block_scale, block_scale, tl.maximum(block_scale, 0.015625))
    s8 = _to_fp8_values(block_scale, FP8_MAX, MANTISSA_BITS, MIN_NORMAL_EXP, NAN_BITS,
                        EXPLICIT_ROUNDING).to(tl.float8e4nv)
    # a NaN scale as torch's E4M3 -> float32 conversion makes it (the reference's ``scales.float()``)
    s32 = tl.where(block_scale != block_scale, tl.full((), 0x7FF00000, tl.int32).to(tl.float32, bitcast=True),
                   s8.to(tl.float32))
    encode = tl.math.div_rn(tl.math.div_rn(1.0, g), s32)  # (NT, NB)
    # factor * x, not x * factor: when both are NaN, a CPU (the interpreter) keeps the first operand's payload, and
    # torch's CPU product in the reference keeps the factor's; a GPU returns its one canonical NaN either way
    scaled = tl.reshape(encode[:, None, :, None] * tiles, (BLOCK_R, BLOCK_K))
    scaled = _saturate(scaled, 6.0)
    bits = scaled.to(tl.int32, bitcast=True)
    abs_bits = bits & 0x7FFFFFFF
    if STOCHASTIC:
        u = _uniform(rr, rk, PK, tl.load(key_ptr).to(tl.uint64))
    else:
        u = scaled
    code = _e2m1_magnitude_codes(tl.abs(scaled), u, STOCHASTIC)
    code = tl.where(scaled != scaled, _nan_codes(abs_bits), code) | (((bits >> 31) & 1) << 3)
    low, high = tl.split(tl.reshape(code, (BLOCK_R, BLOCK_K // 2, 2)))
    packed = (low | (high << 4)).to(tl.uint8)
    pc = (tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)).to(tl.int64)
    tl.store(codes_ptr + rr[:, None] * (PK // 2) + pc[None, :], packed,
             mask=(rr[:, None] < PR) & (pc[None, :] < PK // 2))
    st = (tl.program_id(0) * NT + tl.arange(0, NT)).to(tl.int64)
    sb = (tl.program_id(1) * NB + tl.arange(0, NB)).to(tl.int64)
    n_sb = PK // 16
    tl.store(scales_ptr + st[:, None] * n_sb + sb[None, :], s8,
             mask=(st[:, None] < PR // TILE_ROWS) & (sb[None, :] < n_sb))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def device_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """``nvfp4.global_scale_from_amax`` on the device (the kernels do not import the core): ``amax / (448 * 6)``,
    1 where the amax is 0 or not finite."""
    fine = torch.isfinite(amax) & (amax > 0)
    return torch.where(fine, amax / (448.0 * 6.0), torch.ones_like(amax))


def launch_nvfp4_amax(x: torch.Tensor, signs: torch.Tensor | None) -> torch.Tensor:
    """max |x| (|RHT(x)| with ``signs``) as a float32 scalar, NaN when any element is NaN; one read of ``x``."""
    bits = torch.zeros(1, dtype=torch.int32, device=x.device)
    r, k = x.shape
    if x.numel():
        grid = (triton.cdiv(r, BLOCK_R), triton.cdiv(k, BLOCK_K))
        _nvfp4_amax_kernel[grid](x, x if signs is None else signs, bits, r, k, x.stride(0), x.stride(1),
                                 RHT=signs is not None, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, num_warps=NVFP4_NUM_WARPS)
    return bits.view(torch.float32).reshape(())


def launch_nvfp4_cast(
    x: torch.Tensor, global_scale: torch.Tensor, tile_rows: int, signs: torch.Tensor | None, key: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (padded rows, K_pad / 2) uint8 and E4M3 block scales (padded rows / tile_rows, K_pad / 16) of a 2-D
    ``x`` with a one-element float32 ``global_scale``; ``signs``: 16 float32 RHT signs or None; ``key``: a
    one-element int64 stochastic-rounding key or None (nearest even). Rows pad to ``tile_rows``, K to 16."""
    r, k = x.shape
    pr, pk = _round_up(r, tile_rows), _round_up(k, FP4_SCALE_BLOCK)
    codes = torch.empty((pr, pk // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((pr // tile_rows, pk // FP4_SCALE_BLOCK), dtype=torch.float8_e4m3fn, device=x.device)
    if pr and pk:
        grid = (triton.cdiv(pr, BLOCK_R), triton.cdiv(pk, BLOCK_K))
        _nvfp4_cast_kernel[grid](
            x, global_scale, x if signs is None else signs, x if key is None else key, codes, scales,
            r, k, pr, pk, x.stride(0), x.stride(1),
            TILE_ROWS=tile_rows, RHT=signs is not None, STOCHASTIC=key is not None,
            **format_constants(torch.float8_e4m3fn), BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, num_warps=NVFP4_NUM_WARPS,
        )
    return codes, scales
