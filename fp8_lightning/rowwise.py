"""Rowwise scaling: one scale per row of every GEMM operand, along the GEMM's reduction dimension.

The reference math (and the ground truth for accelerated casts), following torchao.float8's ``AXISWISE``
granularity, so that the casts agree with torchao bit for bit::

    amax_r  = max |x[r, :]|                          one per row, along the reduction dimension K
    scale_r = fp8_max / max(amax_r, eps)             divided in float64, rounded once to float32
    scale_r = 2**floor(log2(scale_r))                with power-of-two scales (the default, as torchao's)
    scale_r = 1                                      where amax_r is inf or NaN (such rows stay inf/NaN)
    data    = saturate(x * scale_r)                  x ~= data * (1 / scale_r)

A rowwise scale belongs to one reduction dimension, so every GEMM of the layer casts its own copies from high
precision (nothing is transposed in FP8)::

    fprop   y  = x @ W.T     x: rows of x (along K)            W: rows of W (along K)
    dgrad   dx = g @ W       g: rows of g (along N)            W.T: columns of W (along N)
    wgrad   dW = g.T @ x     g.T: columns of g (along M)       x.T: columns of x (along M)

The design in full: ``docs/design/notes.md``, section ``fp8_lightning.rowwise``.
"""

from __future__ import annotations

import torch

from fp8_lightning import cuda_rules
from fp8_lightning.quantize import (
    HIGH_PRECISION,
    Quantized,
    ROW,
    fp8_to_float32,
    scaled_mm_layout,
    current_scale,
    to_fp8_saturated,
    wide,
)



def rowwise_scale(row_amax: torch.Tensor, dtype: torch.dtype, eps: float, power_of_2: bool) -> torch.Tensor:
    """The scale of each row from its amax: :func:`~fp8_lightning.quantize.tensorwise_scale` per element, and 1
    where the amax is inf or NaN."""
    return current_scale(row_amax.float(), dtype, eps, power_of_2)


def quantize_rowwise(
    x: torch.Tensor, dtype: torch.dtype, dim: int = -1, eps: float = 1e-12, power_of_2: bool = True,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale)`` of a 2-D ``x`` with one scale per slice along ``dim`` (-1: per row, 0: per column); the
    scale keeps the reduced dimension (shape (M, 1) or (1, K)) so that ``data = saturate(x * scale)``. ``amax``:
    each slice's amax where it is known already (agreed across the ranks that hold parts of the slices)."""
    if x.dim() != 2 or x.shape[dim] == 0:
        raise ValueError(
            f"quantize_rowwise expects a 2-D tensor with a non-empty dimension {dim}; got shape {tuple(x.shape)}."
        )
    if amax is None:
        amax = x.detach().abs().amax(dim=dim, keepdim=True).float()
    scale = rowwise_scale(amax, dtype, eps, power_of_2)
    return to_fp8_saturated(wide(x.detach()) * scale, dtype), scale


def dequantize_rowwise(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``data * (1 / scale)`` in float32, the scale broadcast over its slice (the inverse of the cast)."""
    return data.float() * scale.reciprocal()


def tensorwise_column_operand(x: torch.Tensor, dtype: torch.dtype, eps: float, power_of_2: bool) -> Quantized:
    """The operand of ``x.T`` with one scale for the whole tensor, repeated per row as a rowwise GEMM takes it."""
    amax = x.detach().abs().amax().float().reshape(1, 1)
    scale = rowwise_scale(amax, dtype, eps, power_of_2)
    data = to_fp8_saturated(wide(x.detach()) * scale, dtype)
    return Quantized(data.t(), scale.expand(x.shape[1], 1), ROW)


def high_precision_operand(x: torch.Tensor) -> Quantized:
    """``x.T`` unquantized, for a GEMM computed in high precision (kind ``"hp"``, no scale)."""
    return Quantized(x.detach().t(), x.new_empty((0,), dtype=torch.float32), HIGH_PRECISION)


# --------------------------------------------------------------------------------------------------------
# GEMMs
# --------------------------------------------------------------------------------------------------------


def rowwise_scaled_mm_args(a: Quantized, b: Quantized) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mat1, mat2, scale_a, scale_b)`` for ``torch._scaled_mm`` computing ``a @ b.T`` with rowwise scales in
    cuBLAS's layout: mat1 (M, K) row-major, mat2 (K, N) column-major, K and N zero-padded to multiples of 16;
    scale_a (M, 1) and scale_b (1, N) contiguous float32 dequantization factors (``1 / scale``; the padded
    columns get 1)."""
    mat1, padded_b = scaled_mm_layout(a.data, b.data)
    mat2 = padded_b.t()
    scale_a = a.inverse_scale().reshape(-1, 1).contiguous()  # the CUDA cast kernels wrote it: no copy
    inverse_b = b.inverse_scale().reshape(-1)
    extra = mat2.shape[1] - inverse_b.numel()
    scale_b = (torch.cat([inverse_b, inverse_b.new_ones(extra)]) if extra else inverse_b).reshape(1, -1)
    return mat1, mat2, scale_a, scale_b


def codes_f32(q: Quantized) -> torch.Tensor:
    """The float32 values of a rowwise operand's codes, which the CPU GEMM multiplies: ``q.cache.f32`` where the cast
    made them (the CPU codec), else decoded here."""
    return q.cache.f32 if q.cache.f32 is not None else fp8_to_float32(q.data)


def direct_output(device: torch.device, out_dtype: torch.dtype) -> bool:
    """Whether the rowwise ``torch._scaled_mm`` on CUDA ``device`` writes ``out_dtype`` itself
    (:func:`fp8_lightning.cuda_rules.rowwise_direct_output`): bf16 always, fp16 and fp32 where cuBLASLt runs it
    (sm_90 with CUDA 12.9+). The device is asked only for fp16 and fp32 outputs."""
    if out_dtype == torch.bfloat16:
        return True
    if out_dtype not in (torch.float16, torch.float32) or not torch.cuda.is_available():
        return False
    version = torch.version.cuda
    cuda = tuple(int(p) for p in version.split(".")[:2]) if version else None
    return cuda_rules.rowwise_direct_output(torch.cuda.get_device_capability(device), cuda, out_dtype)


def rowwise_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """``a @ b.T`` for rowwise operands (M, K) and (N, K), scales applied to the float32 accumulator.

    CPU: a float32 matmul of the codes' exact values (:func:`codes_f32`), then ``* (1 / scale_a) * (1 / scale_b)``:
    with power-of-two scales the bits of CPU ``torch._scaled_mm`` (measured equal; the codes decode several times
    faster than its float8 conversion), with float32 scales within a rounding of them. CUDA: ``torch._scaled_mm`` in
    cuBLAS's layout (:func:`rowwise_scaled_mm_args`), writing the output dtype itself where torch's rowwise kernel
    does (:func:`direct_output`: bf16 everywhere, fp16 and fp32 on sm_90 with CUDA 12.9+); elsewhere an fp16 or
    fp32 output takes the tensorwise kernel with unit scales (float32 output) and ``scale_a * scale_b`` applied
    after it, the same arithmetic.
    ``fast_accum``: cuBLAS's fast accumulation (``use_fast_accum``), as for the per-tensor GEMMs; the CPU GEMM
    accumulates in float32 either way."""
    if a.data.is_cpu:
        acc = codes_f32(a) @ codes_f32(b).t()
        inverse_a, inverse_b = a.inverse_scale().reshape(-1, 1), b.inverse_scale().reshape(1, -1)
        return acc.mul_(inverse_a).mul_(inverse_b).to(out_dtype)  # in place: acc is this GEMM's own
    n = b.data.shape[0]
    mat1, mat2, scale_a, scale_b = rowwise_scaled_mm_args(a, b)
    if direct_output(a.data.device, out_dtype):
        out = torch._scaled_mm(
            mat1, mat2, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=fast_accum
        )
    else:
        one = scale_a.new_ones(())
        out = torch._scaled_mm(
            mat1, mat2, scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=fast_accum
        ) * (scale_a * scale_b)
    return out.narrow(1, 0, n).to(out_dtype)  # the padded columns cut (narrow: also on fake CUDA tensors)


def high_precision_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b.T`` of two unquantized operands (kind ``"hp"``) in their own dtype, as ``torch.mm`` computes it."""
    return torch.mm(a.data, b.data.t()).to(out_dtype)
