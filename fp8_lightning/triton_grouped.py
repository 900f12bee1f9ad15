"""The expert (grouped) GEMMs through the Triton grouped FP8 GEMM (:mod:`fp8_lightning.kernels.grouped_gemm`).

torch 2.11 has one FP8 grouped GEMM, ``torch._scaled_grouped_mm``: rowwise e4m3 operands, sm_90 only. The Triton
kernel takes the same operands everywhere the project's kernels are compiled and checked (sm_89, sm_90a, sm_100a) and
also per-tensor scales (one for the tokens, one per expert's weight) and e5m2 gradients. Each class here is a
recipe's "native" grouped GEMMs (:meth:`~fp8_lightning.recipes.base.Recipe.grouped_native`): ``fprop``, ``dgrad``
and ``wgrad``, one launch each, the group bounds read on the device, output written in the requested dtype, float32
accumulation. The recipes choose when to hand them out; this module only multiplies.
"""

from __future__ import annotations

import importlib

import torch

from fp8_lightning.groups import ExpertTensorWeights, RowGroupColumns, StackedWeights
from fp8_lightning.quantize import Quantized
from fp8_lightning.rowwise_grouped import GroupedColumns, dgrad_args, fprop_args, wgrad_args


class _FastAccum:
    """The recipe's choice of the tensor cores' fast accumulation, per GEMM (``fprop_fast_accum`` for the forward,
    ``grad_fast_accum`` for the two backward GEMMs), as cuBLAS takes it."""

    def __init__(self, fprop_fast_accum: bool = False, grad_fast_accum: bool = False):
        self.fprop_fast_accum, self.grad_fast_accum = fprop_fast_accum, grad_fast_accum


class TritonRowwiseGroupedGemm(_FastAccum):
    """The rowwise recipe's three GEMMs on the operands ``torch._scaled_grouped_mm`` would take
    (:mod:`fp8_lightning.rowwise_grouped`): the stacked weights read in the majorness they have, no copy."""

    def fprop(self, x: Quantized, weights: StackedWeights, offs: torch.Tensor, out_dtype: torch.dtype):
        mat_a, mat_b, scale_a, scale_b = fprop_args(x, weights)
        return _triton(mat_a).grouped_mm_2d3d(mat_a, mat_b, scale_a, scale_b, offs, out_dtype, self.fprop_fast_accum)

    def dgrad(self, g: Quantized, weights: StackedWeights, offs: torch.Tensor, out_dtype: torch.dtype):
        mat_a, mat_b, scale_a, scale_b = dgrad_args(g, weights)
        return _triton(mat_a).grouped_mm_2d3d(mat_a, mat_b, scale_a, scale_b, offs, out_dtype, self.grad_fast_accum)

    def wgrad(self, g_columns: GroupedColumns, x_columns: GroupedColumns, out_dtype: torch.dtype):
        mat_a, mat_b, _, _, offs = wgrad_args(g_columns, x_columns)
        scale_a, scale_b = g_columns.scale.reciprocal(), x_columns.scale.reciprocal()  # (E, N), (E, K)
        return _triton(mat_a).grouped_mm_2d2d(mat_a, mat_b, scale_a, scale_b, offs, out_dtype, aligned=True,
                                              fast_accum=self.grad_fast_accum)


class TritonPerTensorGroupedGemm(_FastAccum):
    """The per-tensor recipes' (tensorwise, delayed) three GEMMs: one scale for the tokens, one for the gradient and
    one per expert's weight (index stride 0 in the kernel's scale vectors). The experts' FP8 weights, cast one by one,
    are stacked once per call (E, N, K) and read transposed by fprop, as they lie by dgrad. One object serves one
    forward and its backward (:class:`~fp8_lightning.grouped.gemm.GroupedStep` holds it), so it keeps the stack and
    ``offs`` between them."""

    def __init__(self, fprop_fast_accum: bool = False, grad_fast_accum: bool = False):
        super().__init__(fprop_fast_accum, grad_fast_accum)
        self._stack: tuple | None = None  # (weights, codes (E, N, K), inverse scales (E, 1))
        self._offs: torch.Tensor | None = None

    def _stacked(self, weights) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(weights, ExpertTensorWeights):  # one stacked cast: no stacking
            return weights.codes, weights.inverse.reshape(-1, 1).float()
        if self._stack is None or self._stack[0] is not weights:
            codes = torch.stack([w.data for w, _ in weights])
            inverse = torch.stack([w.inverse_scale().reshape(()) for w, _ in weights]).reshape(-1, 1).float()
            self._stack = (weights, codes, inverse)
        return self._stack[1], self._stack[2]

    def fprop(self, x: Quantized, weights, offs: torch.Tensor, out_dtype: torch.dtype):
        codes, inverse = self._stacked(weights)
        self._offs = offs
        return _triton(x.data).grouped_mm_2d3d(x.data, codes.transpose(1, 2), _one(x), inverse, offs, out_dtype,
                                               self.fprop_fast_accum)

    def dgrad(self, g: Quantized, weights, offs: torch.Tensor, out_dtype: torch.dtype):
        codes, inverse = self._stacked(weights)
        return _triton(g.data).grouped_mm_2d3d(g.data, codes, _one(g), inverse, offs, out_dtype, self.grad_fast_accum)

    def wgrad(self, g_columns: list, x_columns: list, out_dtype: torch.dtype):
        """``g_columns``, ``x_columns``: each group's transposed view of the same codes (None where empty), so the
        whole (M, N) and (M, K) codes are the groups' rows in order."""
        if isinstance(g_columns, RowGroupColumns):  # views of the two whole casts: their codes, no copy
            g_rows, x_rows, present = g_columns.row.data, x_columns.row.data, [(g_columns.row, x_columns.row)]
        else:
            present = [(g, x) for g, x in zip(g_columns, x_columns) if g is not None]
            g_rows = torch.cat([g.data.t() for g, _ in present])
            x_rows = torch.cat([x.data.t() for _, x in present])
        offs = self._offs
        if offs is None:  # the sizes the views hold (a host-to-device copy, no wait)
            sizes = [0 if g is None else g.data.shape[1] for g in g_columns]
            offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(g_rows.device)
        experts = len(g_columns)
        scale_a = _one(present[0][0]).reshape(1, 1).expand(experts, 1)
        scale_b = _one(present[0][1]).reshape(1, 1).expand(experts, 1)
        return _triton(g_rows).grouped_mm_2d2d(g_rows.t(), x_rows, scale_a, scale_b, offs, out_dtype,
                                               fast_accum=self.grad_fast_accum)


def _one(q: Quantized) -> torch.Tensor:
    """A per-tensor operand's dequantization multiplier as a (1,) float32 tensor."""
    return q.inverse_scale().reshape(1).float()


def _triton(x: torch.Tensor):
    """The grouped GEMM launchers, after checking that the kernels run on ``x``'s device (clear error otherwise)."""
    from fp8_lightning.kernels.availability import require_triton

    require_triton("grouped_gemm", x.device)
    return importlib.import_module("fp8_lightning.kernels.grouped_gemm")


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton grouped GEMM does not serve the core on ``device`` (CUDA sm_89+, Triton, not disabled), or
    None."""
    from fp8_lightning.kernels.availability import cuda_kernels_enabled, device_status

    if device.type != "cuda":
        return f"{device.type}: the Triton grouped GEMM serves CUDA devices"
    if not cuda_kernels_enabled(device.index):
        return f"the Triton kernels do not run here: {device_status(device)[1]} (or FP8_LIGHTNING_DISABLE_TRITON=1)"
    return triton_arch_reason(torch.cuda.get_device_capability(device))


def triton_arch_reason(capability: tuple[int, int]) -> str | None:
    """Why the Triton grouped GEMM is not used on a GPU of ``capability``: it is compiled and checked ahead of time
    for sm_89, sm_90a and sm_100a (``tests/kernels/test_aot_compile.py``), so it serves those families alone."""
    if capability == (8, 9) or capability[0] in (9, 10):
        return None
    return (f"sm_{capability[0]}{capability[1]}: the Triton grouped GEMM is compiled and checked for sm_89, sm_90 and "
            "sm_100 only")
