"""Tensor operations per mixture-of-experts layer step on the CUDA branch: the rows of ``launch_count.py`` for
``fp8_grouped_mm``.

One step = the experts' (E, N, K) weight changed by an optimizer (so it is cast again), then the grouped GEMM's
forward and backward (fprop, dgrad, wgrad) on tokens sorted by expert, with skewed group sizes and empty experts;
the scales advance between steps, outside the count. The casts run on the CUDA branch's Triton kernels (in the
interpreter, on CPU tensors) and the grouped GEMMs on the route a GPU takes: the Triton grouped GEMM for the
per-tensor recipes, and for rowwise the same kernel (sm_89 and sm_100; on sm_90 ``torch._scaled_grouped_mm``, also
one launch per GEMM). A Triton grouped GEMM launch counts as one operation (``grouped_mm_2d3d``,
``grouped_mm_2d2d``). Recipes without an FP8 grouped kernel (blockwise, MXFP8, NVFP4) run their GEMMs emulated: here
as the CPU does, one ``torch._grouped_mm`` in float32 per GEMM (on a GPU the float32 emulation runs one GEMM per
non-empty group instead). The counts are the same on any machine.
"""

from __future__ import annotations

import collections
import functools
import importlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from benchmarks.bench_common import route_cuda_branch_to_kernels
from fp8_lightning.grouped.gemm import GroupedScaling, fp8_grouped_mm

# Views and allocations launch nothing on a GPU (select / unbind / split: views of one tensor).
VIEWS = {"view", "t", "transpose", "permute", "reshape", "_unsafe_view", "as_strided", "detach", "alias", "expand",
         "slice", "_reshape_alias", "empty", "empty_strided", "unsqueeze", "squeeze", "select", "unbind", "split",
         "split_with_sizes", "lift_fresh"}  # fmt: skip
EXPERTS = (4, 16, 64)
K, N = 64, 64  # every recipe's block (MX 32, NVFP4 16, blockwise tiles cut at the edge) fits


class MoECount(TorchDispatchMode):
    """Counts every tensor operation that is not a view, and (through :func:`_counted`) each Triton grouped GEMM."""

    active: "MoECount | None" = None

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __enter__(self):
        MoECount.active = self
        return super().__enter__()

    def __exit__(self, *exc):
        MoECount.active = None
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in VIEWS:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _counted(name: str, launcher):
    """``launcher`` (a Triton grouped GEMM) counted as one launch; the interpreter's own tensor work is not."""

    @functools.wraps(launcher)
    def run(*args, **kwargs):
        if MoECount.active is not None:
            MoECount.active.ops[name] += 1
        with _disable_current_modes():
            return launcher(*args, **kwargs)

    return run


@functools.lru_cache(maxsize=1)
def route_grouped_gemms_to_triton() -> None:
    """The CUDA branch's grouped GEMM choice for CPU tensors: the recipes that hand out the Triton grouped GEMM on a
    GPU (``Recipe.grouped_native``) hand it out here too, its launches counted. For the calling process only."""
    for module in ("fp8_lightning.recipes.per_tensor", "fp8_lightning.recipes.rowwise"):
        importlib.import_module(module).triton_unavailable_reason = lambda device: None
    gemms = importlib.import_module("fp8_lightning.kernels.grouped_gemm")
    for name in ("grouped_mm_2d3d", "grouped_mm_2d2d"):
        setattr(gemms, name, _counted(name, getattr(gemms, name)))


def group_sizes(experts: int) -> list[int]:
    """Skewed tokens per expert: expert 0 takes 40, every fourth expert from the second on none, the rest 1 to 13."""
    return [40 if e == 0 else 0 if e % 4 == 1 else 1 + (7 * e) % 13 for e in range(experts)]


def _inputs(experts: int, dtype: torch.dtype):
    torch.manual_seed(0)
    sizes = group_sizes(experts)
    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
    weight = torch.randn(experts, N, K, dtype=dtype).mul_(0.1).requires_grad_()  # (E, out, in), as modules hold it
    a = torch.randn(sum(sizes), K, dtype=dtype, requires_grad=True)
    return a, weight, offs, torch.randn(sum(sizes), N, dtype=dtype)


def count_moe(recipe, experts: int) -> collections.Counter:
    """Operations of one FP8 grouped GEMM step (forward and backward) of ``experts`` experts (K = N = 64)."""
    route_cuda_branch_to_kernels()  # the CUDA branch's casts, on CPU
    route_grouped_gemms_to_triton()
    a, weight, offs, grad_y = _inputs(experts, torch.float32)
    scaling = GroupedScaling(recipe, experts)

    def step():
        with torch.no_grad():
            weight.mul_(1.0)  # stands in for the optimizer step
        fp8_grouped_mm(a, weight.transpose(1, 2), offs, scaling=scaling).backward(grad_y)

    for _ in range(2):  # past delayed scaling's first (just-in-time) casts
        step()
        scaling.update()
    with MoECount() as counted:
        step()
    return counted.ops


def count_bf16(experts: int) -> collections.Counter:
    """Operations of the same step in bf16 through ``torch._grouped_mm`` (the high-precision reference)."""
    a, weight, offs, grad_y = _inputs(experts, torch.bfloat16)

    def step():
        with torch.no_grad():
            weight.mul_(1.0)
        torch._grouped_mm(a, weight.transpose(1, 2), offs).backward(grad_y)

    step()  # the gradients exist: the counted step accumulates into them, as the FP8 rows do
    with MoECount() as counted:
        step()
    return counted.ops


def moe_rows(recipes, sizes: tuple[int, ...] = EXPERTS) -> dict[str, collections.Counter]:
    """``{"<recipe>, E experts": operations}`` for each of ``recipes`` ((name, recipe) pairs) and bf16, at each number
    of experts in ``sizes``."""
    rows = {}
    for name, recipe in recipes:
        for experts in sizes:
            rows[f"{name}, {experts} experts"] = count_moe(recipe, experts)
    for experts in sizes:
        rows[f"bf16 torch._grouped_mm, {experts} experts"] = count_bf16(experts)
    return rows


def moe_note(sizes: tuple[int, ...] = EXPERTS) -> list[str]:
    """The markdown lines that explain the rows of :func:`moe_rows`."""
    return [
        "Mixture of experts: one `fp8_grouped_mm` step of K = N = 64 experts (weight (E, 64, 64) changed by the",
        f"stand-in optimizer's `mul_`, then forward and backward) on skewed groups ({', '.join(map(str, sizes))}",
        "experts; expert 0 takes 40 tokens, every fourth expert from the second none). Triton grouped GEMM launches",
        "count as `grouped_mm_2d3d` / `grouped_mm_2d2d`; blockwise, MXFP8 and NVFP4 have no FP8 grouped kernel and",
        "their GEMMs are emulated (one float32 `_grouped_mm` per GEMM here, as on CPU; one GEMM per non-empty group",
        "on a GPU). Includes `mul_` and autograd's gradient accumulations into `a` and the weight.",
    ]
