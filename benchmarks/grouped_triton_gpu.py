"""The Triton grouped FP8 GEMM on a GPU: first right (against float64 math), then fast (against bf16 and torch's).

1. Correctness: both kernels (2-D x 3-D with weights stored (E, K, N) and (E, N, K); the ragged 2-D x 2-D) on CUDA
   against float64 math on the same FP8 operands and scales, at small shapes with empty groups, groups that are no
   multiple of 16 and one group holding every token. Tolerance: float32 accumulation over K plus bf16 rounding.
2. The GEMM alone, at expert shapes with skewed routing (the 2-D x 3-D fprop of gate_up and down, and the wgrad):
   bf16 ``torch._grouped_mm``, ``torch._scaled_grouped_mm`` (rowwise, where torch has it) and the Triton kernel,
   on already-quantized operands.
3. The whole forward + backward of one projection: bf16 ``torch._grouped_mm`` against ``fp8_grouped_mm`` under the
   rowwise recipe through torch's kernel and through the Triton kernel (``FP8_LIGHTNING_GROUPED_GEMM``).

DeepSeek-V3's experts run with ``--deepseek-experts`` (64 by default, of 256) and the same average tokens per expert
as 4096 tokens over 256 experts, so that the weights and their gradients fit an 80 GB H100; Qwen3-30B-A3B runs whole.

Usage::

    python -m benchmarks grouped-triton --out results/grouped-triton.md
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from benchmarks.bench_grouped import skewed_counts, with_route
from fp8_lightning import fp8_grouped_mm

E4M3 = torch.float8_e4m3fn
CHECKS = {  # name: (tokens per expert, K, N)
    "ragged + empty": ([0, 5, 33, 17, 0, 40, 1, 0], 256, 192),
    "one expert holds all": ([0, 300, 0], 512, 384),
    "16 experts, skewed": ([200, 90, 0, 31, 7, 1, 0, 64, 3, 0, 18, 250, 2, 0, 9, 77], 1024, 512),
}
SHAPES = {  # model: (hidden, expert hidden, experts, routed rows per expert on average)
    "deepseek-v3": (7168, 2048, 256, 128),
    "qwen3-30b-a3b": (2048, 768, 128, 256),
}


def fp8_codes(shape, g, device):
    """Random e4m3 codes (``g``: a CPU generator for reproducible small checks; None: drawn on the device)."""
    x = torch.randn(*shape, generator=g) if g is not None else torch.randn(*shape, device=device)
    return (x * 32).clamp(-448, 448).to(E4M3).to(device)


def check_close(name, got, want, bound, lines, failures, peer=None):
    """Pass when ``got`` is within bf16 rounding plus the accumulation error of the float64 value: float32's in the
    interpreter, and on a GPU no worse than 1.5 times the error of torch's own FP8 grouped GEMM (``peer``, same
    operands, same accumulation mode) where torch has one, else 2**-12 of the sum of |terms| (Hopper's tensor
    cores accumulate FP8 products in fewer bits than float32 between promotions)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    rel = 2**-7 if interpreted else 2**-8  # the interpreter truncates to bf16
    err = (got.double() - want).abs()
    if peer is not None:
        peer_err = (peer.double() - want).abs()
        bad = (err > 1.5 * peer_err.max() + 1e-30) | ~torch.isfinite(got)
    else:
        accumulation = 2**-20 if interpreted else 2**-12
        bad = (err > rel * want.abs() + accumulation * bound + 1e-30) | ~torch.isfinite(got)
    worst = (err / bound.clamp(min=1e-30)).max().item() if want.numel() else 0.0
    peer_worst = "n/a" if peer is None else f"{(peer.double() - want).abs().max().item():.3g}"
    lines.append(f"| {name} | {tuple(got.shape)} | {err.max().item() if want.numel() else 0.0:.3g} | {peer_worst} "
                 f"| {worst:.2e} | {'FAIL' if bad.any() else 'ok'} |")
    failures += [name] if bad.any() else []


def correctness(lines, failures, device: str = "cuda") -> None:
    from fp8_lightning.kernels.grouped_gemm import grouped_mm_2d2d, grouped_mm_2d3d

    has_torch = device == "cuda" and hasattr(torch, "_scaled_grouped_mm") and torch.cuda.get_device_capability()[0] == 9
    lines += ["## Correctness on CUDA against float64", "",
              "The error of the bf16 output, torch's `_scaled_grouped_mm` on the same operands where it runs, and the",
              "worst error over the sum of |terms| (float32 output: the accumulation alone).", "",
              "| case | out | max abs err | torch's | accumulation err / sum of abs | result |", "|---|---|---|---|---|---|"]
    for case, (sizes, k, n) in CHECKS.items():
        g = torch.Generator().manual_seed(0)
        m, e = sum(sizes), len(sizes)
        offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
        a, b = fp8_codes((m, k), g, device), fp8_codes((e, k, n), g, device)
        sa, sb = torch.rand(m, generator=g) + 0.5, torch.rand(e, n, generator=g) + 0.5
        a64, b64 = a.double().cpu(), b.double().cpu()
        want, bound = torch.zeros(m, n, dtype=torch.float64), torch.zeros(m, n, dtype=torch.float64)
        for i, (s, t) in enumerate(zip([0, *offs.tolist()[:-1]], offs.tolist())):
            scale = sa[s:t].double()[:, None] * sb[i].double()[None, :]
            want[s:t], bound[s:t] = (a64[s:t] @ b64[i]) * scale, (a64[s:t].abs() @ b64[i].abs()) * scale
        args = (sa.to(device), sb.to(device), offs.to(device))
        for fast in (False, True):
            mode = " fast" if fast else ""
            for storage, weight in (("EKN", b), ("ENK", b.transpose(1, 2).contiguous().transpose(1, 2))):
                got = grouped_mm_2d3d(a, weight, *args, torch.bfloat16, fast_accum=fast).cpu()
                peer = None
                if has_torch and storage == "ENK":
                    peer = torch._scaled_grouped_mm(a, weight, args[0], args[1], offs=args[2],
                                                    out_dtype=torch.bfloat16, use_fast_accum=fast).cpu()
                check_close(f"{case} 2d3d {storage}{mode}", got, want, bound, lines, failures, peer)
            got32 = grouped_mm_2d3d(a, b, *args, torch.float32, fast_accum=fast).cpu()
            check_close(f"{case} 2d3d fp32{mode}", got32, want, bound, lines, failures)
        # wgrad: a (n, M) by b (M, k) in the padded layout (every group starts at a multiple of 16)
        padded = [-(-max(s, 1) // 16) * 16 for s in sizes]
        pends = torch.cumsum(torch.tensor(padded), 0).to(torch.int32)
        x, y = fp8_codes((n, int(pends[-1])), g, device), fp8_codes((k, int(pends[-1])), g, device)
        for p, s, q in zip([0, *pends.tolist()[:-1]], sizes, pends.tolist()):
            x[:, p + s : q], y[:, p + s : q] = 0, 0  # zeros past each group's tokens, as the cast writes them
        sx, sy = torch.rand(e, n, generator=g) + 0.5, torch.rand(e, k, generator=g) + 0.5
        x64, y64 = x.double().cpu(), y.double().cpu()
        want, bound = torch.zeros(e, n, k, dtype=torch.float64), torch.zeros(e, n, k, dtype=torch.float64)
        for i, (p, q) in enumerate(zip([0, *pends.tolist()[:-1]], pends.tolist())):
            scale = sx[i].double()[:, None] * sy[i].double()[None, :]
            want[i] = (x64[:, p:q] @ y64[:, p:q].t()) * scale
            bound[i] = (x64[:, p:q].abs() @ y64[:, p:q].abs().t()) * scale
        for fast in (False, True):
            for out_dtype in (torch.bfloat16, torch.float32):
                got = grouped_mm_2d2d(x, y.t(), sx.to(device), sy.to(device), pends.to(device), out_dtype,
                                      aligned=True, fast_accum=fast).cpu()
                label = f"{case} 2d2d wgrad{' fp32' if out_dtype == torch.float32 else ''}{' fast' if fast else ''}"
                check_close(label, got, want, bound, lines, failures)


def timed(fn, rounds: int) -> float:
    """Median seconds of ``fn`` over ``rounds`` calls (CUDA events), after two warm-up calls (autotuning)."""
    fn(), fn()
    if not torch.cuda.is_available():  # a dry run of the script's logic (the interpreter on CPU)
        return min(_host_seconds(fn) for _ in range(rounds))
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _host_seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def speed(args, lines, device: str = "cuda") -> None:
    from fp8_lightning.kernels.grouped_gemm import grouped_mm_2d2d, grouped_mm_2d3d

    has_torch = device == "cuda" and hasattr(torch, "_scaled_grouped_mm") and torch.cuda.get_device_capability()[0] == 9
    lines += ["", "## Speed (median ms; speed-up vs bf16 torch._grouped_mm in brackets)", "",
              "| shape | experts | rows | K | N | what | bf16 | torch fp8 | triton fp8 |", "|---|---|---|---|---|---|---|---|---|"]
    for model, (hidden, inner, experts, per_expert) in SHAPES.items():
        experts = args.deepseek_experts if model == "deepseek-v3" else experts
        counts = skewed_counts(experts * per_expert // 8, experts, 8, args.skew, 0.125)
        counts = (counts + 15) // 16 * 16  # torch's grouped GEMMs assert 16-byte multiples along the ragged dimension
        offs = torch.cumsum(counts, 0).to(torch.int32).to(device)
        m = int(counts.sum())
        for name, k, n in (("gate_up", hidden, 2 * inner), ("down", inner, hidden)):
            torch.manual_seed(0)
            a16 = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            w16 = torch.randn(experts, n, k, device=device, dtype=torch.bfloat16) / k**0.5
            a8, w8 = fp8_codes((m, k), None, device), fp8_codes((experts, n, k), None, device)
            sa, sb = torch.rand(m, device=device) + 0.5, torch.rand(experts, n, device=device) + 0.5
            row = f"| {model} {name} | {experts} | {m} | {k} | {n} "
            gemm = {"bf16": lambda: torch._grouped_mm(a16, w16.transpose(1, 2), offs),
                    "triton": lambda: grouped_mm_2d3d(a8, w8.transpose(1, 2), sa, sb, offs, torch.bfloat16,
                                                      fast_accum=True)}
            if has_torch:  # fprop with fast accumulation, as the recipes' default fprop_fast_accum=True
                gemm["torch"] = lambda: torch._scaled_grouped_mm(a8, w8.transpose(1, 2), sa, sb, offs=offs,
                                                                 out_dtype=torch.bfloat16, use_fast_accum=True)
            lines.append(row + "| fprop GEMM " + cells({key: timed(fn, args.rounds) for key, fn in gemm.items()}))
            padded = (counts.clamp(min=1) + 15) // 16 * 16  # the columnwise copies' layout: groups padded to 16
            pends = torch.cumsum(padded, 0).to(torch.int32).to(device)
            x_t, g_t = fp8_codes((k, int(pends[-1])), None, device), fp8_codes((n, int(pends[-1])), None, device)
            sx, sg = torch.rand(experts, k, device=device) + 0.5, torch.rand(experts, n, device=device) + 0.5
            g16, x16 = torch.randn(n, m, device=device, dtype=torch.bfloat16), a16
            wgrad = {"bf16": lambda: torch._grouped_mm(g16, x16, offs),
                     "triton": lambda: grouped_mm_2d2d(g_t, x_t.t(), sg, sx, pends, torch.bfloat16, aligned=True)}
            if has_torch:
                wgrad["torch"] = lambda: torch._scaled_grouped_mm(g_t, x_t.t(), sg.reshape(-1), sx.reshape(-1),
                                                                  offs=pends, out_dtype=torch.bfloat16)
            lines.append(row + "| wgrad GEMM " + cells({key: timed(fn, args.rounds) for key, fn in wgrad.items()}))
            grad = torch.randn(m, n, device=device, dtype=torch.bfloat16)
            b = w16.transpose(1, 2)

            def step(fn):
                def run():
                    x, w = a16.detach().requires_grad_(), b.detach().requires_grad_()
                    fn(x, w).backward(grad)
                return run

            whole = {"bf16": step(lambda x, w: torch._grouped_mm(x, w, offs)),
                     "triton": with_route("triton", step(lambda x, w: fp8_grouped_mm(x, w, offs, "rowwise")))}
            if has_torch:
                whole["torch"] = with_route("torch", step(lambda x, w: fp8_grouped_mm(x, w, offs, "rowwise")))
            lines.append(row + "| fwd+bwd step " + cells({key: timed(fn, args.rounds) for key, fn in whole.items()}))
            print(lines[-3], lines[-2], lines[-1], sep="\n", flush=True)
            torch.cuda.empty_cache()


def cells(times: dict) -> str:
    bf16 = times["bf16"]
    out = [f"{1e3 * bf16:.3f}"]
    for key in ("torch", "triton"):
        out.append(f"{1e3 * times[key]:.3f} ({bf16 / times[key]:.2f}x)" if key in times else "n/a")
    return "| " + " | ".join(out) + " |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the report (Markdown) here too")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--skew", type=float, default=1.0)
    parser.add_argument("--deepseek-experts", type=int, default=64)
    parser.add_argument("--check-only", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("grouped-triton: no CUDA device here; run it on a GPU machine")
        return 1
    start = time.time()
    lines = [f"# Triton grouped FP8 GEMM: {torch.cuda.get_device_name()}, torch {torch.__version__}", ""]
    failures: list[str] = []
    correctness(lines, failures)
    print("\n".join(lines), flush=True)
    if not failures and not args.check_only:
        speed(args, lines)
    lines.append(f"\n{'FAILED: ' + ', '.join(failures) if failures else 'all checks passed'} "
                 f"({time.time() - start:.0f} s)")
    report = "\n".join(lines)
    print(lines[-1])
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
