"""Linear layer forward + backward: fp32, bf16 and each FP8 recipe (and torchao.float8 when installed).

For each shape (M tokens, K inputs, N outputs) one training iteration of a single linear layer (forward, backward
to the input and the weight) is timed for every configuration, interleaved (see ``bench_common``). Reported:
median milliseconds, and speedups over bf16 and over fp32 measured in the same run.

* ``--suite gpu`` (default on CUDA): squares M = K = N in 1024, 2048, 4096, 8192; with ``--llama`` instead the
  linear layers of Llama-3-8B at 8192 tokens (hidden 4096, 8 KV heads of 128, FFN 14336: wq/wo 4096->4096,
  wk/wv 4096->1024, w1/w3 4096->14336, w2 14336->4096), the shapes torchao publishes its float8 speed-ups for
  (a separate run: each shape compiles every configuration again). bf16 autocast around FP8 layers (bf16
  output). Targets printed with the results: 8192 cubed tensorwise >= 1.6x bf16, and no FP8 row slower than bf16.
* ``--suite cpu`` (default without CUDA): s in 128, 256, 512; float32 around FP8 layers. FP8 is emulated on a
  CPU (exact FP8 values in float32 GEMMs), so these numbers show the emulation's cost, not a speedup.
* ``--compile``: wrap every configuration in ``torch.compile`` (same settings for all, the peer included).

Usage::

    python -m benchmarks linear --suite cpu
    python -m benchmarks linear --suite gpu --compile
"""

from __future__ import annotations

import argparse
import copy
import importlib.util

import torch
import torch.nn as nn

from benchmarks.bench_common import bar_plot, header, interleaved_medians, markdown_table, run_folder, write_results

from fp8_lightning import convert_to_fp8, fp8_autocast
from fp8_lightning.testing import linear_targets

SUITES = {"gpu": [1024, 2048, 4096, 8192], "cpu": [128, 256, 512]}
LLAMA3_8B_TOKENS = 8192
LLAMA3_8B_LINEARS = {"wq/wo": (4096, 4096), "wk/wv": (4096, 1024), "w1/w3": (4096, 14336), "w2": (14336, 4096)}


def suite_shapes(suite: str, sizes: list[int] | None, llama: bool = False) -> list[tuple[str, int, int, int]]:
    """(label, M, K, N) for each shape: the Llama-3-8B layers with ``llama``, else squares (``sizes`` or the
    suite's)."""
    if llama:
        return [(f"llama3-8b {name}", LLAMA3_8B_TOKENS, k, n) for name, (k, n) in LLAMA3_8B_LINEARS.items()]
    return [(str(s), s, s, s) for s in sizes or SUITES[suite]]


RECIPES = ["delayed", "tensorwise", "mxfp8", "rowwise", "blockwise"]


def torchao_status() -> str:
    if importlib.util.find_spec("torchao") is None:
        return "not installed"
    try:
        from torchao.float8 import convert_to_float8_training  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any import failure means the peer cannot run
        return f"unusable: {error}"
    return "installed"


def configurations(m: int, k: int, n: int, device: torch.device, compile_: bool) -> dict:
    """name -> callable doing one forward+backward of an (M, K) input through a K -> N layer."""
    base = nn.Linear(k, n, bias=False, device=device)
    x32 = torch.randn(m, k, device=device, requires_grad=True)
    cuda = device.type == "cuda"

    def step(layer: nn.Module, x: torch.Tensor, fp8: bool, autocast: bool):
        run = torch.compile(layer) if compile_ else layer

        params = list(layer.parameters())

        def fn():
            with torch.autocast(device.type, torch.bfloat16, enabled=autocast), fp8_autocast(enabled=fp8):
                y = run(x)
            y.backward(torch.ones_like(y))
            x.grad = None
            with torch.no_grad():  # stands in for an optimizer step: FP8 weights are cast again, as in training
                for p in params:
                    p.grad = None
                    p.mul_(1.0)

        return fn

    configs = {"fp32": step(copy.deepcopy(base), x32, False, False)}
    x16 = x32.detach().to(torch.bfloat16).requires_grad_()
    configs["bf16"] = step(copy.deepcopy(base).to(torch.bfloat16), x16, False, False)
    for recipe in RECIPES:
        layer = copy.deepcopy(base)
        convert_to_fp8(layer, recipe, profitability=False)
        configs[f"fp8 {recipe}"] = step(layer, x32, True, cuda)
    if torchao_status() == "installed":
        from torchao.float8 import convert_to_float8_training

        peer = nn.Sequential(copy.deepcopy(base))
        convert_to_float8_training(peer)
        configs["torchao tensorwise"] = step(peer, x32, False, cuda)
    return configs


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=sorted(SUITES), default="gpu" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", type=int, nargs="*", help="override the suite's sizes")
    parser.add_argument("--llama", action="store_true", help="the Llama-3-8B layer shapes at 8192 tokens instead")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (one: no contention on a shared host)")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--out", help="run folder (default benchmarks/results/perf-linear-<device>-<date>)")
    parser.add_argument("--dry-run", action="store_true", help="print the shapes the run would time (label M K N), "
                        "then exit without timing anything")
    args = parser.parse_args(argv)
    if args.dry_run:
        print("\n".join(" ".join(map(str, shape)) for shape in suite_shapes(args.suite, args.sizes, args.llama)))
        return []
    device = torch.device("cuda" if args.suite == "gpu" else "cpu")
    threads_before = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    head = header("linear", device, argv)  # after set_num_threads: the device label names the thread count
    head["torchao"] = torchao_status()
    rows = []
    for label, m, k, n in suite_shapes(args.suite, args.sizes, args.llama):
        medians = interleaved_medians(configurations(m, k, n, device, args.compile), device, args.warmup, args.rounds)
        for name, seconds in medians.items():
            rows.append({
                "size": label, "config": name, "ms": seconds * 1e3,
                "speedup_vs_bf16": medians["bf16"] / seconds, "speedup_vs_fp32": medians["fp32"] / seconds,
            })  # fmt: skip
    torch.set_num_threads(threads_before)
    folder = run_folder("linear", device, args.out)
    columns = [("size", "M=K=N, or layer", "{}"), ("config", "configuration", "{}"),
               ("ms", "fwd+bwd ms (median)", "{:.3f}"),
               ("speedup_vs_bf16", "speedup vs bf16", "{:.2f}"), ("speedup_vs_fp32", "speedup vs fp32", "{:.2f}")]  # fmt: skip
    notes = (
        f"One linear layer (no bias), forward + backward + an in-place weight update (so FP8 weights are cast "
        f"every iteration, as in training), {args.rounds} interleaved rounds, median. "
        f"torch.compile: {'on' if args.compile else 'off'}. torchao.float8 peer: {head['torchao']}."
        + (" CPU: FP8 is emulated (exact FP8 values, float32 GEMMs): the FP8 rows show its cost." if device.type == "cpu" else "")
    )
    notes += linear_targets(rows) if device.type == "cuda" else ""
    write_results(folder, head, rows, markdown_table(columns, rows), notes)
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    names = [n for n in dict.fromkeys(r["config"] for r in rows) if n != "bf16"]
    series = {n: [next(r["speedup_vs_bf16"] for r in rows if r["size"] == s and r["config"] == n) for s in sizes] for n in names}
    bar_plot(folder / "linear.png", [str(s) for s in sizes], series, "speedup over bf16 (higher is faster)",
             f"Linear fwd+bwd, {head['device']}")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
