"""cuBLAS's block-scaled FP4 GEMM for NVFP4 operands (sm_100 and later), and the record of scales it reads.

An NVFP4 operand (:class:`~fp8_lightning.quantize.Quantized` of kind ``nvfp4``) holds packed E2M1 codes and each
16-block's float32 multiplier ``s_global * s_block``, what the emulated GEMM multiplies. cuBLAS wants the two factors
apart: the E4M3 block scales (swizzled) and the float32 global scale, which it applies as ``alpha = g_a * g_b``. The
multiplier cannot give them back (it is their rounded product), so each cast also keeps its **GEMM scales**: one
uint8 tensor in the operand's cache (``OperandCache.native``)::

    bytes 0-3        the float32 global scale
    bytes 4-...      the E4M3 block scales, (rows, K / 16) row-major: one per 1x16 block of each row of the codes
                     (a 16x16 tile's scale repeated on its 16 rows, the form cuBLAS reads)

One tensor, so that it travels where a tensor does: through ``save_for_backward``, the traced step's custom GEMM op
and FSDP2's gathered weights. :func:`nvfp4_scaled_mm_args` turns two operands into the keyword arguments of
``torch.nn.functional.scaled_mm`` ([BlockWise1x16, TensorWise] scales, SWIZZLE_32_4_4); torch's rules for that
call: :mod:`fp8_lightning.cuda_contract.rules_nvfp4`. Packed K is zero-padded to 16 bytes per row (cuBLASLt reads
16-byte aligned rows; zero codes add nothing, and the swizzled scales already cover the padded blocks).
"""

from __future__ import annotations

import warnings

import torch

from fp8_lightning import blockwise
from fp8_lightning.gemm import requested_backend, swizzle_mx_scales
from fp8_lightning.ops.dispatch import operand_f32
from fp8_lightning.nvfp4 import NVFP4_BLOCK, NVFP4Tensor
from fp8_lightning.quantize import Quantized, pad_dim, row_major

NATIVE_NVFP4_MIN_CAPABILITY = (10, 0)  # FP4 tensor cores: cuBLASLt's VEC16_UE4M3 scaling on 10.x and 12.x ...
NATIVE_NVFP4_MIN_CUDA = (12, 8)  # ... from CUDA 12.8 on
_HEADER = 4  # bytes of the float32 global scale
_ROW_BYTES = 16  # cuBLASLt's alignment of a row of packed codes


def gemm_scales(q: NVFP4Tensor, rows: int) -> torch.Tensor:
    """The GEMM scales (see the module docstring) of the first ``rows`` rows of a cast's codes."""
    blocks = q.block_scales
    if q.tile_rows > 1:  # each tile's scale on its rows: a broadcast copy
        blocks = blocks.unsqueeze(1).expand(-1, q.tile_rows, -1).reshape(-1, blocks.shape[1])
    return torch.cat([_header(q.global_scale), blocks[:rows].reshape(-1).view(torch.uint8)])


def _header(global_scale: torch.Tensor) -> torch.Tensor:
    """The global scale's four bytes (little-endian, as a CUDA or x86 float32 lies in memory). Traced, by integer
    shifts of a same-size bitcast: torch 2.11's inductor refuses a float32 -> uint8 view of the scalar (its lowering
    gives it stride 0); eager, by that view (one operation instead of four: a cast is paid per step)."""
    value = global_scale.float().reshape(1)
    if not torch.compiler.is_compiling():
        return value.view(torch.uint8)
    bits = value.view(torch.int32)
    return ((bits >> torch.arange(0, 32, 8, device=bits.device, dtype=torch.int32)) & 0xFF).to(torch.uint8)


def split_gemm_scales(native: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 block scales (rows, K / 16), float32 global scale of shape ()) of a GEMM-scales tensor."""
    return native[_HEADER:].view(torch.float8_e4m3fn).view(rows, -1), native[:_HEADER].view(torch.float32).reshape(())


def nvfp4_tensor(q: Quantized, tile_rows: int) -> NVFP4Tensor:
    """The :class:`~fp8_lightning.nvfp4.NVFP4Tensor` an operand with GEMM scales was cast as (``tile_rows``: 1, or 16
    for 16x16 tiles, whose scales are read from each tile's first row)."""
    blocks, global_scale = split_gemm_scales(q.cache.native, q.data.shape[0])
    rows, k = q.data.shape[0], q.data.shape[1] * 2
    return NVFP4Tensor(q.data, blocks[::tile_rows].contiguous(), global_scale, (rows, k), tile_rows)


def has_scaled_mm_fp4() -> bool:
    """Whether this torch has ``torch.nn.functional.scaled_mm`` with NVFP4's BlockWise1x16 scales and the packed FP4
    dtype (torch 2.10 on; present in 2.11)."""
    scaling = getattr(torch.nn.functional, "ScalingType", None)
    return blockwise.has_scaled_mm_v2() and hasattr(scaling, "BlockWise1x16") and hasattr(torch, "float4_e2m1fn_x2")


def native_nvfp4_gemm_support(device: torch.device | str) -> tuple[bool, str]:
    """Whether cuBLAS runs NVFP4 GEMMs on ``device`` (sm_100+ with CUDA 12.8+, and a torch with the v2 call), and
    why not."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False, "the native NVFP4 GEMM needs a CUDA device"
    capability = tuple(torch.cuda.get_device_capability(device))
    if capability < NATIVE_NVFP4_MIN_CAPABILITY:
        return False, f"compute capability {capability[0]}.{capability[1]} has no FP4 tensor cores (sm_100+ have)"
    cuda = torch.version.cuda
    if not cuda or tuple(int(p) for p in cuda.split(".")[:2]) < NATIVE_NVFP4_MIN_CUDA:
        return False, f"torch's CUDA {cuda} has no cuBLAS NVFP4 GEMM (needs CUDA 12.8+)"
    if not has_scaled_mm_fp4():
        return False, f"torch {torch.__version__} has no torch.nn.functional.scaled_mm with BlockWise1x16 scales"
    return True, f"compute capability {capability[0]}.{capability[1]}, CUDA {cuda}"


def nvfp4_shape_reason(a: Quantized, b: Quantized) -> str | None:
    """Why the native GEMM cannot take ``a @ b.T`` as the operands are, or None: both need GEMM scales, and torch
    wants K and N (the rows of ``b``) in multiples of 16."""
    if a.cache.native is None or b.cache.native is None:
        return "an operand carries no GEMM scales (E4M3 block scales and global scale), only its multipliers"
    k, n = a.data.shape[1] * 2, b.data.shape[0]
    if k % NVFP4_BLOCK or n % NVFP4_BLOCK:
        return f"torch's NVFP4 GEMM needs K and N in multiples of 16; got K={k}, N={n}"
    return None


def _swizzled(q: Quantized) -> tuple[torch.Tensor, torch.Tensor]:
    """(block scales in cuBLAS's swizzled layout, global scale) of ``q``, the former kept on the operand."""
    blocks, global_scale = split_gemm_scales(q.cache.native, q.data.shape[0])
    if q.cache.swizzled is None:
        q.cache.swizzled = swizzle_mx_scales(blocks)
    return q.cache.swizzled, global_scale


def _float4(codes: torch.Tensor) -> torch.Tensor:
    """Packed codes as ``float4_e2m1fn_x2``, row-major, each row zero-padded to 16 bytes."""
    return pad_dim(row_major(codes), 1, _ROW_BYTES).view(torch.float4_e2m1fn_x2)


def nvfp4_scaled_mm_args(a: Quantized, b: Quantized, out_dtype: torch.dtype = torch.bfloat16) -> dict:
    """The keyword arguments of ``torch.nn.functional.scaled_mm`` for ``a @ b.T`` of two NVFP4 operands with GEMM
    scales (K last in both): packed ``float4_e2m1fn_x2`` operands, each with ``[E4M3 block scales in cuBLAS's
    swizzled layout, float32 global scale]`` under ``[BlockWise1x16, TensorWise]``, so cuBLAS applies
    ``g_a * g_b`` itself."""
    from torch.nn.functional import ScalingType, SwizzleType

    (scale_a, global_a), (scale_b, global_b) = _swizzled(a), _swizzled(b)
    recipe = [ScalingType.BlockWise1x16, ScalingType.TensorWise]
    swizzle = [SwizzleType.SWIZZLE_32_4_4, SwizzleType.NO_SWIZZLE]
    return {
        "mat_a": _float4(a.data), "mat_b": _float4(b.data).t(),
        "scale_a": [scale_a, global_a], "scale_recipe_a": recipe,
        "scale_b": [scale_b, global_b], "scale_recipe_b": recipe,
        "swizzle_a": swizzle, "swizzle_b": swizzle, "output_dtype": out_dtype,
    }


def native_nvfp4_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """``a @ b.T (+ bias)`` on cuBLAS's FP4 tensor cores, with the emulation's roundings of the output: the bias
    rides in the epilogue where torch takes it (a bf16 or fp16 output and a bias of that dtype: one rounding of the
    float32 sum); otherwise cuBLAS writes float32 and the bias is added in float32 before the one rounding."""
    fused = bias is not None and out_dtype in (torch.bfloat16, torch.float16) and bias.dtype == out_dtype
    plain = out_dtype in (torch.float32, torch.bfloat16, torch.float16) and (bias is None or fused)
    mm_dtype = out_dtype if plain else torch.float32
    out = torch.nn.functional.scaled_mm(**nvfp4_scaled_mm_args(a, b, mm_dtype), bias=bias if fused else None)
    if bias is not None and not fused:
        out = out + bias.float()
    return out.to(out_dtype)


def nvfp4_mm(a: Quantized, b: Quantized, out_dtype, emulate=False, bias=None, fast_accum=False) -> torch.Tensor:
    """``a @ b.T (+ bias)`` of two NVFP4 operands: cuBLAS's FP4 GEMM where it runs (CUDA sm_100+, a torch with the
    BlockWise1x16 call, operands with GEMM scales), else their dequantized values multiplied in float32 (on such a
    device with a warning once per reason). Both accumulate in float32 and round the output once."""
    if not emulate and a.data.device.type == "cuda" and requested_backend() != "emulate":
        ok = native_nvfp4_gemm_support(a.data.device)[0]
        reason = nvfp4_shape_reason(a, b) if ok else None
        if ok and reason is None:
            return native_nvfp4_mm(a, b, out_dtype, bias)
        if ok:
            _warn_once(f"NVFP4BlockScaling emulates a GEMM in float32: {reason}")  # once per reason, not per M
    out = operand_f32(a) @ operand_f32(b).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(f"{message}. Results are right but slower; FP8_LIGHTNING_EMULATE=1 chooses the emulation and "
                      "silences this warning.", stacklevel=4)


__all__ = [
    "NATIVE_NVFP4_MIN_CAPABILITY",
    "NATIVE_NVFP4_MIN_CUDA",
    "gemm_scales",
    "has_scaled_mm_fp4",
    "native_nvfp4_gemm_support",
    "native_nvfp4_mm",
    "nvfp4_mm",
    "nvfp4_scaled_mm_args",
    "nvfp4_shape_reason",
    "nvfp4_tensor",
    "split_gemm_scales",
]
