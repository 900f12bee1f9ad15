"""Rowwise scaling (torchao's ``rowwise`` and ``rowwise_with_gw_hp``): one scale per row of each GEMM operand.

Each GEMM casts its operands from high precision along its own reduction dimension (:mod:`fp8_lightning.rowwise`
holds the math). With ``high_precision_wgrad`` the weight gradient is computed in high precision and the weight of
the input-gradient GEMM is scaled per tensor.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from fp8_lightning.fine_grained import SCALE_BYTES, fine_operands, high_precision_gemm, pack_shard, row_mm
from fp8_lightning.formats import Format, fp8_dtype
from fp8_lightning.groups import StackedWeights
from fp8_lightning.gemm_routes import (
    CUBLAS_ROWWISE_MIN_CUDA,
    GemmRoute,
    arch_name,
    cuda_name,
    emulated_on_gpu,
    native,
    native_grouped_rowwise,
    native_grouped_triton,
)
from fp8_lightning.kernels.fine_grained_layout import ROWWISE_TILES
from fp8_lightning.ops import dispatch
from fp8_lightning.quantize import HIGH_PRECISION, ROW, Quantized, to_fp8_saturated, wide
from fp8_lightning.recipes.base import check_flags, invalid
from fp8_lightning.recipes.fine_grained import FineGrainedRecipe
from fp8_lightning.rowwise import (
    dequantize_rowwise,
    high_precision_operand,
    quantize_rowwise,
    rowwise_scale,
    tensorwise_column_operand,
)
from fp8_lightning.scaling import max_across
from fp8_lightning.rowwise_grouped import (
    RowwiseGroupedGemm,
    grouped_columnwise,
    native_unavailable_reason,
    stacked_columns,
)
from fp8_lightning.settings import settings
from fp8_lightning.triton_grouped import TritonRowwiseGroupedGemm, triton_arch_reason, triton_unavailable_reason


@dataclasses.dataclass(frozen=True)
class RowwiseScaling(FineGrainedRecipe):
    """One scale per row of every GEMM operand, taken along the GEMM's reduction dimension (current scaling).

    ``scale = fp8_max / max(amax_row, eps)`` (torchao's rule, rounded down to a power of two when
    ``power_of_2_scales``); a row whose amax is inf or NaN gets scale 1. Each of the three GEMMs casts its operands
    from high precision along its own reduction dimension. ``high_precision_wgrad=True`` is torchao's
    ``rowwise_with_gw_hp``: the weight gradient is computed in high precision and the weight of the input-gradient
    GEMM is scaled per tensor. Defaults (E4M3 everywhere, power-of-two scales) are torchao's ``rowwise``.

    Args:
        fp8_format: the FP8 formats (``Format.HYBRID``: E4M3 forward, E5M2 gradients; ``Format.E4M3``: E4M3
            everywhere), as an enum or its name.
        fprop_fast_accum: cuBLAS's fast accumulation for the forward GEMM on CUDA.
        grad_fast_accum: cuBLAS's fast accumulation for the two backward GEMMs on CUDA.
        power_of_2_scales: round scales down to a power of two (the default).
        high_precision_wgrad: run the weight-gradient GEMM in high precision (torchao's
            ``rowwise_with_gw_hp``).
        eps: the smallest amax a scale is made from.
    """

    name: ClassVar[str] = "rowwise"
    operand_kind: ClassVar = ROW

    fp8_format: Format = Format.E4M3
    power_of_2_scales: bool = True
    high_precision_wgrad: bool = False
    eps: float = 1e-12

    def __post_init__(self) -> None:
        super().__post_init__()
        check_flags(self, "power_of_2_scales", "high_precision_wgrad")
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or not 0 < self.eps < 1:
            raise invalid(type(self).__name__, "eps", self.eps, "a number in (0, 1)")
        object.__setattr__(self, "eps", float(self.eps))

    # -- the layer ------------------------------------------------------------------------------------------

    def fine_copies(self, role, x, dtype, columnwise, cast):
        """A scale per row along K for fprop; for ``x.T`` a scale per column of ``x``, or with a high-precision
        weight gradient ``x.T`` itself (and ``W.T`` with one scale for dgrad)."""
        per_row, per_column = ROWWISE_TILES
        row = cast(x, dtype, per_row, self.power_of_2_scales, self.eps)[0]
        if not columnwise:
            return row, None
        if not self.high_precision_wgrad:
            return row, cast(x, dtype, per_column, self.power_of_2_scales, self.eps)[0]
        if role == "weight":
            return row, tensorwise_column_operand(x, dtype, self.eps, self.power_of_2_scales)
        return row, high_precision_operand(x)

    # -- grouped GEMMs (mixtures of experts) ----------------------------------------------------------------

    def grouped_operands(self, role, x, bounds, dtype, columnwise, state, record):
        """The rowwise copy is one cast of ``x``; the columnwise copies of every group come from one grouped cast
        (:func:`~fp8_lightning.rowwise_grouped.grouped_columnwise`: the bits of casting each group on its own, laid
        out as the 2-D x 2-D grouped GEMM reads them). With a high-precision weight gradient, as every recipe."""
        if self.high_precision_wgrad:
            return super().grouped_operands(role, x, bounds, dtype, columnwise, state, record)
        row = self.cast(role, x, dtype, False, True, state, record)[0]
        if not columnwise:
            return row, None
        cast = dispatch.grouped_column_caster(x)
        return row, grouped_columnwise(x, bounds, dtype, self.eps, self.power_of_2_scales, cast)

    def grouped_weight_operands(self, weight, dtype, states, record):
        """Every expert's operands from two casts, whatever the number of experts: ``weight`` (E, N, K) as E*N rows,
        and its transpose as E*K rows (a scale per column of an expert's weight is a scale per row of its
        transpose): the bits of casting each expert on its own. With a high-precision weight gradient dgrad's
        weight has one scale per expert, so each expert is cast on its own."""
        if self.high_precision_wgrad:
            return super().grouped_weight_operands(weight, dtype, states, record)
        experts, n, k = weight.shape
        stacked = weight.reshape(experts * n, k)  # a copy where the experts are stored (E, K, N)
        rows = self.cast("weight", stacked, dtype, False, True, None, record)[0]
        cast = dispatch.grouped_column_caster(stacked) if weight.is_contiguous() else None
        if cast is not None:  # one launch, the codes written transposed: no transposed copy of the weight
            columns = stacked_columns(stacked.view(experts, n, k), dtype, self.eps, self.power_of_2_scales, cast)
        else:  # (E, K, N) storage: W.T's rows are a view
            flipped = weight.transpose(1, 2).reshape(experts * k, n)
            columns = self.cast("weight", flipped, dtype, False, True, None, record)[0]
        return StackedWeights(rows, columns, experts)

    def traced_grouped_columns(self, x, offs, dtype, role):
        """A scale per group and column from one scattered amax over each group's tokens (the rowwise scale rule),
        and each token's values with its group's scales: the bits of casting each group on its own. With a
        high-precision weight gradient the values are ``x``'s own."""
        if self.high_precision_wgrad:
            return x.float()
        group = torch.searchsorted(offs.to(torch.int64), torch.arange(x.shape[0], device=x.device), right=True)
        magnitude = x.detach().abs().float()
        index = group.unsqueeze(1).expand(x.shape)
        amax = magnitude.new_zeros(offs.shape[0], x.shape[1]).scatter_reduce(0, index, magnitude, "amax")
        scale = rowwise_scale(amax, dtype, self.eps, self.power_of_2_scales)[group]  # (M, K): each token's group's
        return dequantize_rowwise(to_fp8_saturated(wide(x.detach()) * scale, dtype), scale)

    def grouped_native(self, device, experts):
        """One launch per GEMM: ``torch._scaled_grouped_mm`` where it takes this recipe's operands on ``device``,
        else the Triton grouped GEMM; ``FP8_LIGHTNING_GROUPED_GEMM`` picks (``auto``: torch's where it runs)."""
        if self._grouped_unsupported_reason() or settings().gemm == "emulate" or settings().emulate:
            return None
        torch_ok = native_unavailable_reason(device, experts) is None
        if torch_ok and settings().grouped_gemm != "triton":
            return RowwiseGroupedGemm(self.fprop_fast_accum, self.grad_fast_accum)
        if triton_unavailable_reason(device) is None:
            return TritonRowwiseGroupedGemm(self.fprop_fast_accum, self.grad_fast_accum)
        return RowwiseGroupedGemm(self.fprop_fast_accum, self.grad_fast_accum) if torch_ok else None

    def grouped_gemm_route(self, capability, cuda, has_grouped_api) -> GemmRoute:
        # GroupedBlas.cpp (_scaled_grouped_mm_cuda): e4m3 x e4m3 with float32 rowwise scales; CUTLASS's grouped kernel
        # is built for sm_90 in torch 2.11 (sm_100 arrived with PR #188063, after 2.11)
        # torch lacks: the Triton grouped GEMM (sm_89+, the table's every architecture); FP8_LIGHTNING_GROUPED_GEMM
        reason = self._grouped_unsupported_reason()
        where = arch_name(capability)
        if reason is not None:
            return emulated_on_gpu(f"grouped GEMMs emulated: {reason}")
        torch_reason = "torch has no torch._scaled_grouped_mm" if not has_grouped_api else None
        if torch_reason is None and capability[0] != 9:
            torch_reason = f"{where}: torch 2.11's rowwise grouped kernel is built for sm_90 only"
        if torch_reason is None and settings().grouped_gemm != "triton":
            return native_grouped_rowwise(f"{where}, {cuda_name(cuda)}")
        triton_reason = triton_arch_reason(capability)
        if triton_reason is not None:
            return emulated_on_gpu(f"grouped GEMMs emulated: {torch_reason}; {triton_reason}")
        return native_grouped_triton(f"{where}: {torch_reason or 'FP8_LIGHTNING_GROUPED_GEMM=triton'}")

    def _grouped_unsupported_reason(self) -> str | None:
        if self.high_precision_wgrad:
            return "high_precision_wgrad=True scales dgrad's weight per tensor (the native route is rowwise only)"
        if self.fp8_format is not Format.E4M3:
            return (f"fp8_format={self.fp8_format.name}: the grouped kernel multiplies e4m3 operands only (E5M2 "
                    "gradients); use fp8_format='E4M3'")
        return None

    def traced_plan(self, device, out_dtype, emulate):
        wgrad_kind = HIGH_PRECISION if self.high_precision_wgrad else ROW
        return self.fine_plan(device, out_dtype, emulate, wgrad_kind=wgrad_kind)

    # -- sequence parallelism -------------------------------------------------------------------------------

    def sequence_cast(self, x, dtype, state, record, group, columnwise=True):
        """The fprop copy scales rows (whole on each rank); the wgrad copy scales columns, which span every rank's
        tokens, so its column amaxes are agreed first (one MAX all-reduce of K values). With a high-precision weight
        gradient ``x.T`` stays unquantized: None (gathered in high precision)."""
        if self.high_precision_wgrad:
            return None
        row = self.cast("input", x, dtype, False, True, state, record)[0]
        if not columnwise:
            return row, None
        column_amax = max_across(x.detach().abs().amax(dim=0, keepdim=True).float(), group)[0]
        data, scale = quantize_rowwise(x, dtype, 0, self.eps, self.power_of_2_scales, column_amax)
        return row, Quantized(data.t(), scale.t(), ROW)

    def sequence_gather(self, row, column, gather):
        """The column scales were agreed before the cast: the columnwise codes travel without them."""
        gathered_row = Quantized(gather(row.data, 0), gather(row.scale, 0), ROW)
        return gathered_row, None if column is None else Quantized(gather(column.data, 1), column.scale, ROW)

    # -- FSDP2 ----------------------------------------------------------------------------------------------

    def fsdp_pack(self, shard, module, global_amax):
        """Each row's K codes, then the 4 bytes of its float32 scale."""
        data, scale = quantize_rowwise(shard, fp8_dtype(self.fp8_format), -1, self.eps, self.power_of_2_scales)
        return pack_shard(data, scale, SCALE_BYTES), None

    def fsdp_unpack(self, gathered, shard_rows, k, metadata):
        data = gathered[:, :k].view(fp8_dtype(self.fp8_format))
        return Quantized(data, gathered[:, k : k + SCALE_BYTES].contiguous().view(torch.float32), ROW)

    def fsdp_operands(self, gathered, scaling, metadata, record, columnwise=True):
        """dgrad needs W scaled down its columns, which no rank can compute from its rows: it is quantized from the
        gathered weight dequantized exactly (a second rounding in dgrad only, as MXFP8 does)."""
        row = Quantized(gathered.data.contiguous(), gathered.scale.contiguous(), ROW)  # dense for the GEMM
        if not columnwise:
            return row, None
        values = dequantize_rowwise(row.data, row.scale)
        return row, fine_operands(self, "weight", values, row.data.dtype, columnwise=True)[1]

    def fsdp_experts_operands(self, gathered, scaling, metadata, record):
        """Stacked as :meth:`grouped_weight_operands` stacks them (a grouped kernel reads the stacked casts), W_e.T's
        rows re-quantized from the exactly dequantized gathered weights, as for a linear layer."""
        if self.high_precision_wgrad:
            return super().fsdp_experts_operands(gathered, scaling, metadata, record)
        experts, (n, k) = len(gathered), gathered[0].data.shape
        rows = Quantized(torch.cat([q.data for q in gathered]), torch.cat([q.scale for q in gathered]), ROW)

        def columns() -> Quantized:  # made where used: a forward needs rows only
            values = dequantize_rowwise(rows.data, rows.scale).view(experts, n, k)
            flipped = values.transpose(1, 2).reshape(experts * k, n)
            return self.cast("weight", flipped, rows.data.dtype, False, True, None, record)[0]

        return StackedWeights(rows, columns, experts)

    # -- cost model -----------------------------------------------------------------------------------------

    def fp8_gemms(self) -> int:
        return 2 if self.high_precision_wgrad else 3

    def gemm_route(self, capability, cuda, has_scaled_mm_v2) -> GemmRoute:
        # ScaledBlas.cpp (_scaled_rowwise_rowwise): cuBLAS's rowwise GEMM on sm_90 with cuBLAS 12.9+, torch's CUTLASS
        # kernel (f8f8bf16_rowwise) on other architectures and older CUDA
        where = f"{arch_name(capability)}, {cuda_name(cuda)}"
        if capability[0] == 9 and cuda is not None and cuda >= CUBLAS_ROWWISE_MIN_CUDA:
            return native("cuBLAS rowwise-scaled GEMM (torch._scaled_mm)", where)
        return native("torch's CUTLASS rowwise kernel (torch._scaled_mm)",
                      f"{where}: cuBLAS's rowwise GEMM needs sm_90 and CUDA 12.9+")


ROW.implement(
    gemm=row_mm,
    to_f32=lambda q: dispatch.fast_fp8_to_float32(q.data, q.cache.nan_free),
    dequantize=lambda q, out_dtype: dispatch.fast_dequantize_with_scale(q.data, q.scale, out_dtype),
    scale_multiplier=lambda q, k: q.scale.float(),
    representative_scale=lambda q: q.scale.float().amin().reshape(()),
)
HIGH_PRECISION.implement(
    gemm=high_precision_gemm,
    to_f32=lambda q: q.data.float(),
    dequantize=lambda q, out_dtype: dispatch.operand_f32(q).to(out_dtype),
    scale_multiplier=lambda q, k: q.scale.float(),
    representative_scale=lambda q: q.scale.float().amin().reshape(()),
)

__all__ = ["RowwiseScaling"]
