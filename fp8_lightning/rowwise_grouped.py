"""Rowwise grouped GEMMs on CUDA: the arguments of ``torch._scaled_grouped_mm`` for the three expert GEMMs, as pure
functions of the operands the rowwise recipe casts, and the one grouped launch per GEMM that takes them.

torch 2.11's rules (``_scaled_grouped_mm_cuda`` in ``aten/src/ATen/native/cuda/GroupedBlas.cpp``, the layout checks
of ``GroupedMMUtils.h`` and the per-group checks of ``prepare_grouped_gemm_data`` in ``GroupMMCommon.cuh``):
``mat_a`` row-major and ``mat_b`` column-major in their last two dimensions, both ``float8_e4m3fn``, strides and
``K``, ``N`` multiples of 16 bytes; ``offs`` 1-D int32; float32 scales that multiply the product (``1 / scale``);
bf16 output only; fewer than 1024 groups; CUTLASS's sm_90 kernel. Two cases serve the expert GEMMs:

* 2-D x 3-D (fprop, dgrad): ``mat_a`` (M, K) with a scale per row (M,), ``mat_b`` (E, K, N) with a scale per
  expert and column (E, N); any group size, 0 included (only the 2-D x 2-D case checks group sizes);
* 2-D x 2-D (wgrad): ``mat_a`` (N, M) and ``mat_b`` (M, K) split along M by ``offs``; scales per group and row,
  (E * N,) and (E * K,); out (E, N, K). Each group must be non-empty and, except the last, a multiple of 16 tokens:
  the columnwise copies are laid out with each group zero-padded to a multiple of 16 (an empty group to 16 zero
  tokens, whose product is exactly zero), as torchao pads token groups for the same kernel.

Where torch has no such kernel for the device (sm_89, sm_100 in torch 2.11), or where ``FP8_LIGHTNING_GROUPED_GEMM``
asks for it, the same arguments go to the Triton grouped GEMM (:mod:`fp8_lightning.triton_grouped`).
"""

from __future__ import annotations

import functools

import torch

from fp8_lightning.groups import (
    GroupBounds,
    GroupOperands,
    StackedWeights,
    device_layout,
    group_ends,
    host_token_layout,
    token_layout,
    uniform_layout,
)
from fp8_lightning.quantize import ROW, OperandCache, Quantized, to_fp8_saturated, wide
from fp8_lightning.rowwise import rowwise_scale

GROUP_ALIGN = 16  # tokens: 16 one-byte codes, the TMA's 16-byte alignment of each group's start
MAX_GROUPS = 1023  # "Can't process more than 1024 groups" (group_count < 1024)


class GroupedColumns(GroupOperands):
    """The columnwise copies of a 2-D ``x`` whose rows are sorted into groups, each group's columns scaled along its
    own rows: a sequence of per-group operands (``x[start:end].T``, views; None for an empty group), as
    :meth:`~fp8_lightning.recipes.base.Recipe.grouped_operands` returns them, made on first use (the grouped kernel
    reads only the whole layout), and the whole layout the 2-D x 2-D grouped GEMM reads: ``codes_t`` (K, M_pad),
    each group's tokens at its padded offset (``starts``) and zeros between; ``scale`` (E, K) float32 quantization
    multipliers; ``offs`` the padded cumulative ends (int32, on the device)."""

    def __init__(self, codes_t: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor, starts=(), sizes=(),
                 source_offs: torch.Tensor | None = None):
        self.codes_t, self.scale, self.offs, self.starts, self.sizes = codes_t, scale, offs, starts, sizes
        self.source_offs = source_offs  # the groups' cumulative ends in x's rows, on the device (token_values)

    def token_values(self) -> torch.Tensor:
        """The float32 values (K, M) of every group's operand side by side in ``x``'s row order (each token's codes
        over its group's scales, as each group's operand dequantizes), from the whole layout in one pass."""
        source = self.source_offs
        if source is None:  # the group sizes from the host (a host-to-device copy, no wait)
            source = torch.tensor(self.sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(self.codes_t.device)
        layout = token_layout(source, GROUP_ALIGN, sum(self.sizes))
        values = Quantized(self.codes_t.index_select(1, layout.dest), self.scale.float()[layout.group].t(), ROW)
        return ROW.dequantize(values, torch.float32)

    @functools.cached_property
    def _views(self) -> list[Quantized | None]:
        k = self.codes_t.shape[0]
        return [Quantized(self.codes_t[:, s : s + m], self.scale[e].reshape(k, 1), ROW) if m else None
                for e, (s, m) in enumerate(zip(self.starts, self.sizes))]  # fmt: skip

    def __len__(self) -> int:
        return len(self.sizes)


def grouped_columnwise(
    x: torch.Tensor, bounds: GroupBounds, dtype: torch.dtype, eps: float, power_of_2: bool, cast=None
) -> GroupedColumns:
    """Every group's columnwise copy of ``x`` (M, K), whatever the number of groups: the bits of casting each group's
    ``x[start:end]`` column by column on its own (the rowwise scale rule and saturating cast), laid out padded and
    transposed for the grouped GEMM. ``cast``: the one-launch kernel with
    :func:`~fp8_lightning.ops.triton_ops.triton_grouped_column_cast`'s signature (group bounds read on the device),
    or None for pure torch: the amax of each (group, column) by one scatter, one cast, one copy into the padded
    rows and one transpose."""
    sizes, padded, starts = host_token_layout(bounds, GROUP_ALIGN)
    k, total = x.shape[1], sum(padded)
    offs = getattr(bounds, "offs", None)
    if cast is not None and offs is not None:
        first, counts, out_starts, ends = device_layout(offs.to(x.device, non_blocking=True), GROUP_ALIGN)
        codes, scale, _ = cast(x.detach(), first, counts, out_starts, k * total, total, dtype, power_of_2, eps,
                               GROUP_ALIGN)  # fmt: skip
        codes_t = codes.view(k, total)
    else:
        codes_t, scale, ends = _columnwise_torch(x, bounds, total, dtype, eps, power_of_2)
    source = offs.to(x.device, non_blocking=True) if offs is not None else None
    return GroupedColumns(codes_t, scale, ends, starts, sizes, source)


def _columnwise_torch(x, bounds, total, dtype, eps, power_of_2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes_t (K, M_pad), scale (E, K), the padded ends (int32)) of :func:`grouped_columnwise` in pure torch."""
    experts, (rows, k), device = len(bounds), x.shape, x.device
    layout = token_layout(group_ends(bounds, device), GROUP_ALIGN, rows)
    group = layout.group
    magnitude = x.detach().abs().float()
    amax = magnitude.new_zeros(experts, k).scatter_reduce_(0, group.unsqueeze(1).expand(rows, k), magnitude, "amax")
    scale = rowwise_scale(amax, dtype, eps, power_of_2)  # (E, K)
    codes = to_fp8_saturated(wide(x.detach()) * scale[group], dtype)
    padded_codes = torch.zeros(total, k, dtype=dtype, device=device)
    padded_codes.view(torch.uint8).index_copy_(0, layout.dest, codes.view(torch.uint8))
    return padded_codes.t().contiguous(), scale, layout.ends.to(torch.int32)


def stacked_columns(weight: torch.Tensor, dtype: torch.dtype, eps: float, power_of_2: bool, cast) -> Quantized:
    """The operand of every expert's ``W_e.T`` from a stacked (E, N, K) ``weight`` in one launch of ``cast`` (see
    :func:`grouped_columnwise`): codes (E * K, N), a scale per row, i.e. per column of each expert's weight."""
    experts, n, k = weight.shape
    first, counts, out_starts = uniform_layout(experts, n, k * n, weight.device)
    codes, scale, inverse = cast(weight.reshape(experts * n, k), first, counts, out_starts, experts * k * n, n, dtype,
                                 power_of_2, eps, 1)  # fmt: skip
    cache = OperandCache(inverse=inverse.reshape(-1, 1))
    return Quantized(codes.view(experts * k, n), scale.reshape(-1, 1), ROW, cache)


def _inverse(q: Quantized) -> torch.Tensor:
    return q.inverse_scale().reshape(-1).contiguous()


def fprop_args(x: Quantized, weights: StackedWeights):
    """``(mat_a, mat_b, scale_a, scale_b)`` of ``y_e = x_e @ W_e.T``: ``mat_a`` the (M, K) codes with a scale per
    token, ``mat_b`` the (E, K, N) column-major view of the stacked (E * N, K) codes with a scale per (expert, n)."""
    rows, experts = weights.rows, weights.experts
    n = rows.data.shape[0] // experts
    mat_b = rows.data.reshape(experts, n, -1).transpose(1, 2)
    return x.data, mat_b, _inverse(x), _inverse(rows).reshape(experts, n)


def dgrad_args(g: Quantized, weights: StackedWeights):
    """``(mat_a, mat_b, scale_a, scale_b)`` of ``dx_e = g_e @ W_e``: ``mat_a`` the (M, N) gradient codes, ``mat_b``
    the (E, N, K) column-major view of the stacked transposed weights (E * K, N), a scale per (expert, k)."""
    columns, experts = weights.columns, weights.experts
    k = columns.data.shape[0] // experts
    mat_b = columns.data.reshape(experts, k, -1).transpose(1, 2)
    return g.data, mat_b, _inverse(g), _inverse(columns).reshape(experts, k)


def wgrad_args(g_columns: GroupedColumns, x_columns: GroupedColumns):
    """``(mat_a, mat_b, scale_a, scale_b, offs)`` of ``dW_e = g_e.T @ x_e``: ``mat_a`` the (N, M_pad) gradient
    codes, ``mat_b`` the (M_pad, K) column-major view of the input's (K, M_pad) codes, scales per group and row
    flattened to (E * N,) and (E * K,), and the padded group ends."""
    scale_a = g_columns.scale.reciprocal().reshape(-1)
    scale_b = x_columns.scale.reciprocal().reshape(-1)
    return g_columns.codes_t, x_columns.codes_t.t(), scale_a, scale_b, g_columns.offs


class RowwiseGroupedGemm:
    """The three expert GEMMs of the rowwise recipe as one ``torch._scaled_grouped_mm`` launch each (bf16 out, the
    kernel's only output dtype, converted to the requested one). ``fprop_fast_accum`` / ``grad_fast_accum``: the
    recipe's fast accumulation per GEMM."""

    def __init__(self, fprop_fast_accum: bool, grad_fast_accum: bool):
        self.fprop_fast_accum, self.grad_fast_accum = fprop_fast_accum, grad_fast_accum

    def fprop(self, x: Quantized, weights: StackedWeights, offs: torch.Tensor, out_dtype: torch.dtype):
        mat_a, mat_b, scale_a, scale_b = fprop_args(x, weights)
        return _launch(mat_a, mat_b, scale_a, scale_b, offs, self.fprop_fast_accum).to(out_dtype)

    def dgrad(self, g: Quantized, weights: StackedWeights, offs: torch.Tensor, out_dtype: torch.dtype):
        mat_a, mat_b, scale_a, scale_b = dgrad_args(g, weights)
        return _launch(mat_a, mat_b, scale_a, scale_b, offs, self.grad_fast_accum).to(out_dtype)

    def wgrad(self, g_columns: GroupedColumns, x_columns: GroupedColumns, out_dtype: torch.dtype):
        mat_a, mat_b, scale_a, scale_b, offs = wgrad_args(g_columns, x_columns)
        return _launch(mat_a, mat_b, scale_a, scale_b, offs, self.grad_fast_accum).to(out_dtype)


def _launch(mat_a, mat_b, scale_a, scale_b, offs, fast_accum: bool) -> torch.Tensor:
    return torch._scaled_grouped_mm(
        mat_a, mat_b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=fast_accum
    )


@functools.lru_cache(maxsize=None)
def _device_reason(device: torch.device) -> str | None:
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    capability = torch.cuda.get_device_capability(device)
    if capability[0] != 9:
        return (f"sm_{capability[0]}{capability[1]}: torch 2.11's rowwise grouped kernel (CUTLASS) is built for sm_90 "
                "only (sm_100 came with torch PR #188063)")
    return None


def native_unavailable_reason(device: torch.device, experts: int) -> str | None:
    """Why the rowwise grouped GEMMs cannot run as ``torch._scaled_grouped_mm`` on ``device``, or None."""
    if device.type != "cuda":
        return f"{device.type}: the grouped FP8 kernel is CUDA's"
    if experts > MAX_GROUPS:
        return f"{experts} experts: torch's grouped kernel takes fewer than 1024 groups"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_reason(torch.device("cuda", index))
