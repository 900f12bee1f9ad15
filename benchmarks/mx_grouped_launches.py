"""Tensor operations of one MXFP8 ``fp8_grouped_mm`` forward and backward, by number of experts: the host's share of
an expert layer's GPU step (every operation is a launch on a GPU, paid whatever its size).

A ``TorchDispatchMode`` counts every operation that is not a view (as ``benchmarks/launch_count.py`` counts), with
the CPU codec off so that the casts run as the pure-torch operations the CUDA branch runs without Triton. Two columns
per route: the recipe's casts alone (``grouped_operands`` and ``grouped_weight_operands``: the weights of every
expert, every group's wgrad copy) and the whole call. Routes: ``emulated`` (the grouped GEMMs multiplied from the
operands' values, what runs on CPU and off sm_100) and ``native`` (the arguments of the three
``torch._scaled_grouped_mm`` calls of sm_100 built, each launch counted as one operation: the kernel cannot run on
CPU). Same counts on any machine.

Usage::

    python -m benchmarks.mx_grouped_launches [--experts 4 16 64] [--tokens 512]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
from unittest import mock

os.environ["FP8_LIGHTNING_DISABLE_CPU_CODEC"] = "1"  # before the package is imported

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from fp8_lightning.grouped.gemm import GroupedScaling, fp8_grouped_mm  # noqa: E402
from fp8_lightning.recipes import MXFP8BlockScaling  # noqa: E402

VIEWS = {"view", "t", "transpose", "permute", "reshape", "_unsafe_view", "as_strided", "detach", "alias", "expand",
         "slice", "_reshape_alias", "empty", "empty_strided", "unsqueeze", "select", "split"}  # fmt: skip


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.total, self.casts, self.in_cast = 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in VIEWS:
            self.total += 1
            self.casts += self.in_cast > 0
        return func(*args, **(kwargs or {}))


def _counting_casts(counter: _Count, method):
    def wrapped(self, *args, **kwargs):
        counter.in_cast += 1
        try:
            return method(self, *args, **kwargs)
        finally:
            counter.in_cast -= 1

    return wrapped


def _sizes(experts: int, tokens: int) -> list[int]:
    """A skewed split: every fourth expert empty, the others ragged (no multiple of 32), summing to ``tokens``."""
    weights = [0.0 if e % 4 == 3 else 1.0 / (1 + e % 5) for e in range(experts)]
    sizes = [int(tokens * w / sum(weights)) for w in weights]
    sizes[0] += tokens - sum(sizes)
    return sizes


def count(experts: int, tokens: int, route: str, k: int = 64, n: int = 64) -> tuple[int, int]:
    """(cast operations, all operations) of one forward and backward on ``route``."""
    torch.manual_seed(0)
    recipe = MXFP8BlockScaling()
    sizes = _sizes(experts, tokens)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    a = torch.randn(tokens, k, requires_grad=True)
    b = torch.randn(experts, k, n, requires_grad=True)
    grad = torch.randn(tokens, n)
    counter = _Count()
    with contextlib.ExitStack() as stack:
        for name in ("grouped_operands", "grouped_weight_operands"):
            stack.enter_context(mock.patch.object(MXFP8BlockScaling, name,
                                                  _counting_casts(counter, getattr(MXFP8BlockScaling, name))))
        if route == "native":
            from fp8_lightning import mx_grouped

            def launch(mat_a, mat_b, scale_a, scale_b, offs_):  # one operation, the kernel's output
                shape = (mat_a.shape[0], mat_b.shape[-1]) if mat_b.dim() == 3 else (offs_.shape[0], mat_a.shape[0],
                                                                                       mat_b.shape[1])
                return torch.zeros(shape, dtype=torch.bfloat16)

            stack.enter_context(mock.patch.object(mx_grouped, "_launch", launch))
            stack.enter_context(mock.patch.object(MXFP8BlockScaling, "grouped_native",
                                                  lambda self, device, e: mx_grouped.MXGroupedGemm()))
        scaling = GroupedScaling(recipe, experts)
        with counter:
            fp8_grouped_mm(a, b, offs, recipe=recipe, scaling=scaling).backward(grad)
    return counter.casts, counter.total


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args(argv)
    native_route = "grouped_native" in MXFP8BlockScaling.__dict__  # a tree without it: the emulated route only
    routes = ("emulated", "native") if native_route else ("emulated",)
    rows = collections.OrderedDict()
    print("| experts | " + " | ".join(f"{r} casts | {r} total" for r in routes) + " |")
    print("|---|" + "---|---|" * len(routes))
    for experts in args.experts:
        rows[experts] = {r: count(experts, args.tokens, r) for r in routes}
        cells = " | ".join(f"{c} | {t}" for c, t in rows[experts].values())
        print(f"| {experts} | {cells} |")
    return rows


if __name__ == "__main__":
    main()
