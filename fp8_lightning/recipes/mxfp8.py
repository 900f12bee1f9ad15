"""MXFP8 (OCP MX): blocks of ``block_size`` consecutive elements along K share one power-of-two (E8M0) scale.

Block scales follow the reduction dimension, so each GEMM operand is quantized from the high-precision tensor along
its own K: the rowwise copy for fprop, the columnwise copy (zero-padded to whole blocks) for the backward GEMMs. The
operand kind ``MX`` runs cuBLAS's native MX GEMM (sm100+), the Triton MX GEMM, or the dequantized operands.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from fp8_lightning.ops import dispatch
from fp8_lightning.formats import NATIVE_MX_MIN_CAPABILITY, NATIVE_MX_MIN_CUDA, Format, fp8_dtype
from fp8_lightning.gemm_routes import GemmRoute, arch_name, cuda_name, emulated_on_gpu, native, triton_mx
from fp8_lightning.gemm import mx_mm
from fp8_lightning.groups import StackedWeights, padded_rows
from fp8_lightning.ops.layer import mx_operand_cast, operand_values
from fp8_lightning.mx import E8M0_DTYPE, e8m0_to_float
from fp8_lightning.mx_grouped import MX_GROUPED_GEMM, MXGroupedGemm, grouped_mx_columns, mx_native_unavailable_reason
from fp8_lightning.quantize import MX, Quantized
from fp8_lightning.kernels.availability import MX_BLOCK_SIZES, SCALE_ROUNDINGS
from fp8_lightning.recipes.base import Recipe, multiple_reason, invalid
from fp8_lightning.settings import settings


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8: ``block_size`` consecutive elements along K share one power-of-two (E8M0) scale.

    ``scale_rounding="rceil"`` (cuBLAS/TE) picks the smallest power of two that keeps every block value within
    the FP8 range; ``"floor"`` (OCP MX v1.0) uses ``floor(log2(amax)) - emax`` and saturates the few values that
    overflow. Scales are powers of two by construction. Data is E4M3; ``fp8_format=HYBRID`` makes the output
    gradient E5M2.

    Args:
        fp8_format: the FP8 formats (``Format.HYBRID``: E4M3 forward, E5M2 gradients; ``Format.E4M3``: E4M3
            everywhere), as an enum or its name.
        fprop_fast_accum: cuBLAS's fast accumulation for the forward GEMM on CUDA.
        grad_fast_accum: cuBLAS's fast accumulation for the two backward GEMMs on CUDA.
        block_size: elements per block along the reduction dimension (32, as cuBLAS and OCP MX; 64 and 128 run
            on the Triton kernel).
        scale_rounding: ``"rceil"`` (cuBLAS, TransformerEngine) or ``"floor"`` (OCP MX v1.0).
    """

    name: ClassVar[str] = "mxfp8"
    operand_kind: ClassVar = MX

    fp8_format: Format = Format.E4M3
    block_size: int = 32
    scale_rounding: str = "rceil"

    def __post_init__(self) -> None:
        super().__post_init__()
        cls = type(self).__name__
        if self.block_size not in MX_BLOCK_SIZES or isinstance(self.block_size, bool):
            raise invalid(cls, "block_size", self.block_size, f"one of {MX_BLOCK_SIZES} (OCP MX uses 32)")
        if self.scale_rounding not in SCALE_ROUNDINGS:
            raise invalid(cls, "scale_rounding", self.scale_rounding, " or ".join(SCALE_ROUNDINGS))

    def shape_unsupported_reason(self, in_features, out_features, names=("in_features", "out_features")):
        return multiple_reason(self, in_features, out_features, self.block_size, names)

    def cast(self, role, x, dtype, columnwise, columnwise_f32, state, record):
        return dispatch.fast_quantize_mx_operands(
            x, self.block_size, self.scale_rounding, dtype, columnwise, columnwise_f32
        )

    def traced_cast(self, x, state, plan, role, dtype, columnwise, record):
        return mx_operand_cast(x, self.block_size, self.scale_rounding, dtype, columnwise)

    def grouped_operands(self, role, x, bounds, dtype, columnwise, state, record):
        """The rowwise copy is one cast of ``x``; every group's columnwise copy comes from one cast of a layout where
        each group starts at a whole block (:func:`~fp8_lightning.mx_grouped.grouped_mx_columns`): the bits of
        casting each group on its own, laid out as the 2-D x 2-D grouped GEMM reads them."""
        row = self.cast(role, x, dtype, False, True, state, record)[0]
        if not columnwise:
            return row, None
        return row, grouped_mx_columns(x, bounds, dtype, self.block_size, self.scale_rounding)

    def grouped_native(self, device, experts):
        """One ``torch._scaled_grouped_mm`` launch per GEMM on sm_100 (torch's MSLK MXFP8 grouped kernel), else None
        (emulated)."""
        if self._grouped_unsupported_reason() or settings().gemm == "emulate" or settings().emulate:
            return None
        return MXGroupedGemm() if mx_native_unavailable_reason(device, experts) is None else None

    def grouped_fallback_reason(self, device, experts):
        """On a CUDA device of compute capability 10.x that cannot run torch's MXFP8 grouped kernel (a build without
        it, a probe call that fails, too many experts), why; elsewhere None (the route says why)."""
        if device.type != "cuda" or self._grouped_unsupported_reason() or settings().gemm == "emulate":
            return None
        reason = mx_native_unavailable_reason(device, experts)
        return None if reason is None or reason.startswith("sm_") else reason

    def grouped_gemm_route(self, capability, cuda, has_grouped_api) -> GemmRoute:
        # GroupedBlas.cpp (_scaled_grouped_mm_cuda): e4m3 operands with e8m0 scales go to MSLK's mx8mx8bf16_grouped_mm,
        # built for sm_100a / sm_103a in torch 2.11's CUDA wheels; _scaled_mm_allowed_device admits 9.x and 10.x only
        arch = arch_name(capability)
        reason = self._grouped_unsupported_reason()
        if reason is None and not has_grouped_api:
            reason = "torch has no torch._scaled_grouped_mm"
        if reason is None and capability[0] != 10:
            reason = f"{arch}: torch's MXFP8 grouped kernel runs on compute capability 10.x only"
        if reason is not None:
            return emulated_on_gpu(f"grouped GEMMs emulated: {reason}")
        return native(MX_GROUPED_GEMM, f"{arch}, {cuda_name(cuda)} (needs a torch built with MSLK / FBGEMM GenAI)")

    def _grouped_unsupported_reason(self) -> str | None:
        if self.block_size != 32:
            return f"block_size={self.block_size}: torch's MXFP8 grouped kernel takes blocks of 32"
        if self.fp8_format is not Format.E4M3:
            return (f"fp8_format={self.fp8_format.name}: the MXFP8 grouped kernel multiplies e4m3 operands only (E5M2 "
                    "gradients); use fp8_format='E4M3'")
        return None

    def grouped_weight_operands(self, weight, dtype, states, record):
        """Every expert's operands from two casts, whatever the number of experts: ``weight`` (E, N, K) as E*N rows
        (blocks along K) and its transpose as E*K rows (blocks along N, each inside one expert, N being a whole
        number of blocks): the bits of casting each expert on its own."""
        experts, n, k = weight.shape
        rows = dispatch.fast_quantize_mx_operand(
            weight.reshape(experts * n, k), self.block_size, self.scale_rounding, dtype
        )
        columns = dispatch.fast_quantize_mx_operand(
            weight.transpose(1, 2).reshape(experts * k, n), self.block_size, self.scale_rounding, dtype
        )
        return StackedWeights(rows, columns, experts)

    def traced_grouped_columns(self, x, offs, dtype, role):
        """Each group's tokens padded with zeros to whole blocks of 32 and the padded tensor's transpose cast along
        the tokens: the blocks of casting each group on its own."""
        index, length = padded_rows(offs, x.shape[0], self.block_size)
        padded = x.new_zeros(length, x.shape[1]).index_copy(0, index, x)
        data, scale, _, _ = mx_operand_cast(padded.t(), self.block_size, self.scale_rounding, dtype, False)
        return operand_values(data, scale, MX).t()[index]  # back to x's rows

    # -- tensor and sequence parallelism ---------------------------------------------------------------------

    def tensor_parallel_block(self) -> int:
        """A weight's rowwise copy has blocks along K and its columnwise copy blocks along N."""
        return max(self.block_size, 16)

    def sequence_block(self) -> int:
        return self.block_size

    # -- FSDP2 ----------------------------------------------------------------------------------------------

    def fsdp_unsupported_reason(self, rows: int, cols: int, world_size: int) -> str | None:
        if cols % self.block_size:
            return f"in_features={cols} is not divisible by the MX block size {self.block_size}"
        return None

    def fsdp_pack(self, shard, module, global_amax):
        """Blocks run along K and FSDP2 shards rows, so each rank quantizes its rows; each row carries its K data
        bytes, then its K / block scale bytes (one all-gather input per weight)."""
        q = dispatch.fast_quantize_mx_operand(shard, self.block_size, self.scale_rounding, fp8_dtype(self.fp8_format))
        return torch.cat([q.data.view(torch.uint8), q.scale.view(torch.uint8)], dim=1), None

    def fsdp_unpack(self, gathered, shard_rows, k, metadata):
        return Quantized(gathered[:, :k].view(fp8_dtype(self.fp8_format)), gathered[:, k:].view(E8M0_DTYPE), MX)

    def fsdp_operands(self, gathered, scaling, metadata, record, columnwise=True):
        """dgrad's columnwise copy is quantized along N from the exactly dequantized gathered weight: no rank
        holds the high-precision weight in full (a second rounding of W in dgrad only)."""
        row = Quantized(gathered.data.contiguous(), gathered.scale.contiguous(), MX)  # dense for the GEMM
        if not columnwise:
            return row, None
        values = dispatch.operand_f32(row)
        return row, dispatch.fast_quantize_mx_columns(values, self.block_size, self.scale_rounding, row.data.dtype)

    def fsdp_experts_operands(self, gathered, scaling, metadata, record):
        """Stacked as :meth:`grouped_weight_operands` stacks them; W_e.T's blocks (along N) re-quantized from the
        exactly dequantized gathered weights, as for a linear layer."""
        experts, (n, k) = len(gathered), gathered[0].data.shape
        rows = Quantized(_cat_bytes([q.data for q in gathered]), _cat_bytes([q.scale for q in gathered]), MX)

        def columns() -> Quantized:  # made where used: a forward needs rows only
            flipped = dispatch.operand_f32(rows).view(experts, n, k).transpose(1, 2).reshape(experts * k, n)
            return dispatch.fast_quantize_mx_operand(flipped, self.block_size, self.scale_rounding, rows.data.dtype)

        return StackedWeights(rows, columns, experts)

    def cast_bytes_per_element(self) -> float:
        """Rowwise and columnwise copies each read bf16 and write codes and block scales."""
        return 2 * (2 + 1 + 1 / self.block_size)

    def gemm_route(self, capability, cuda, has_scaled_mm_v2) -> GemmRoute:
        arch = arch_name(capability)
        if capability < NATIVE_MX_MIN_CAPABILITY:
            return triton_mx(f"{arch} has no MX tensor cores (sm_100 and later have them)")
        if cuda is None or cuda < NATIVE_MX_MIN_CUDA:
            return triton_mx(f"{arch} has MX tensor cores, but the cuBLAS of {cuda_name(cuda)} has no MX GEMM (12.8+)")
        if self.block_size != 32:
            return triton_mx(f"cuBLAS's MX GEMM takes blocks of 32 only; this recipe has block_size={self.block_size}")
        return native("cuBLAS MX block-scaled GEMM (torch._scaled_mm, E8M0 scales)", f"{arch} has MX tensor cores")


def _mx_multiplier(q: Quantized, k: int) -> torch.Tensor:
    block = q.data.shape[-1] // q.scale.shape[-1]
    return e8m0_to_float(q.scale).reciprocal().repeat_interleave(block, dim=-1)[..., :k]


MX.implement(
    gemm=mx_mm,
    to_f32=lambda q: dispatch.fast_dequantize_mxfp8(q.data, q.scale),
    dequantize=lambda q, out_dtype: dispatch.operand_f32(q).to(out_dtype),
    scale_multiplier=_mx_multiplier,
    representative_scale=lambda q: e8m0_to_float(q.scale).amax().reciprocal(),
)


def _cat_bytes(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` of one-byte tensors through uint8 views (CUDA's cat has no float8_e8m0fnu kernel)."""
    return torch.cat([p.view(torch.uint8) for p in parts]).view(parts[0].dtype)

__all__ = ["MXFP8BlockScaling"]
