"""What delayed and tensorwise scaling share: one scale per tensor, kept in an :class:`OperandScaling` per GEMM role.

A per-tensor operand transposes freely (a transpose does not change its scale), so the backward GEMMs multiply the
transposed FP8 bytes of the forward casts. The family's operand kind, ``TENSOR``, runs the per-tensor GEMM
(``torch._scaled_mm`` on CUDA, the float GEMM on CPU). A subclass says how a fresh scale is made
(:meth:`PerTensorRecipe.just_in_time_scale` and its traced twin :meth:`PerTensorRecipe.traced_scale`); one that keeps
an amax history (delayed) also sets ``keeps_history``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from fp8_lightning.ops import dispatch
from fp8_lightning.formats import fp8_dtype
from fp8_lightning.gemm import per_tensor_mm, per_tensor_scaled_mm
from fp8_lightning.groups import ExpertTensorWeights, RowGroupColumns
from fp8_lightning.gemm_routes import GemmRoute, arch_name, emulated_on_gpu, native, native_grouped_triton
from fp8_lightning.quantize import TENSOR, OperandCache, Quantized, amax, quantize_with_scale, to_fp8_saturated, wide
from fp8_lightning.recipes.base import Recipe
from fp8_lightning.scaling import OperandScaling, finite_or_zero, records_amax
from fp8_lightning.settings import settings
from fp8_lightning.traced import TracedPlan, plan_for
from fp8_lightning.triton_grouped import TritonPerTensorGroupedGemm, triton_arch_reason, triton_unavailable_reason


@dataclasses.dataclass(frozen=True)
class PerTensorRecipe(Recipe):
    """Base of the per-tensor recipes: the layer keeps an :class:`OperandScaling` per GEMM role.

    A subclass defines :meth:`just_in_time_scale` (eager) and :meth:`traced_scale` (traced) with the same bits; the
    rest of the family's behaviour is here.
    """

    per_tensor: ClassVar[bool] = True
    operand_kind: ClassVar = TENSOR
    global_weight_amax: ClassVar[bool] = True
    keeps_history: ClassVar[bool] = False  # scales come from an amax history (advanced once per optimizer step)

    @property
    def history_len(self) -> int:
        return 1

    # -- scales ---------------------------------------------------------------------------------------------

    def just_in_time_scale(self, state: OperandScaling, clean_amax: torch.Tensor, host_amax: float | None):
        """The scale of a cast that computes its own (every cast, or a history's first): from ``clean_amax`` (NaN
        and inf replaced by 0) or the same amax read on the host (``host_amax``, when finite and known)."""
        raise NotImplementedError(f"{type(self).__name__} does not define just_in_time_scale()")

    def traced_scale(self, clean: torch.Tensor, scale: torch.Tensor, flags: torch.Tensor, dtype: torch.dtype):
        """:meth:`just_in_time_scale` as traceable code: ``scale`` is the stored scale, ``flags`` the state's
        ``[initialized, observed]``."""
        raise NotImplementedError(f"{type(self).__name__} does not define traced_scale()")

    def stacked_just_in_time_scales(self, clean: torch.Tensor, prev: torch.Tensor, dtype: torch.dtype):
        """:meth:`just_in_time_scale` of many tensors at once: ``clean`` their amaxes (NaN and inf replaced by 0),
        ``prev`` their states' scales, both (E,); the same bits element by element."""
        raise NotImplementedError(f"{type(self).__name__} does not define stacked_just_in_time_scales()")

    def state_cast(self, state: OperandScaling, x: torch.Tensor, record: bool, transpose: bool):
        """The whole cast with its bookkeeping in a fused kernel where one runs (CUDA), else None."""
        return None

    # -- the layer ------------------------------------------------------------------------------------------

    def operand_states(self, forward_dtype: torch.dtype, backward_dtype: torch.dtype) -> dict[str, OperandScaling]:
        return {
            "input": OperandScaling(self, forward_dtype),
            "weight": OperandScaling(self, forward_dtype),
            "grad_output": OperandScaling(self, backward_dtype),
        }

    def cast(self, role, x, dtype, columnwise, columnwise_f32, state, record):
        """The operand with ``state``'s scale; with ``columnwise`` the cast kernels (CUDA) also write the
        transposed bytes, which :meth:`transposed` hands out (``OperandCache.transposed``)."""
        return state.quantize(x, record, transpose=columnwise), None

    def transposed(self, row: Quantized, column: Quantized | None) -> Quantized:
        return row.t()

    def gemm_route(self, capability, cuda, has_scaled_mm_v2) -> GemmRoute:
        return native("cuBLAS torch._scaled_mm, tensorwise scales", f"{arch_name(capability)} has FP8 tensor cores")

    def grouped_operands(self, role, x, bounds, dtype, columnwise, state, record):
        """One scale for the whole tensor, shared by every group (TransformerEngine's grouped GEMMs share the
        activation and gradient scales): each group's ``x[start:end].T`` is a view of the same codes."""
        row = self.cast(role, x, dtype, False, True, state, record)[0]
        if not columnwise:
            return row, None
        return row, RowGroupColumns(row, bounds)

    def grouped_weight_operands(self, weight, dtype, states, record):
        """Every expert's operand from one cast of the stacked weight, whatever the number of experts: the experts'
        amaxes from one reduction, their scales as one vector, each expert's state booked as its own cast books it
        (the same bits, :meth:`_stacked_weight_cast`). Evaluation, and states agreed across tensor-parallel ranks,
        cast each expert on its own."""
        if not record or weight.numel() == 0 or any(s is None or s.amax_group is not None for s in states):
            return super().grouped_weight_operands(weight, dtype, states, record)
        return self._stacked_weight_cast(weight.detach(), states)

    def _stacked_weight_cast(self, weight: torch.Tensor, states: list[OperandScaling]) -> ExpertTensorWeights:
        """:meth:`OperandScaling.quantize` (training) of each ``weight[e]`` with ``states[e]``, in a number of tensor
        operations that does not depend on the number of experts."""
        for state in states:
            state.move_to(weight.device)
        x_amax = weight.abs().amax(dim=(1, 2)).float()  # (E,): each expert's amax, as quantize.amax takes it
        clean = finite_or_zero(x_amax)
        nonfinite = torch.stack([s.nonfinite_count for s in states]) + (clean != x_amax)
        prev = torch.stack([s.scale for s in states])
        initialized = [s.initialized for s in states]
        if self.keeps_history and all(initialized):
            scale = prev  # the delayed scales
        else:
            scale = self.stacked_just_in_time_scales(clean, prev, states[0].dtype)
            if self.keeps_history and any(initialized):
                scale = torch.where(torch.tensor(initialized, device=prev.device), prev, scale)
        pending = torch.maximum(torch.stack([s.pending_amax for s in states]), clean) if self.keeps_history else None
        pendings = pending.unbind(0) if pending is not None else [None] * len(states)
        columns = zip(states, initialized, x_amax.unbind(0), nonfinite.unbind(0), scale.unbind(0), pendings)
        for state, seen, expert_amax, count, fresh, booked in columns:
            state.last_amax, state.nonfinite_count = expert_amax, count
            if not (self.keeps_history and seen):
                state.scale = fresh
            if booked is not None:
                state.pending_amax, state._dirty = booked, True
            state.initialized = True
            state.casts += 1
        # clamped before the cast always: torch 2.11's CPU cast to E4M3 gives NaN past the range (2.13 saturates)
        codes = quantize_with_scale(weight, scale.reshape(-1, 1, 1), states[0].dtype)
        return ExpertTensorWeights(codes, scale, scale.reciprocal(), TENSOR)

    def grouped_native(self, device, experts):
        """The Triton grouped GEMM (one launch per GEMM, per-tensor and per-expert scales) where it runs on
        ``device``: torch has no per-tensor FP8 grouped GEMM."""
        if settings().gemm == "emulate" or settings().emulate or triton_unavailable_reason(device) is not None:
            return None
        return TritonPerTensorGroupedGemm(self.fprop_fast_accum, self.grad_fast_accum)

    def grouped_gemm_route(self, capability, cuda, has_grouped_api) -> GemmRoute:
        reason = triton_arch_reason(capability)
        if reason is not None:
            return emulated_on_gpu(f"grouped GEMMs emulated: torch has no per-tensor FP8 grouped GEMM; {reason}")
        return native_grouped_triton(f"{arch_name(capability)}: torch has no per-tensor FP8 grouped GEMM")

    def grouped_columns_from_rows(self) -> bool:
        return True

    def traced_plan(self, device: torch.device, out_dtype: torch.dtype, emulate: bool) -> TracedPlan:
        return plan_for(self, device, out_dtype, emulate, scaled_mm=per_tensor_scaled_mm(device, emulate))

    def traced_cast(self, x, state, plan, role, dtype, columnwise, record):
        """The reference math in plain tensor operations, which the compiler fuses (amax, scale and cast in one or
        two kernels), with the scaling state updated in place as :meth:`OperandScaling.quantize` updates it."""
        scale, pending, last_amax, count, flags = state
        x_amax = amax(x)
        clean = finite_or_zero(x_amax)
        used = self.traced_scale(clean, scale, flags, dtype)
        data = to_fp8_saturated(wide(x) * used, dtype)
        data_t = data.t().contiguous() if plan.transpose else data.t()
        if not record:  # evaluation leaves the state as training left it
            return data, used, data_t, None
        with torch.no_grad():
            scale.copy_(used)
            last_amax.copy_(x_amax)
            count.add_((clean != x_amax).to(count.dtype))
            flags[0] = 1.0
            if self.keeps_history:
                pending.copy_(torch.maximum(pending, clean))
                flags[1] = 1.0
        return data, used, data_t, None

    # -- sequence parallelism -------------------------------------------------------------------------------

    def sequence_gather(self, row, column, gather):
        """One scale, agreed before the cast: only the codes travel; ``x.T`` is their transpose."""
        return Quantized(gather(row.data, 0), row.scale, TENSOR, OperandCache(nan_free=row.cache.nan_free)), None

    def sequence_columns(self, row, dtype):
        """``x.T`` is the transpose of the gathered codes (:meth:`transposed`): nothing to re-quantize."""
        return None

    # -- FSDP2 ----------------------------------------------------------------------------------------------

    def fsdp_pack(self, shard, module, global_amax):
        """One scale for the whole weight, identical on every rank, from the agreed amax of the whole weight (as
        the layer would pick it in one process); it travels as metadata, the codes through the collective."""
        state = module.fp8_scaling(self).operands["weight"]
        agreed = global_amax()
        state.move_to(agreed.device)
        clean = finite_or_zero(agreed)  # evaluation keeps the state as training left it
        scale = state.scale_for(clean) if records_amax(module.training) else state.evaluation_scale(clean)
        data = dispatch.fast_quantize_with_scale(shard, scale, fp8_dtype(self.fp8_format))
        return data.view(torch.uint8), (scale, agreed)

    def fsdp_unpack(self, gathered, shard_rows, k, metadata):
        return Quantized(gathered.view(fp8_dtype(self.fp8_format)), metadata[0], TENSOR)

    def fsdp_operands(self, gathered, scaling, metadata, record, columnwise=True):
        scaling.operands["weight"].book(metadata[1], record)  # counted as a local cast counts itself
        return gathered, None

    def fsdp_experts_pack(self, shard, scaling, first, record, global_amax):
        """One scale per expert, the same on every rank: each rank moves every expert's state with that expert's
        agreed amax (so the states stay equal everywhere) and casts its own experts; only the codes travel."""
        agreed = global_amax()
        scales = []
        for state, expert_amax in zip(scaling.expert_states, agreed):
            state.move_to(agreed.device)
            clean = finite_or_zero(expert_amax)
            scales.append(state.scale_for(clean) if record else state.evaluation_scale(clean))
        dtype = fp8_dtype(self.fp8_format)
        codes = [dispatch.fast_quantize_with_scale(w, scales[first + i], dtype) for i, w in enumerate(shard)]
        return torch.cat(codes).view(torch.uint8), (scales, agreed)

    def fsdp_experts_unpack(self, gathered, experts, n, k, metadata):
        codes = gathered.view(fp8_dtype(self.fp8_format))
        return [Quantized(part, scale, TENSOR) for part, scale in zip(codes.split(n), metadata[0])]

    def fsdp_experts_operands(self, gathered, scaling, metadata, record):
        for state, expert_amax in zip(scaling.expert_states, metadata[1]):
            state.book(expert_amax, record)  # counted as a local cast of the expert counts itself
        return [(q, q.t()) for q in gathered]


def _tensor_f32(q: Quantized) -> torch.Tensor:
    """The codes' values, laid out as a cast without transposed copies lays them out (``OperandCache.from_copy``)."""
    values = dispatch.fast_fp8_to_float32(q.data, q.cache.nan_free)
    return values.t().contiguous().t() if q.cache.from_copy else values


def _tensor_dequantize(q: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    return dispatch.fast_dequantize_with_scale(q.data, q.scale, out_dtype)


TENSOR.implement(
    gemm=per_tensor_mm,
    to_f32=_tensor_f32,
    dequantize=_tensor_dequantize,
    scale_multiplier=lambda q, k: q.scale.float(),
    representative_scale=lambda q: q.scale.float().amin().reshape(()),
)
