"""Host time of one layer training step, eager and compiled, for each recipe, next to ``nn.Linear`` and torchao.

At a tiny shape (16 tokens, 64 x 64 by default) the arithmetic costs next to nothing, so a step's time is what the
host spends on Python, the dispatcher and the per-operation overheads: the part of a GPU step that does not shrink
with a faster GPU and that a model of a hundred FP8 layers pays a hundred times. Each configuration is one layer's
forward + backward; between steps the weight is changed in place (as an optimizer does, so the eager layer casts it
again) and ``sync_scales`` advances the delayed histories, outside the step's timing: it runs once per optimizer
step for the whole model (one batched update for all its layers), not once per layer, and its own median time is
reported next to the step ("sync_scales us", measured on this one layer). ``--accumulate N`` changes the weight
every N steps only (N micro-batches of one optimizer step: the eager layer reuses its cast N - 1 times, after
checking the weight's bits). ``--checksum-off-rows`` adds each recipe again with that check off
(``FP8_LIGHTNING_WEIGHT_CHECKSUM=0``), timed in the same rounds. "compiled" is
``torch.compile(layer, fullgraph=True)`` with inductor; the FP8 layers then run the traced step
(:mod:`fp8_lightning.traced`). All rows of one run are interleaved (``bench_common.interleaved_medians``).

Usage::

    python -m benchmarks host-time [--tokens 16] [--features 64] [--rounds 300] [--accumulate 1]
                                   [--checksum-off-rows] [--out FILE.md]  # rows in FILE.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn as nn

from benchmarks import command as front_door_command
from benchmarks.bench_common import interleaved_medians, markdown_table, route_cuda_branch_to_kernels
from benchmarks.bench_common import write_markdown_report
from fp8_lightning import BlockwiseScaling, DelayedScaling, MXFP8BlockScaling, RowwiseScaling, TensorwiseScaling
from fp8_lightning import convert_to_fp8
from fp8_lightning import fp8_autocast, sync_scales

RECIPES = [DelayedScaling(), TensorwiseScaling(), MXFP8BlockScaling(), RowwiseScaling(), BlockwiseScaling()]


def _step(layer: nn.Module, run: nn.Module, x: torch.Tensor, fp8: bool, sync_times: list[float], accumulate: int = 1):
    """One timed training step of ``run`` (``layer`` or its compiled form) and the untimed work between steps,
    which appends the time ``sync_scales`` took to ``sync_times``; the weight changes after every ``accumulate``
    steps."""
    calls = [0]

    def step():
        with fp8_autocast(enabled=fp8):
            run(x).sum().backward()

    def between():
        calls[0] += 1
        if calls[0] % accumulate:
            return  # another micro-batch of the same optimizer step
        with torch.no_grad():
            layer.weight.mul_(1.0)  # an in-place update: a new weight version, as after an optimizer step
        layer.weight.grad = None
        if fp8:
            start = time.perf_counter()
            sync_scales(layer)
            sync_times.append(time.perf_counter() - start)

    return step, between


def stub_cuda_branch() -> None:
    """Send the FP8 layers down the core's CUDA branch on CPU tensors, with every Triton kernel op and
    ``torch._scaled_mm`` (the per-tensor GEMMs, as on a GPU) answering with empty outputs of the right shapes: no
    arithmetic. What the step then costs is the host time the framework spends around its launches on a GPU, minus
    each launch's own cost in the driver (a few microseconds, the same for any caller; ``nn.Linear``'s row keeps
    its tiny CPU GEMMs). MX GEMMs take the Hopper route (the block-scaled Triton kernel's op); rowwise and
    blockwise GEMMs still compute on CPU (their cuBLAS route needs a CUDA tensor). For this process only."""
    from fp8_lightning import gemm
    from fp8_lightning.ops.registry import EAGER
    from fp8_lightning.ops.triton_ops import TRITON_OPS
    from fp8_lightning.settings import reload_settings

    os.environ["FP8_LIGHTNING_GEMM"] = "scaled_mm"
    os.environ["FP8_LIGHTNING_DISABLE_CPU_CODEC"] = "1"  # CUDA tensors never meet the CPU codec
    reload_settings()
    route_cuda_branch_to_kernels()
    gemm.kernels_usable = lambda x: True
    for op in TRITON_OPS:  # each kernel op answers with its fake: outputs allocated, nothing computed
        setattr(EAGER, op.name, op.fake)  # eager calls (the ops' direct calls on plain tensors)
        op.custom.register_kernel("cpu")(op.fake)  # calls through torch.ops
    _STUBS.impl("_scaled_mm", _empty_scaled_mm, "CPU")


_STUBS = torch.library.Library("aten", "IMPL")  # kept for the process: the registration lives as long as it does


def _empty_scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype or a.dtype)


def _torchao_layer(base: nn.Linear) -> nn.Module | None:
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception:  # not installed (the GPU image has no torchao unless a wheel is brought)
        return None
    config = Float8LinearConfig.from_recipe_name("tensorwise")
    config = Float8LinearConfig(**{**config.__dict__, "emulate": base.weight.device.type == "cpu"})
    return convert_to_float8_training(nn.Sequential(copy.deepcopy(base)), config=config)


def measure(
    tokens: int, features: int, rounds: int, device: torch.device, modes: tuple[str, ...] = ("eager", "compiled"),
    accumulate: int = 1, checksum_off_rows: bool = False,
) -> list[dict]:
    torch.manual_seed(0)
    base = nn.Linear(features, features).to(device)
    x = torch.randn(tokens, features, device=device, requires_grad=True)
    layers: dict[str, tuple[nn.Module, bool]] = {"nn.Linear": (copy.deepcopy(base), False)}
    for recipe in RECIPES:
        for checksum in (True, False) if checksum_off_rows else (True,):
            layer = copy.deepcopy(base)
            convert_to_fp8(layer, recipe, profitability=False)  # in place; a tiny layer, converted regardless
            layer.fp8_scaling(recipe).check_weight_bits = checksum
            layers[f"ours {recipe.name}" + ("" if checksum else " (checksum off)")] = (layer, True)
    torchao = _torchao_layer(base)
    if torchao is not None:
        layers["torchao.float8 tensorwise"] = (torchao, False)
    fns, between, sync_times = {}, {}, {}
    for name, (layer, fp8) in layers.items():
        for mode in modes:
            run = torch.compile(layer, fullgraph=True) if mode == "compiled" else layer
            module = layer if isinstance(layer, nn.Linear) else next(m for m in layer.modules() if isinstance(m, nn.Linear))
            sync_times[(name, mode)] = []
            fns[(name, mode)], between[(name, mode)] = _step(
                module, run, x, fp8, sync_times[(name, mode)], accumulate
            )

    medians = interleaved_medians(fns, device, warmup=5, rounds=rounds, after=between)
    linear = medians[("nn.Linear", "eager")]
    rows = []
    for name, (_, fp8) in layers.items():
        row = {"layer": name}
        for mode in modes:
            row[f"{mode}_us"] = medians[(name, mode)] * 1e6
            row[f"{mode}_x"] = medians[(name, mode)] / linear
        if fp8:
            row["sync_us"] = statistics.median(sync_times[(name, modes[0])]) * 1e6
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--accumulate", type=int, default=1,
                        help="steps per weight change (micro-batches per optimizer step; default 1)")
    parser.add_argument("--checksum-off-rows", action="store_true",
                        help="add each recipe with the weight checksum off (FP8_LIGHTNING_WEIGHT_CHECKSUM=0)")
    parser.add_argument("--modes", default="eager,compiled", help="comma-separated: eager, compiled")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's); 1 keeps a busy shared machine from stalling the "
                             "tiny GEMMs on a descheduled second thread")
    parser.add_argument("--cuda-branch", action="store_true",
                        help="time the core's CUDA branch on CPU tensors with the Triton kernels answering from their "
                             "fake implementations (stub_cuda_branch): the framework's host time around GPU launches")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.cuda_branch:
        if args.device != "cpu":
            parser.error("--cuda-branch runs the CUDA branch on CPU tensors: leave --device at cpu")
        stub_cuda_branch()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    modes = tuple(m for m in args.modes.split(",") if m)
    if not modes or set(modes) - {"eager", "compiled"}:
        parser.error(f"--modes {args.modes!r}: use eager, compiled or both (comma-separated)")
    if args.accumulate < 1:
        parser.error(f"--accumulate {args.accumulate}: use a positive number of steps per weight change")
    rows = measure(args.tokens, args.features, args.rounds, device, modes, args.accumulate, args.checksum_off_rows)
    columns = [("layer", "layer step", "{}")]
    for mode in modes:
        against = "nn.Linear" if mode == "eager" else "nn.Linear eager"
        columns += [(f"{mode}_us", f"{mode} us", "{:.0f}"), (f"{mode}_x", f"{mode} / {against}", "{:.2f}")]
    columns.append(("sync_us", f"sync_scales us ({modes[0]})", "{:.0f}"))
    text = (f"One layer's forward + backward, {args.tokens} tokens, {args.features} x {args.features}, on "
            f"{device.type}{' on the CUDA branch with stubbed kernels (--cuda-branch)' if args.cuda_branch else ''}"
            f"{f', the weight changed every {args.accumulate} steps' if args.accumulate > 1 else ''}; "
            f"medians of {args.rounds} interleaved rounds.\n\n{markdown_table(columns, rows)}\n")
    print(text)
    if args.out:
        write_markdown_report(args.out, "Host time per layer step", "host_time.py", argv, text)
        Path(args.out).with_suffix(".json").write_text(json.dumps({"command": front_door_command("host_time", argv),
                                                                   "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
