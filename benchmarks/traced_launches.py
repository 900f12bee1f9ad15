"""Tensor operations per compiled (traced) FP8 layer step on a simulated CUDA device, fine-grained recipes.

``torch.compile`` captures :mod:`fp8_lightning.traced`: the casts and the GEMM are opaque custom ops, whose
implementations run at run time, operation by operation, each a kernel launch; the operations between them are graph
nodes that inductor may fuse. This counts both without a GPU, on the CUDA contract's simulated device
(:func:`fp8_lightning.cuda_contract.run_layer` in "traced" mode: fake CUDA tensors, the device queries answering as
the target): the cast and GEMM ops are expanded to their implementations, and a ``TorchDispatchMode`` counts every
operation that is not a view, split into "in ops" (run-time launches; a nested Triton op counts one) and "graph"
(what inductor sees between the ops: an upper bound on their launches). One step = forward and backward of one
``k -> n`` layer with bias on ``m`` bf16 tokens; the weight is cast in the step as the traced step does.

``--baseline-tree PATH`` also counts the library found at ``PATH`` (a checkout whose ``fp8_lightning/`` holds
``kernels`` and ``conf`` as links to its top-level folders, or an installed tree), in a subprocess, so one run
gives before and after.

Usage::

    python -m benchmarks traced-launches [--baseline-tree PATH] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

VIEWS = {"view", "t", "transpose", "permute", "reshape", "_unsafe_view", "as_strided", "detach", "alias", "expand",
         "slice", "_reshape_alias", "empty", "empty_strided", "unsqueeze", "squeeze", "narrow", "select",
         "new_empty", "new_empty_strided", "empty_like", "lift_fresh",
         "device", "dim", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_contiguous"}  # fmt: skip
# (the last line: metadata queries, no launch)
# (label, arch, CUDA, torch, recipe name, m, k, n): the H100 / B200 images' torch 2.11 + CUDA 13
CASES = (
    ("sm_90", "sm_90", "13.0", "2.11", "rowwise", 4113, 4096, 14336),
    ("sm_90", "sm_90", "13.0", "2.11", "blockwise", 4113, 4096, 14336),
    ("sm_90", "sm_90", "13.0", "2.11", "mxfp8", 4113, 4096, 14336),
    ("sm_100", "sm_100", "13.0", "2.11", "rowwise", 4113, 4096, 14336),
    ("sm_100", "sm_100", "13.0", "2.11", "mxfp8", 4113, 4096, 14336),
    ("sm_90 ragged", "sm_90", "13.0", "2.11", "rowwise", 77, 160, 144),
    ("sm_90 ragged", "sm_90", "13.0", "2.11", "blockwise", 77, 1040, 48),
)
CAST_OPS = (("fp8_lightning.ops.layer", "fine_tile_cast"), ("fp8_lightning.ops.layer", "block_cast_transposed"),
            ("fp8_lightning.recipes.mxfp8", "mx_operand_cast"))  # fmt: skip


class _Count(TorchDispatchMode):
    """Counts non-view operations while ``on``, by name, split by whether an expanded op is running."""

    def __init__(self):
        super().__init__()
        self.on, self.depth = False, 0
        self.inside: collections.Counter = collections.Counter()
        self.graph: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.on and name not in VIEWS:
            (self.inside if self.depth else self.graph)[name] += 1
        return func(*args, **(kwargs or {}))


def _expanded(counter: _Count, impl):
    """An op's implementation, run in place of the op, its operations counted as the op's."""

    def run(*args, **kwargs):
        counter.depth += 1
        try:
            return impl(*args, **kwargs)
        finally:
            counter.depth -= 1

    return run


def count_case(
    arch: str, cuda: str, torch_version: str, recipe_name: str, m: int, k: int, n: int, mode: str = "traced"
) -> dict:
    """``{"in_ops": Counter, "graph": Counter, "gemms": [verdicts]}`` of one layer step in ``mode`` ("traced", or
    "eager": every operation a launch, all counted as graph)."""
    import importlib

    from fp8_lightning.cuda_contract import Target, simulate
    from fp8_lightning.cuda_contract.check import judge
    from fp8_lightning.ops import registry
    from fp8_lightning.recipes import RECIPES

    counter = _Count()
    original_device, original_autocast = simulate.simulated_device, simulate.fp8_autocast

    @contextlib.contextmanager
    def counting_device(target, triton=True):
        with original_device(target, triton) as fake, counter:
            yield fake

    @contextlib.contextmanager
    def counting_autocast(*args, **kwargs):
        counter.on = True  # from the forward on; the backward follows inside the same simulation
        with original_autocast(*args, **kwargs):
            yield

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(simulate, "simulated_device", counting_device))
        stack.enter_context(mock.patch.object(simulate, "fp8_autocast", counting_autocast))
        gemm_impl = registry.HOT_OPS["scaled_gemm"].impl
        stack.enter_context(mock.patch.object(registry.EAGER, "scaled_gemm", _expanded(counter, gemm_impl)))
        for module_name, op in CAST_OPS:
            module = importlib.import_module(module_name)
            if hasattr(module, op):
                stack.enter_context(mock.patch.object(module, op, _expanded(counter, registry.HOT_OPS[op].impl)))
        target = Target.parse(arch, cuda, torch_version)
        records = simulate.run_layer(target, RECIPES[recipe_name](), m, k, n, mode)
    verdicts = [judge(r, target) for r in records]
    return {"in_ops": counter.inside, "graph": counter.graph,
            "gemms": [f"{v.record.role}: {v.status} ({v.kernel})" for v in verdicts]}  # fmt: skip


def count_all(mode: str = "traced") -> list[dict]:
    rows = []
    for label, arch, cuda, torch_version, recipe, m, k, n in CASES:
        counts = count_case(arch, cuda, torch_version, recipe, m, k, n, mode)
        rows.append({"case": f"{recipe}, {label}, {m}x{k}->{n}", **{key: dict(v) if isinstance(v, dict) else v
                                                                    for key, v in counts.items()}})  # fmt: skip
    return rows


def _run_tree(tree: str) -> list[dict]:
    """:func:`count_all` on the library at ``tree``, in a subprocess started there (this file loaded by its path)."""
    code = ("import importlib.util, json, sys; spec = importlib.util.spec_from_file_location('counts', sys.argv[1]); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); print(json.dumps(m.count_all()))")
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run([sys.executable, "-c", code, __file__], env=env, cwd=tree, capture_output=True, text=True,
                         check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def _fmt(ops: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))) or "-"


def main(argv: list[str] | None = None) -> list[dict]:
    from benchmarks import command as front_door_command

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-tree", help="also count the library at this path (before)")
    parser.add_argument("--out", help="markdown file to write (default: print only)")
    args = parser.parse_args(argv)
    after, eager = count_all(), count_all("eager")
    before = _run_tree(args.baseline_tree) if args.baseline_tree else None
    lines = ["# Tensor operations per compiled FP8 layer step on a simulated CUDA device", "",
             f"- command: `{front_door_command('traced_launches', argv)}`",
             f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}; "
             "the counts are the same on any machine (fake CUDA tensors)", "",
             "| case | tree | in ops | graph | total | in ops, by name | GEMMs |", "|---|---|---:|---:|---:|---|---|"]  # fmt: skip
    trees = [("before", before), ("after", after)] if before else [("this", after)]
    for i in range(len(after)):
        for tree, rows in trees:
            row = rows[i]
            inside, graph = sum(row["in_ops"].values()), sum(row["graph"].values())
            lines.append(f"| {row['case']} | {tree} | {inside} | {graph} | {inside + graph} | {_fmt(row['in_ops'])} "
                         f"| {'; '.join(row['gemms'])} |")  # fmt: skip
    lines += ["", "The eager step of the same layer on this tree, for comparison (every operation a launch).",
              "", "| case | eager ops | by name |", "|---|---:|---|"]
    lines += [f"| {row['case']} | {sum(row['graph'].values())} | {_fmt(row['graph'])} |" for row in eager]
    lines += ["", "Graph operations by name (inductor may fuse the pointwise ones):", ""]
    for i in range(len(after)):
        lines.append(f"- {after[i]['case']}: " + "; ".join(f"{tree}: {_fmt(rows[i]['graph'])}" for tree, rows in trees))
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return after


if __name__ == "__main__":
    main()
