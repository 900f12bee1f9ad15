"""Fused AdamW step over FP8/FP16 block-scaled states: decode, update and re-encode in one pass (Triton).

The pure-torch twin is ``FP8Optimizer``'s per-parameter step (``fp8_lightning/optim/optimizer.py`` with
``update_rules.adam_update`` and ``state_formats.encode_state/decode_state``). The torch path reads and writes every
state several times (decode to float32, the update's element-wise ops, amax per block, scale, cast); here one program
owns one block of the state scales, so it loads the block once (parameter or master, gradient, ``m`` bytes and
scale, ``v`` bytes and scale), updates it in registers, reduces the new block amax of ``m`` and ``v`` in
registers, and stores the encoded bytes and the new scales: one read and one write of each tensor.

Layout (the same as the torch path, so either can continue the other): states are flat, zero-padded to a
multiple of the block size; ``m`` is FP8 (``float8_e4m3fn`` or ``float8_e5m2``) with one float32 multiplier per
block, ``v`` is FP16 or FP8 (optionally of ``sqrt(v)``) with one float32 multiplier per block; decoding is
``data / scale`` and encoding ``saturate(x * scale)`` with ``scale = dtype_max / amax(block)``, the amax of the
block's finite values (1 when none is nonzero; a NaN stays NaN and an infinity saturates, each on its own).
Master weights: none (the parameter itself, any float dtype), a float32 copy, a bf16 parameter with an int16
remainder (``bits = bf16_bits << 16 + remainder``, rounded to nearest on the way back), or a bf16
parameter with an int8 remainder (``bits = (bf16_bits << 8 + remainder) << 8``: the master rounded to nearest to
16 significant bits, then split; the same bit arithmetic as ``master_weights.split_fp32_int8``).

Numerics versus the twin: the same formulas, but the compiler may contract multiply-adds and the order of
``lerp``/``addcmul`` differs by a rounding, so parameters agree to float32 rounding and a re-encoded state can
land one FP8/FP16 step away where a value sits on a rounding boundary; the interpreter test uses tolerances that
say so. Under the interpreter the FP8 stores are pre-rounded to the grid (``_to_fp8_values``), because its own
float8 conversion is not round-to-nearest-even.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fp8_lightning.kernels.availability import device_status, explicit_rounding, require_triton
from fp8_lightning.kernels.per_tensor import (
    FLOAT32_MAX_CONSTEXPR,
    _reduce_max,
    _saturate,
    _to_fp8_values,
    format_constants,
)

MASTER_CODES = {"none": 0, "fp32": 1, "bf16_remainder": 2, "bf16_int8_remainder": 3}
REMAINDER_KINDS = ("bf16_remainder", "bf16_int8_remainder")
FP8_STATE_DTYPES = ("float8_e4m3fn", "float8_e5m2")
V_DTYPES = ("float16",) + FP8_STATE_DTYPES
MIN_BLOCK, MAX_BLOCK = 16, 8192
FP16_MAX = torch.finfo(torch.float16).max


def adam_num_warps(block: int) -> int:
    """Warps per program: at most 32 elements of a block per thread (64 spill at BLOCK=8192 on sm_90a and
    sm_100a, ``benchmarks/aot_compile.py``), at least the 4 that small blocks get."""
    return min(16, max(4, block // 1024))


@triton.jit
def _block_scale(x, DTYPE_MAX: tl.constexpr):
    """``DTYPE_MAX / amax(x)`` over the block's finite values (1 when none is nonzero), like
    ``state_formats.state_block_scales``: a NaN or infinite element never decides its neighbours' scale."""
    magnitude = tl.abs(x)
    # NaN and inf compare False
    block_amax = _reduce_max(tl.where(magnitude <= FLOAT32_MAX_CONSTEXPR, magnitude, 0.0), 0)
    scale = tl.math.div_rn(DTYPE_MAX, block_amax)  # correctly rounded, like max_over_amax
    scale = tl.where(block_amax > 0, scale, 1.0)
    return tl.minimum(scale, FLOAT32_MAX_CONSTEXPR)


@triton.jit
def _fp8_adam_kernel(
    param_ptr, grad_ptr, master_ptr, m_ptr, m_scale_ptr, v_ptr, v_scale_ptr, n,
    lr, beta1, beta2, eps, weight_decay, step_size, bias_correction2_sqrt,
    BLOCK: tl.constexpr, MASTER: tl.constexpr, DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr,
    M_MAX: tl.constexpr, M_MANTISSA: tl.constexpr, M_MIN_EXP: tl.constexpr, M_NAN_BITS: tl.constexpr,
    V_FP8: tl.constexpr, V_SQRT: tl.constexpr, V_MAX: tl.constexpr, V_MANTISSA: tl.constexpr,
    V_MIN_EXP: tl.constexpr, V_NAN_BITS: tl.constexpr, EXPLICIT_ROUNDING: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n

    # ---- load and decode -------------------------------------------------------------------------------
    grad = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if MAXIMIZE:
        grad = -grad
    if MASTER == 0:
        p = tl.load(param_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    elif MASTER == 1:
        p = tl.load(master_ptr + offs, mask=mask, other=0.0)
    elif MASTER == 2:
        high = tl.load(param_ptr + offs, mask=mask, other=0).to(tl.int32)  # bf16 bits as int16
        low = tl.load(master_ptr + offs, mask=mask, other=0).to(tl.int32)
        p = ((high << 16) + low).to(tl.float32, bitcast=True)
    else:
        high = tl.load(param_ptr + offs, mask=mask, other=0).to(tl.int32)  # bf16 bits as int16
        low = tl.load(master_ptr + offs, mask=mask, other=0).to(tl.int32)  # int8 remainder
        p = (((high << 8) + low) << 8).to(tl.float32, bitcast=True)
    m = tl.load(m_ptr + offs).to(tl.float32) / tl.load(m_scale_ptr + pid)
    v = tl.load(v_ptr + offs).to(tl.float32) / tl.load(v_scale_ptr + pid)
    if V_SQRT:
        v = v * v

    # ---- AdamW -----------------------------------------------------------------------------------------
    if DECOUPLED:
        p = p * (1.0 - lr * weight_decay)
    else:
        grad = grad + weight_decay * p
    m = m + (1.0 - beta1) * (grad - m)
    v = v * beta2 + (1.0 - beta2) * grad * grad
    denom = tl.sqrt(v) / bias_correction2_sqrt + eps
    p = p - step_size * (m / denom)

    # ---- encode and store ------------------------------------------------------------------------------
    if MASTER == 0:
        tl.store(param_ptr + offs, p.to(param_ptr.dtype.element_ty), mask=mask)
    elif MASTER == 1:
        tl.store(master_ptr + offs, p, mask=mask)
        tl.store(param_ptr + offs, p.to(param_ptr.dtype.element_ty), mask=mask)
    elif MASTER == 2:
        bits = p.to(tl.int32, bitcast=True)
        high = (bits + 0x8000) >> 16
        tl.store(param_ptr + offs, high.to(tl.int16), mask=mask)
        tl.store(master_ptr + offs, (bits - (high << 16)).to(tl.int16), mask=mask)
    else:
        bits24 = (p.to(tl.int32, bitcast=True) + 0x80) >> 8  # 16 significant bits, rounded to nearest
        high = (bits24 + 0x80) >> 8
        tl.store(param_ptr + offs, high.to(tl.int16), mask=mask)
        tl.store(master_ptr + offs, (bits24 - (high << 8)).to(tl.int8), mask=mask)

    m = tl.where(mask, m, 0.0)
    m_scale = _block_scale(m, M_MAX)
    m_q = _to_fp8_values(m * m_scale, M_MAX, M_MANTISSA, M_MIN_EXP, M_NAN_BITS, EXPLICIT_ROUNDING)
    tl.store(m_ptr + offs, m_q.to(m_ptr.dtype.element_ty))
    tl.store(m_scale_ptr + pid, m_scale)

    v = tl.where(mask, v, 0.0)
    if V_SQRT:
        v = tl.sqrt(tl.where(v != v, v, tl.maximum(v, 0.0)))  # clamp(min=0) keeping NaN, as the torch path does
    v_scale = _block_scale(v, V_MAX)
    v_scaled = v * v_scale
    if V_FP8:
        v_scaled = _to_fp8_values(v_scaled, V_MAX, V_MANTISSA, V_MIN_EXP, V_NAN_BITS, EXPLICIT_ROUNDING)
    else:
        v_scaled = _saturate(v_scaled, V_MAX)
    tl.store(v_ptr + offs, v_scaled.to(v_ptr.dtype.element_ty))
    tl.store(v_scale_ptr + pid, v_scale)


def state_constants(dtype: torch.dtype) -> dict:
    """The constexprs that describe a moment's storage format to the kernel: the per-tensor casts' for FP8, the
    saturation limit alone for float16 (the conversion to float16 rounds by itself)."""
    if dtype == torch.float16:
        return {"FP8_MAX": FP16_MAX, "MANTISSA_BITS": 10, "MIN_NORMAL_EXP": -14, "NAN_BITS": 0}
    return format_constants(dtype)


def kernel_formats(m_constants: dict, v_constants: dict) -> dict:
    """The kernel's ``M_*`` and ``V_*`` constexprs from the two moments' :func:`state_constants`."""
    names = {"MAX": "FP8_MAX", "MANTISSA": "MANTISSA_BITS", "MIN_EXP": "MIN_NORMAL_EXP", "NAN_BITS": "NAN_BITS"}
    return {
        f"{moment}_{name}": constants[key]
        for moment, constants in (("M", m_constants), ("V", v_constants))
        for name, key in names.items()
    }


def fused_adam_supported(param: torch.Tensor, fmt_m, fmt_v, master_kind: str) -> tuple[bool, str]:
    """Whether :func:`fused_adam_step` handles this parameter, and why not (the caller falls back to torch)."""
    if fmt_m.dtype not in FP8_STATE_DTYPES or not fmt_m.scaled:
        return False, f"the first moment must be block-scaled FP8; it is {fmt_m}"
    if fmt_v.dtype not in V_DTYPES or not fmt_v.scaled:
        return False, f"the second moment must be block-scaled FP16 or FP8; it is {fmt_v}"
    if fmt_m.block_size != fmt_v.block_size:
        return False, f"both moments need one block size; got {fmt_m.block_size} and {fmt_v.block_size}"
    block = fmt_m.block_size
    if block & (block - 1) or not MIN_BLOCK <= block <= MAX_BLOCK:
        return False, f"block_size={block} must be a power of two in [{MIN_BLOCK}, {MAX_BLOCK}]"
    if master_kind not in MASTER_CODES:
        return False, f"master weights {master_kind!r} are not fused (supported: {sorted(MASTER_CODES)})"
    if not param.is_contiguous():
        return False, "the parameter is not contiguous"
    return device_status(param.device)


def fused_adam_step(
    param: torch.Tensor, grad: torch.Tensor, state: dict, fmt_m, fmt_v, master_kind: str, *, step: int,
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, decoupled_weight_decay: bool,
    maximize: bool = False,
) -> None:
    """One AdamW/Adam step on ``param`` (local tensor) and its FP8 ``state`` in place (``step`` counts from 1)."""
    ok, reason = fused_adam_supported(param, fmt_m, fmt_v, master_kind)
    if not ok:
        require_triton("fused_adam_step", param.device)
        raise ValueError(f"fused_adam_step cannot take this parameter: {reason}. Use the FP8Optimizer torch path.")
    n, block = param.numel(), fmt_m.block_size
    grad = grad.contiguous().view(-1)
    if master_kind == "fp32":
        master = state["master"]
    elif master_kind in REMAINDER_KINDS:
        master = state["master_remainder"]
    else:
        master = param  # unused by the kernel
    param_view = param.view(torch.int16) if master_kind in REMAINDER_KINDS else param
    m_consts, v_consts = state_constants(fmt_m.torch_dtype), state_constants(fmt_v.torch_dtype)
    grid = (triton.cdiv(n, block),)
    _fp8_adam_kernel[grid](
        param_view.view(-1), grad, master.view(-1), state["exp_avg"], state["exp_avg_scale"], state["exp_avg_sq"],
        state["exp_avg_sq_scale"], n,
        lr, beta1, beta2, eps, weight_decay, lr / (1 - beta1**step), math.sqrt(1 - beta2**step),
        BLOCK=block, MASTER=MASTER_CODES[master_kind], DECOUPLED=decoupled_weight_decay, MAXIMIZE=maximize,
        **kernel_formats(m_consts, v_consts), V_FP8=fmt_v.dtype in FP8_STATE_DTYPES, V_SQRT=fmt_v.transform == "sqrt",
        EXPLICIT_ROUNDING=explicit_rounding(), num_warps=adam_num_warps(block),
    )
