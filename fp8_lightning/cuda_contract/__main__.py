"""``python -m fp8_lightning.cuda_contract``: check every GEMM of a layer step against torch's CUDA rules on a
simulated device; exits 1 on any violation.

    python -m fp8_lightning.cuda_contract --arch sm_90 --cuda 12.9 --torch 2.11 --recipe blockwise --shape 64,768,3072
    python -m fp8_lightning.cuda_contract --arch all --recipe all --grid
    python -m fp8_lightning.cuda_contract --arch all --recipe all --experts    # the grouped (expert) GEMMs
"""

from __future__ import annotations

import argparse
import sys

import torch

from fp8_lightning.cuda_contract.check import (
    MODELS,
    TOKENS,
    VIOLATION,
    arch_names,
    check_layer,
    describe_call,
    grid_shapes,
    recipe_names,
)
from fp8_lightning.cuda_contract.grouped import EXPERT_MODELS, check_experts, expert_shapes
from fp8_lightning.cuda_contract.rules import Target
from fp8_lightning.cuda_contract.simulate import MODES
from fp8_lightning.recipes import recipe_from

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m fp8_lightning.cuda_contract", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="sm_90", help="sm_89, sm_90, sm_100, sm_120, a comma list, or all")
    parser.add_argument("--cuda", default="12.9", help="torch's CUDA version (none: a CPU build)")
    parser.add_argument("--torch", default="2.11", help="the torch version whose rules apply (2.11, 2.13, ...)")
    parser.add_argument("--recipe", default="all", help="a recipe name, a comma list, or all")
    parser.add_argument("--shape", help="M,K,N: tokens, in_features, out_features")
    parser.add_argument("--grid", action="store_true", help=f"the shape grid: {', '.join(MODELS)} x tokens {TOKENS}")
    parser.add_argument("--models", default=",".join(MODELS), help="models of the grid (comma list)")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="token counts of the grid")
    parser.add_argument("--mode", default="all", choices=[*MODES, "all"], help="eager, traced or all")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="the layer's parameters and input")
    parser.add_argument("--no-bias", action="store_true", help="a layer without bias")
    parser.add_argument("--no-triton", action="store_true", help="the device has no usable Triton")
    parser.add_argument("--quiet", action="store_true", help="print violations and the summary only")
    parser.add_argument("--experts", action="store_true",
                        help=f"the grouped GEMMs of experts layers: {', '.join(EXPERT_MODELS)}, skewed tokens")
    args = parser.parse_args(argv)
    if not args.grid and not args.shape and not args.experts:
        parser.error("give --shape M,K,N, --grid or --experts")
    return args


def _experts(args, counts: dict[str, int]) -> None:
    for arch in arch_names(args.arch):
        target = Target.parse(arch, args.cuda, args.torch)
        for name in recipe_names(args.recipe):
            for model, sizes, k, n in expert_shapes():
                for v in check_experts(target, recipe_from(name), sizes, k, n):
                    counts[v.status] = counts.get(v.status, 0) + 1
                    if args.quiet and v.status != VIOLATION:
                        continue
                    print(f"[{target}] {name} {model} experts={len(sizes)} M={sum(sizes)} K={k} N={n} "
                          f"{v.record.role}: {v.status} ({v.kernel})")
                    for call in v.record.calls:
                        print(f"    {describe_call(call)}")
                    for line in v.reasons:
                        print(f"    {line}")


def _shapes(args) -> list[tuple[str, int, int, int]]:
    if args.shape:
        m, k, n = (int(v) for v in args.shape.split(","))
        return [("shape", m, k, n)]
    return list(grid_shapes(args.models.split(","), [int(t) for t in args.tokens.split(",")]))


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    modes = MODES if args.mode == "all" else (args.mode,)
    counts: dict[str, int] = {}
    if args.experts:
        _experts(args, counts)
    for arch in arch_names(args.arch) if (args.shape or args.grid) else ():
        target = Target.parse(arch, args.cuda, args.torch)
        for name in recipe_names(args.recipe):
            recipe = recipe_from(name)
            for model, m, k, n in _shapes(args):
                verdicts = check_layer(target, recipe, m, k, n, modes, DTYPES[args.dtype], not args.no_bias,
                                       not args.no_triton)
                for v in verdicts:
                    counts[v.status] = counts.get(v.status, 0) + 1
                    if args.quiet and v.status != VIOLATION:
                        continue
                    r = v.record
                    print(f"[{target}] {name} {model} M={m} K={k} N={n} {r.mode} {r.role}: {v.status} ({v.kernel})")
                    print(f"    a {r.a.describe()}  b {r.b.describe()}  out {r.out_dtype}")
                    for call in r.calls:
                        print(f"    {describe_call(call)}")
                    for line in v.reasons + [f"note: {n_}" for n_ in v.notes]:
                        print(f"    {line}")
    print("summary: " + ", ".join(f"{count} {status}" for status, count in sorted(counts.items())))
    return 1 if counts.get(VIOLATION) else 0


if __name__ == "__main__":
    sys.exit(main())
