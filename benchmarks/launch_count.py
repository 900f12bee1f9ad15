"""Tensor operations per FP8 layer training step on the CUDA branch: the host's share of a GPU step.

On a GPU every tensor operation is a kernel launch that costs the host several microseconds whatever its size,
and a converted layer runs eagerly even under ``torch.compile``; a model of a hundred FP8 layers pays them a
hundred times per step. This counts them without a GPU: the core's CUDA dispatch is pointed at the Triton
kernels, which run in Triton's interpreter on CPU tensors, the per-tensor GEMMs go through ``torch._scaled_mm``
(``FP8_LIGHTNING_GEMM=scaled_mm``, as on CUDA), and a ``TorchDispatchMode`` counts every operation that is not a
view. One step = the weight changed by an optimizer (so it is cast again), forward, backward; ``sync_scales`` runs
between steps, outside the count. The counts are the same on any machine.

The rowwise and blockwise recipes have no cuBLAS GEMM on CPU (their GEMMs are emulated here), so their rows count
the part of a step that does not depend on it: the casts of x, W and the output gradient with their transposed
copies, and the layout of the three GEMMs' ``torch._scaled_mm`` arguments, on the Triton kernels and on the
pure-torch chain the CUDA branch ran before them.

The mixture-of-experts rows (:mod:`benchmarks.launch_count_moe`) count one ``fp8_grouped_mm`` step per recipe at
4, 16 and 64 experts, its grouped GEMMs on the route a GPU takes.

Usage::

    python -m benchmarks launch-count [--out FILE.md] [--moe-only] [--experts 4,16,64]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import subprocess
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
os.environ["FP8_LIGHTNING_DISABLE_CPU_CODEC"] = "1"  # CUDA tensors never meet the CPU codec
os.environ["FP8_LIGHTNING_GEMM"] = "scaled_mm"

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from fp8_lightning.ops import dispatch  # noqa: E402
from benchmarks import command as front_door_command  # noqa: E402
from benchmarks.bench_common import route_cuda_branch_to_kernels  # noqa: E402
from fp8_lightning import DelayedScaling, FP8Linear, TensorwiseScaling, fp8_autocast, sync_scales  # noqa: E402
from fp8_lightning.gemm import swizzled_scales  # noqa: E402
from fp8_lightning.blockwise import blockwise_scaled_mm_args  # noqa: E402
from fp8_lightning.recipes import BlockwiseScaling, MXFP8BlockScaling, RowwiseScaling  # noqa: E402
from fp8_lightning.rowwise import rowwise_scaled_mm_args  # noqa: E402
from fp8_lightning.recipes import recipe_from  # noqa: E402
from benchmarks.launch_count_moe import EXPERTS, moe_note, moe_rows  # noqa: E402

MOE_RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise", "mxfp8", "nvfp4")

VIEWS = {"view", "t", "transpose", "permute", "reshape", "_unsafe_view", "as_strided", "detach", "alias", "expand",
         "slice", "_reshape_alias", "empty", "empty_strided", "unsqueeze"}  # fmt: skip


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in VIEWS:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def count(recipe, autocast_dtype: torch.dtype | None = None) -> collections.Counter:
    """Operations of one training step of a 64 -> 64 FP8 layer (with bias) on 32 tokens, in float32 or under
    ``torch.autocast`` to ``autocast_dtype`` (bf16 output: the bias rides in the forward GEMM)."""
    route_cuda_branch_to_kernels()  # the CUDA branch, on CPU
    torch.manual_seed(0)
    layer = FP8Linear.from_linear(torch.nn.Linear(64, 64), recipe)
    x, grad_y = torch.randn(32, 64, requires_grad=True), torch.randn(32, 64)
    grad_y_low = grad_y.to(autocast_dtype or grad_y.dtype)  # the output gradient in the output's dtype

    def step():
        with torch.no_grad():
            layer.weight.mul_(1.0)  # stands in for the optimizer step
        amp = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
        with fp8_autocast(), amp:
            y = layer(x)
        y.backward(grad_y if autocast_dtype is None else grad_y_low)

    for _ in range(2):  # past delayed scaling's first (just-in-time) casts
        step()
        sync_scales(layer)
    with _Count() as counted:
        step()
    return counted.ops


def _step_tensors(recipe, use_kernels: bool):
    """(x, W, output gradient, forward dtype, backward dtype) of a 64 -> 64 layer step on 32 tokens, with the CUDA
    branch's casts on the Triton kernels (``use_kernels``) or on the pure-torch chain."""
    route_cuda_branch_to_kernels(use_kernels)
    torch.manual_seed(0)
    x, w, g = torch.randn(32, 64), torch.randn(64, 64), torch.randn(32, 64)
    return x, w, g, recipe.fp8_format.forward_dtype, recipe.fp8_format.backward_dtype


def count_fine(recipe, use_kernels: bool) -> collections.Counter:
    """Operations of a rowwise or blockwise layer step (64 -> 64, 32 tokens) outside its GEMMs: the casts of x, W
    and the output gradient with their transposed copies, and the ``torch._scaled_mm`` arguments of fprop, dgrad and
    wgrad; on the Triton kernels (``use_kernels``) or on the pure-torch chain."""
    x, w, g, forward, backward = _step_tensors(recipe, use_kernels)
    layout = blockwise_scaled_mm_args if isinstance(recipe, BlockwiseScaling) else rowwise_scaled_mm_args
    with _Count() as counted:
        x_row, x_col = dispatch.fast_fine_operands(recipe, "input", x, forward, True)
        w_row, w_col = dispatch.fast_fine_operands(recipe, "weight", w, forward, True)
        g_row, g_col = dispatch.fast_fine_operands(recipe, "grad_output", g, backward, True)
        for a, b in ((x_row, w_row), (g_row, w_col), (g_col, x_col)):
            layout(a, b)
    return counted.ops


def count_mx(recipe: MXFP8BlockScaling, use_kernels: bool) -> collections.Counter:
    """Operations of an MXFP8 layer step (64 -> 64, 32 tokens) outside its GEMMs, for cuBLAS's native MX GEMM
    (sm100): the rowwise and columnwise casts of x, W and the output gradient, and the scales of the six operands
    in cuBLAS's swizzled layout; on the Triton kernels (``use_kernels``) or on the pure-torch chain."""
    x, w, g, forward, backward = _step_tensors(recipe, use_kernels)
    with _Count() as counted:
        operands = [
            dispatch.fast_quantize_mx_operands(t, recipe.block_size, recipe.scale_rounding, dtype)
            for t, dtype in ((x, forward), (w, forward), (g, backward))
        ]
        for row, col in operands:
            swizzled_scales(row), swizzled_scales(col)
    return counted.ops


def _table(rows: dict) -> list[str]:
    lines = ["| recipe | operations | by name |", "|---|---:|---|"]
    for name, ops in rows.items():
        lines.append(f"| {name} | {sum(ops.values())} | " + ", ".join(f"{k} {v}" for k, v in ops.most_common()) + " |")
    return lines


def _linear_lines(rows: dict) -> list[str]:
    """The linear layer's rows (added to ``rows``) as markdown lines."""
    recipes = (("delayed", DelayedScaling()), ("tensorwise", TensorwiseScaling()))
    rows.update({name: count(recipe) for name, recipe in recipes})
    rows.update({f"{name}, bf16 autocast": count(recipe, torch.bfloat16) for name, recipe in recipes})
    lines = _table(rows)
    lines += ["", "Includes the stand-in optimizer's `mul_` and autograd's three gradient accumulations (`add_`): the",
              "layer's own step is the rest (casts, GEMMs, the bias add where it is not in the GEMM, the bias gradient)."]
    fine = {}
    for name, recipe in (("rowwise", RowwiseScaling()), ("blockwise", BlockwiseScaling())):
        for label, use_kernels in (("pure-torch casts", False), ("Triton casts", True)):
            fine[f"{name}, {label}"] = count_fine(recipe, use_kernels)
    lines += ["", "Rowwise and blockwise: a step's casts (x, W, output gradient, each with its transposed copy) and the",
              "layout of its three `torch._scaled_mm` calls' arguments, the GEMMs themselves not included.", "",
              *_table(fine)]  # fmt: skip
    rows.update(fine)
    mx_rows = {f"mxfp8, {label}": count_mx(MXFP8BlockScaling(), use_kernels)
               for label, use_kernels in (("pure-torch casts", False), ("Triton casts", True))}
    lines += ["", "MXFP8 for cuBLAS's native MX GEMM (sm100): a step's rowwise and columnwise casts of x, W and the",
              "output gradient and the six operands' scales in cuBLAS's swizzled layout, the GEMMs themselves not",
              "included (the weight's two copies are cast and swizzled once per optimizer step, whatever the number",
              "of micro-batches).",
              "", *_table(mx_rows)]  # fmt: skip
    rows.update(mx_rows)
    return lines


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="markdown file to write (default: print only)")
    parser.add_argument("--moe-only", action="store_true", help="only the mixture-of-experts rows")
    parser.add_argument("--experts", default=",".join(map(str, EXPERTS)),
                        help="numbers of experts of the mixture-of-experts rows, comma-separated (default %(default)s)")
    args = parser.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()  # fmt: skip
    lines = [f"# Tensor operations per FP8 layer training step on the CUDA branch (commit {commit or '?'})", "",
             f"- command: `{front_door_command('launch_count', argv)}`",
             f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}", ""]
    rows: dict = {}
    if not args.moe_only:
        lines += _linear_lines(rows)
    sizes = tuple(int(part) for part in args.experts.split(","))
    moe = moe_rows([(name, recipe_from(name)) for name in MOE_RECIPES], sizes)
    lines += ["", *moe_note(sizes), "", *_table(moe)]
    rows.update(moe)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return {name: sum(ops.values()) for name, ops in rows.items()}


if __name__ == "__main__":
    main()
