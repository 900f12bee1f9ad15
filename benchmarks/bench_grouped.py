"""The grouped GEMM of one mixture-of-experts projection, forward + backward: each FP8 recipe against bf16 and fp32
grouped GEMMs (``torch._grouped_mm``) and a per-expert loop of bf16 GEMMs.

Expert shapes (the gate/up projection, hidden -> 2 x expert hidden, and the down projection):

* ``deepseek-v3``: hidden 7168, expert hidden 2048, 256 routed experts, 8 per token;
* ``qwen3-30b-a3b``: hidden 2048, expert hidden 768, 128 experts, 8 per token.

Tokens are routed with a realistic skew: expert popularity falls as ``1 / rank**skew`` and a fraction of the experts
(``--empty``) gets no token at all. On a CPU (``--suite cpu``, the default without CUDA) the shapes are divided by
``--shrink`` and fewer experts and tokens run; FP8 is emulated there (exact FP8 values in float32 GEMMs), so the
numbers show the emulation's cost, not a speed-up. On a GPU the goal is a grouped FP8 step at least 1.3x faster
than the bf16 grouped GEMM; there the rowwise recipe is also timed through each grouped kernel by name (``fp8 rowwise
torch``: ``torch._scaled_grouped_mm``, ``fp8 rowwise triton``: the Triton grouped GEMM; ``fp8 rowwise``: the default).

Usage::

    python -m benchmarks grouped --suite cpu
    python -m benchmarks grouped --suite gpu --models deepseek-v3
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks.bench_common import bar_plot, header, interleaved_medians, markdown_table, run_folder, write_results

from fp8_lightning import fp8_grouped_mm
from fp8_lightning.grouped.gemm import GroupedScaling
from fp8_lightning.roofline import device_roofline, experts_cost
from fp8_lightning.recipes import recipe_from
from fp8_lightning.settings import reload_settings

MODELS = {  # hidden, expert hidden, experts, experts per token
    "deepseek-v3": (7168, 2048, 256, 8),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
}
SUITES = {"gpu": dict(tokens=4096, shrink=1, experts=None), "cpu": dict(tokens=256, shrink=8, experts=16)}
RECIPES = ["delayed", "tensorwise", "mxfp8", "rowwise", "blockwise"]
TARGET = 1.3


def skewed_counts(tokens: int, experts: int, top_k: int, skew: float, empty: float, seed: int = 0) -> torch.Tensor:
    """Tokens per expert for ``tokens * top_k`` routed rows: popularity ``1 / rank**skew``, the least popular
    ``empty`` fraction of the experts with none."""
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** skew
    weights[experts - int(empty * experts):] = 0
    picks = torch.multinomial(weights, tokens * top_k, replacement=True, generator=g)
    return torch.bincount(picks, minlength=experts)


def projections(model: str, shrink: int, experts: int | None) -> tuple[list[tuple[str, int, int]], int, int]:
    hidden, inner, total, top_k = MODELS[model]
    hidden, inner = hidden // shrink, inner // shrink
    return [("gate_up", hidden, 2 * inner), ("down", inner, hidden)], experts or total, top_k


BASELINES = ["bf16 grouped", "fp32 grouped", "bf16 per-expert loop"]


def configurations(a, b, offs, counts, dtype, recipes=RECIPES, baselines=BASELINES, grad_fast_accum=False,
                   microbatches: int = 1):
    """name -> a function that runs one training step ("bf16 grouped", the reference, always runs): the weight
    changed in place (an optimizer step), then ``microbatches`` forward + backward passes accumulating its gradient.
    Each FP8 row keeps its scaling state across steps, so its micro-batches share one weight cast, as a converted
    experts module's do. ``grad_fast_accum``: each recipe also with fast accumulation in its two gradient GEMMs."""
    g = torch.randn(a.shape[0], b.shape[2], dtype=dtype, device=a.device)
    experts = b.shape[0]

    def step(fn):
        w = b.detach().clone().requires_grad_()

        def run():
            with torch.no_grad():
                w.mul_(1.0)  # a new weight version: the FP8 weight cast is made again
            for _ in range(microbatches):
                fn(a.detach().requires_grad_(), w).backward(g)
        return run

    def loop(x, w):
        return torch.cat([x[s:e] @ w[i] for i, (s, e) in enumerate(zip([0, *offs.tolist()[:-1]], offs.tolist()))])

    def fp8(recipe):
        scaling = GroupedScaling(recipe_from(recipe), experts)
        return lambda x, w: fp8_grouped_mm(x, w, offs, out_dtype=dtype, scaling=scaling)

    fns = {
        "bf16 grouped": step(lambda x, w: torch._grouped_mm(x.bfloat16(), w.bfloat16(), offs)),
        "fp32 grouped": step(lambda x, w: torch._grouped_mm(x.float(), w.float(), offs)),
        "bf16 per-expert loop": step(lambda x, w: loop(x.bfloat16(), w.bfloat16())),
    }
    fns = {name: fn for name, fn in fns.items() if name == "bf16 grouped" or name in baselines}
    variants = {f"fp8 {name}": name for name in recipes}
    if grad_fast_accum:
        variants.update({f"fp8 {name} grad-fast-accum": {"name": name, "grad_fast_accum": True} for name in recipes})
    for label, recipe in variants.items():
        fns[label] = step(fp8(recipe))
    if "rowwise" in recipes and a.is_cuda:  # the rowwise recipe through each grouped kernel, named
        for route in ("torch", "triton"):
            fns[f"fp8 rowwise {route}"] = with_route(route, fns["fp8 rowwise"])
    return fns


def modelled_speedup(config: str, m: int, experts: int, k: int, n: int, microbatches: int, device) -> float | None:
    """What the roofline of :func:`fp8_lightning.roofline.experts_cost` gives an FP8 row on a CUDA device
    (None for the high-precision rows and off CUDA): the ceiling that the casts' bytes leave the measured row."""
    if device.type != "cuda" or not config.startswith("fp8 "):
        return None
    recipe = recipe_from(config.split()[1])
    roofline = device_roofline(device)
    return experts_cost(m, experts, k, n, recipe, roofline, weight_casts=1 / microbatches).speedup


def with_route(route: str, fn):
    """``fn`` run with ``FP8_LIGHTNING_GROUPED_GEMM=route`` (the settings are re-read around each call)."""

    def run():
        os.environ["FP8_LIGHTNING_GROUPED_GEMM"] = route
        reload_settings()
        try:
            return fn()
        finally:
            os.environ.pop("FP8_LIGHTNING_GROUPED_GEMM", None)
            reload_settings()

    return run


def profile_table(fn, device: torch.device, steps: int = 3) -> str:
    """torch.profiler's table of the kernels of ``steps`` calls of ``fn`` (device time, then host time), and the
    host-device copies (each a wait of the host on the device where they read a device tensor)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    fn()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    averages = prof.key_averages()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return (f"{steps} calls\n\n" + averages.table(sort_by=key, row_limit=25, max_name_column_width=60) + "\n"
            + averages.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))


def roofline_table(devices: list[str], token_counts: list[int], recipes: list[str]) -> str:
    """The roofline ceiling (:func:`~fp8_lightning.roofline.experts_cost`) of each recipe's grouped step vs bf16
    at the models' full shapes, on datasheet devices, per tokens per expert, with 1 and 8 micro-batches per weight
    cast: where FP8 experts can pay off at all, computed without a GPU."""
    from fp8_lightning.roofline import KNOWN_DEVICES

    table = dict(KNOWN_DEVICES)
    lines = ["| device | projection | K | N | recipe | " + " | ".join(
        f"{t} tok/expert{' x8 mb' if mb > 1 else ''}" for mb in (1, 8) for t in token_counts) + " |"]
    lines.append("|---" * 5 + "|---:" * (2 * len(token_counts)) + "|")
    for name in devices:
        roofline = table[name]
        for model in MODELS:
            shapes, experts, _ = projections(model, 1, None)
            for projection, k, n in shapes:
                for recipe in recipes:
                    cells = [experts_cost(t * experts, experts, k, n, recipe_from(recipe), roofline,
                                          weight_casts=1 / mb).speedup for mb in (1, 8) for t in token_counts]
                    lines.append(f"| {roofline.name} | {model} {projection} | {k} | {n} | {recipe} | "
                                 + " | ".join(f"{c:.2f}x" for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=sorted(SUITES), default="gpu" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--tokens", type=int, nargs="+", help="tokens per micro-batch (each routed to top-k experts); "
                        "several values run one after the other")
    parser.add_argument("--microbatches", type=int, default=1,
                        help="micro-batches per step sharing one weight (gradient accumulation)")
    parser.add_argument("--shrink", type=int, help="divide hidden sizes by this (CPU runs)")
    parser.add_argument("--experts", type=int, help="experts to run (default: the model's on GPU)")
    parser.add_argument("--skew", type=float, default=1.0)
    parser.add_argument("--empty", type=float, default=0.125, help="fraction of experts routed no token")
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=RECIPES, help="FP8 recipes to time")
    parser.add_argument("--baselines", nargs="*", choices=BASELINES, default=BASELINES,
                        help="high-precision rows to time besides bf16 grouped (the per-expert loop is slow)")
    parser.add_argument("--profile", action="store_true",
                        help="also write a torch.profiler kernel table of each FP8 row (profile-<shape>-<row>.txt)")
    parser.add_argument("--grad-fast-accum", action="store_true",
                        help="also time each recipe with fast accumulation in the gradient GEMMs")
    parser.add_argument("--roofline", nargs="+", metavar="DEVICE",
                        help="print the roofline ceilings on these datasheet devices (e.g. H100 B200) and exit")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", help="output folder (default benchmarks/results/perf-grouped-<device>-<date>)")
    args = parser.parse_args(argv)
    if args.roofline:
        print(roofline_table(args.roofline, args.tokens or [128, 512, 2048, 8192], args.recipes))
        return
    preset = SUITES[args.suite]
    token_counts, shrink = args.tokens or [preset["tokens"]], args.shrink or preset["shrink"]
    device = torch.device("cuda" if args.suite == "gpu" else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows, groups, series, profiles = [], [], {}, {}
    for model, tokens in ((model, tokens) for model in args.models for tokens in token_counts):
        shapes, experts, top_k = projections(model, shrink, args.experts or preset["experts"])
        counts = skewed_counts(tokens, experts, top_k, args.skew, args.empty)
        offs = torch.cumsum(counts, 0).to(torch.int32).to(device)
        for name, k, n in shapes:
            torch.manual_seed(0)
            a = torch.randn(int(counts.sum()), k, dtype=dtype, device=device)
            b = torch.randn(experts, n, k, dtype=dtype, device=device).transpose(-2, -1) / k**0.5  # (E, K, N)
            fns = configurations(a, b, offs, counts, dtype, args.recipes, args.baselines, args.grad_fast_accum,
                                 args.microbatches)
            times = interleaved_medians(fns, device, args.warmup, args.rounds)
            label = f"{model} {name}" + (f" {tokens} tokens" if len(token_counts) > 1 else "")
            if args.profile:
                for config in (c for c in fns if c.startswith("fp8 ")):
                    tag = config[4:].replace(" ", "-")
                    profiles[f"profile-{model}-{name}-{tag}-{tokens}.txt"] = profile_table(fns[config], device)
            groups.append(label)
            for config, seconds in times.items():
                ratio = times["bf16 grouped"] / seconds
                model_ratio = modelled_speedup(config, a.shape[0], experts, k, n, args.microbatches, device)
                rows.append(dict(shape=label, experts=experts, rows=int(counts.sum()), k=k, n=n,
                                 empty_experts=int((counts == 0).sum()), max_tokens=int(counts.max()),
                                 config=config, ms=1e3 * seconds, vs_bf16=ratio,
                                 modelled="-" if model_ratio is None else f"{model_ratio:.2f}x"))  # fmt: skip
                series.setdefault(config, []).append(ratio)
    folder = run_folder("grouped", device, args.out)
    head = header("grouped", device, argv)
    columns = [("shape", "shape", "{}"), ("experts", "experts", "{}"), ("rows", "routed rows", "{}"),
               ("empty_experts", "empty", "{}"), ("max_tokens", "max/expert", "{}"), ("k", "K", "{}"),
               ("n", "N", "{}"), ("config", "config", "{}"), ("ms", "ms (fwd+bwd)", "{:.2f}"),
               ("vs_bf16", "speed vs bf16 grouped", "{:.2f}x"), ("modelled", "roofline ceiling", "{}")]  # fmt: skip
    notes = (f"Suite {args.suite}: {', '.join(map(str, token_counts))} tokens per micro-batch, "
             f"{args.microbatches} micro-batch(es) per weight step, top-k routing with skew {args.skew} and {args.empty:.0%} of the "
             f"experts empty, hidden sizes divided by {shrink}. Goal on a GPU: FP8 >= {TARGET}x bf16 grouped. "
             "Roofline ceiling (CUDA only): fp8_lightning.roofline.experts_cost for the row's recipe, the speed "
             "the casts' bytes leave it at best.")
    write_results(folder, head, rows, markdown_table(columns, rows), notes)
    for file, table in profiles.items():
        (folder / file).write_text(table)
    bar_plot(folder / "grouped.png", groups, series, "speed vs bf16 grouped GEMM",
             "MoE grouped GEMM forward+backward", target=TARGET if device.type == "cuda" else None)


if __name__ == "__main__":
    main()
