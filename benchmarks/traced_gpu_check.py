"""GPU check of the compiled (traced) fine-grained layer step: the eager step's bits, and its CUDA kernels counted.

For each fine-grained recipe the GPU runs (rowwise, blockwise, and MXFP8 where the architecture has a GEMM for it)
one :class:`~fp8_lightning.FP8Linear` training step (forward and backward, bf16, with bias) eagerly and compiled
with ``torch.compile(fullgraph=True)``:

* ``aot_eager`` (the traced graph's operations as they are): output, input, weight and bias gradients equal to the
  eager step's bit for bit, at a main and a ragged shape;
* ``inductor`` (what users run): output, input and weight gradients bit for bit (they are outputs of the traced
  step's opaque GEMM ops); the bias gradient, a sum inductor may reorder, within 1e-2 relative;
* the CUDA kernels of one steady-state step, eager and inductor, counted with ``torch.profiler`` (the eager layer
  reuses its weight cast after checking the weight's bits, as it does between an optimizer's steps' micro-batches;
  the compiled step casts the weight every step).

It prints a markdown report (``--out`` writes it, by default ``$OUT/traced_gpu_check.md`` when ``OUT`` is set) and
exits 1 on a mismatch; without a CUDA device it says so and exits 0 (nothing to check).

Usage::

    python -m benchmarks traced-gpu-check [--out FILE.md]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from pathlib import Path

import torch

from fp8_lightning import BlockwiseScaling, FP8Linear, MXFP8BlockScaling, RowwiseScaling, fp8_autocast
from fp8_lightning.gemm_routes import REFUSED

MAIN, RAGGED = (2048, 2048, 4096), (77, 1056, 160)  # (tokens, in_features, out_features)


def _recipes(capability: tuple[int, int], cuda: tuple[int, int] | None) -> tuple[dict, list[str]]:
    has_v2 = hasattr(torch.nn.functional, "scaled_mm")
    recipes, skipped = {}, []
    for name, recipe in (("rowwise", RowwiseScaling()), ("blockwise", BlockwiseScaling()),
                         ("mxfp8", MXFP8BlockScaling())):  # fmt: skip
        route = recipe.gemm_route(capability, cuda, has_v2)
        if route.verdict == REFUSED:
            skipped.append(f"{name}: skipped, sm_{capability[0]}{capability[1]} has no GEMM for it ({route.why})")
        else:
            recipes[name] = recipe
    return recipes, skipped


def _layer(recipe, k: int, n: int) -> FP8Linear:
    torch.manual_seed(0)
    linear = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
    return FP8Linear.from_linear(linear, recipe)


def _step(run, layer, x, g) -> tuple[torch.Tensor, ...]:
    """One training step: (y, dx, dW, db)."""
    layer.weight.grad = layer.bias.grad = None
    x = x.detach().requires_grad_(True)
    with fp8_autocast():
        y = run(x)
    y.backward(g)
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


def _inputs(m: int, k: int, n: int):
    torch.manual_seed(1)
    return torch.randn(m, k, device="cuda", dtype=torch.bfloat16), torch.randn(m, n, device="cuda",
                                                                               dtype=torch.bfloat16)  # fmt: skip


def _compare(name: str, got, want, exact: tuple[bool, ...]) -> list[str]:
    failures = []
    for label, a, b, bits in zip(("y", "dx", "dW", "db"), got, want, exact):
        if bits and not torch.equal(a.view(torch.int16), b.view(torch.int16)):
            diff = (a.float() - b.float()).abs().max().item()
            failures.append(f"{name} {label}: bits differ from eager (max |diff| {diff:.3g})")
        elif not bits and not torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2):
            failures.append(f"{name} {label}: not within 1e-2 of eager")
    return failures


def _kernels(fn) -> collections.Counter:
    """CUDA kernels (and memcpy/memset) of one call of ``fn``, by name."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            names[event.name] += 1
    return names


def _short(counter: collections.Counter, top: int = 6) -> str:
    return ", ".join(f"{name[:48]} {count}" for name, count in counter.most_common(top))


def check(name: str, recipe, lines: list[str]) -> list[str]:
    failures = []
    torch.compiler.reset()
    for shape, backends in ((MAIN, ("aot_eager", "inductor")), (RAGGED, ("aot_eager",))):
        m, k, n = shape
        x, g = _inputs(m, k, n)
        eager_layer = _layer(recipe, k, n)
        want = _step(eager_layer, eager_layer, x, g)
        for backend in backends:
            layer = _layer(recipe, k, n)
            compiled = torch.compile(layer, backend=backend, fullgraph=True)
            start = time.perf_counter()
            got = _step(compiled, layer, x, g)
            compile_s = time.perf_counter() - start
            exact = (True, True, True, backend == "aot_eager")
            found = _compare(f"{name} {m}x{k}->{n} {backend}", got, want, exact)
            failures += found
            verdict = "FAIL" if found else "ok"
            lines.append(f"| {name} | {m}x{k}->{n} | {backend} | {verdict} | {compile_s:.1f} | | |")
            if backend == "inductor":
                _step(compiled, layer, x, g)  # warm
                traced = _kernels(lambda: _step(compiled, layer, x, g))
                _step(eager_layer, eager_layer, x, g)
                eager = _kernels(lambda: _step(eager_layer, eager_layer, x, g))
                lines.append(f"| {name} | {m}x{k}->{n} | kernels per step | | | eager {sum(eager.values())}: "
                             f"{_short(eager)} | compiled {sum(traced.values())}: {_short(traced)} |")  # fmt: skip
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = os.path.join(os.environ["OUT"], "traced_gpu_check.md") if os.environ.get("OUT") else None
    parser.add_argument("--out", default=default_out, help="markdown file to write")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("traced-gpu-check: skipped, no CUDA device (this check needs an NVIDIA GPU, sm_89+)")
        return 0
    capability = torch.cuda.get_device_capability()
    cuda = tuple(int(p) for p in torch.version.cuda.split(".")[:2]) if torch.version.cuda else None
    recipes, skipped = _recipes(capability, cuda)
    lines = ["# Compiled fine-grained layer step vs eager on the GPU", "",
             f"- command: `python -m benchmarks traced-gpu-check{' --out ' + args.out if args.out else ''}`",
             f"- device: {torch.cuda.get_device_name()} (sm_{capability[0]}{capability[1]}), torch {torch.__version__},"
             f" CUDA {torch.version.cuda}; date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             *[f"- {line}" for line in skipped], "",
             "| recipe | shape | run | bits | first step s | eager | compiled |", "|---|---|---|---|---:|---|---|"]  # fmt: skip
    failures = []
    for name, recipe in recipes.items():
        try:
            failures += check(name, recipe, lines)
        except Exception as error:  # report and go on with the other recipes
            failures.append(f"{name}: {type(error).__name__}: {error}")
    lines += ["", *(f"- FAIL {f}" for f in failures)] if failures else ["", "All compiled steps match the eager steps."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
