"""GPU check and benchmark of the Triton kernels (``fp8_lightning.kernels``): run it on an NVIDIA GPU (sm89+).

Check (bit for bit, both rounding modes of the cast kernels): every kernel on CUDA against its pure-torch twin on
CUDA (``FP8_LIGHTNING_DISABLE_TRITON=1``) and on CPU; the MX GEMM against float64 math within the float32
accumulation bound; and the core's dispatch (``quantize_tensorwise`` on a CUDA tensor takes the kernel).

Benchmark (times are medians of ``triton.testing.do_bench``, which flushes L2 between runs):

* per kernel, on bf16 inputs of 64 MB and 256 MB: achieved bandwidth = the bytes the operation must move
  (reads + writes, counted below per kernel) / time, as a fraction of the device-to-device copy bandwidth
  measured in the same run (``dst.copy_(src)`` on 256 MB: 2 bytes moved per byte copied). Target: >= 0.8.
  The pure-torch fallback is timed on the same shapes and counted with the same bytes.
* the MXFP8 GEMM at 4096 and 8192 cubed: TFLOP/s (2*M*N*K / time) of the Triton kernel against ``torch.matmul``
  in bf16 and against the pure-torch fallback (dequantize + float32 matmul). Target: faster than bf16. On Hopper
  also the opt-in Gluon kernel (``block_gemm_gluon``), whose wgmma overlaps the scale math, as a ratio to the
  shipped kernel; before that, the check runs it bit for bit against the shipped kernel on every tile.

Usage::

    python -m benchmarks kernels-gpu [--check-only] [--out benchmarks/results/kernels_gpu.md]

Writes Markdown and JSON (command, device, versions, date) and exits non-zero when a check fails. On a machine
without a suitable GPU it refuses with the reason and exit code 2; it never writes numbers there.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import platform
import sys
from pathlib import Path

import torch

from benchmarks import command as front_door_command
from fp8_lightning.ops import triton_ops
from fp8_lightning.blockwise import quantize_blockwise
from fp8_lightning.fine_grained import fine_cast_twin
from fp8_lightning.kernels.availability import (
    DISABLE_ENV,
    EXPLICIT_ROUNDING_ENV,
    GLUON_MX_GEMM_ENV,
    device_status,
    gluon_mx_gemm_status,
    kernels_usable,
)
from fp8_lightning.kernels.fine_grained_layout import TILES
from fp8_lightning.rowwise import quantize_rowwise
from fp8_lightning.settings import reload_settings
from fp8_lightning.ops.dispatch import (
    dequantize_operand,
    fast_amax as amax,
    fast_quantize_mx_operand as quantize_mx_operand,
    fast_quantize_mxfp8 as quantize_mxfp8,
    fast_quantize_tensorwise as quantize_tensorwise,
    fast_quantize_with_scale as quantize_with_scale,
)
from fp8_lightning.gemm import fp8_mm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MB = 2**20
BANDWIDTH_TARGET = 0.8


def refusal() -> str | None:
    """Why this machine cannot run the script (None when it can)."""
    if not torch.cuda.is_available():
        return "CUDA is not available on this machine; run it on an NVIDIA GPU with compute capability 8.9+"
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "TRITON_INTERPRET is set; unset it to run the compiled kernels"
    ok, reason = device_status("cuda")
    return None if ok else reason


@contextlib.contextmanager
def environment(**values: str):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    reload_settings()  # the library reads FP8_LIGHTNING_* once
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        reload_settings()


def pure(fn, *args, **kwargs):
    """The core's pure-torch path, on whatever device the arguments live."""
    with environment(**{DISABLE_ENV: "1"}):
        return fn(*args, **kwargs)


# --------------------------------------------------------------------------------------------------------
# Check
# --------------------------------------------------------------------------------------------------------


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes and bytes, NaN payloads aside (compared on CPU)."""
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype in (E4M3, E5M2, torch.float32, torch.bfloat16):
        a_nan, b_nan = torch.isnan(a.float()), torch.isnan(b.float())
        if not torch.equal(a_nan, b_nan):
            return False
        a, b = a[~a_nan], b[~b_nan]
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.view(width), b.view(width))


def check_inputs(device: str) -> dict[str, torch.Tensor]:
    """Wide dynamic range (every FP8 binade, subnormals, saturation), exact ties, and special values."""
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(1024, 4096, generator=g) * torch.exp2(torch.randint(-40, 24, (1024, 4096), generator=g).float())
    ties = torch.arange(1, 2**14, dtype=torch.float32) * 2.0**-12  # many exact midpoints for both formats
    wide.view(-1)[: ties.numel()] = ties
    wide[7, :8] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 3e38, -3e38, 448.0])
    return {"fp32": wide.to(device), "bf16": wide.bfloat16().to(device)}


def check_kernels() -> list[tuple[str, bool]]:
    results: list[tuple[str, bool]] = []
    inputs = check_inputs("cuda")
    for explicit in ("0",):  # "1" is ignored on a GPU (kernels.availability.explicit_rounding says why)
        with environment(**{EXPLICIT_ROUNDING_ENV: explicit}):
            tag = f"explicit_rounding={explicit}"
            for name, x in inputs.items():
                x_cpu = x.cpu()
                results.append((f"amax {name}", same_bytes(triton_ops.triton_amax(x), pure(amax, x))))
                for fp8 in (E4M3, E5M2):
                    for value in (1.0, 3.0 * 2.0**-9):  # 1.0 keeps the exact ties of check_inputs
                        scale = torch.tensor(value, device="cuda")
                        case = f"{name} {fp8} scale={value:g} {tag}"
                        data, x_amax = triton_ops.triton_cast(x, scale, fp8)
                        ref = pure(quantize_with_scale, x, scale, fp8)
                        results.append((f"cast {case} vs CUDA twin", same_bytes(data, ref)))
                        results.append((f"cast {case} vs CPU twin",
                                        same_bytes(data, quantize_with_scale(x_cpu, scale.cpu(), fp8))))
                        results.append((f"cast amax {case}", same_bytes(x_amax, pure(amax, x))))
                        d, d_t, _ = triton_ops.triton_cast_transpose(x, scale, fp8)
                        results.append((f"cast_transpose {case}",
                                        same_bytes(d, ref) and same_bytes(d_t, ref.t().contiguous())))
                    finite = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
                    got, ref_t = triton_ops.triton_tensorwise_cast(finite, fp8), pure(quantize_tensorwise, finite, fp8)
                    results.append((f"tensorwise_cast {name} {fp8} {tag}",
                                    same_bytes(got[0], ref_t[0]) and same_bytes(got[1], ref_t[1])))
                    for rule in ("rceil", "floor"):
                        rows, cols = triton_ops.triton_mx_quantize(x, 32, rule, fp8, rowwise=True, columnwise=True)
                        ref_r = quantize_mxfp8(x_cpu, scale_rounding=rule, fp8_format=fp8)
                        ref_c = quantize_mxfp8(x_cpu.t().contiguous(), scale_rounding=rule, fp8_format=fp8)
                        ok = all(same_bytes(a, b.view(a.dtype)) for a, b in
                                 ((rows.data, ref_r[0]), (rows.scale.view(torch.uint8), ref_r[1].view(torch.uint8)),
                                  (cols.data, ref_c[0]), (cols.scale.view(torch.uint8), ref_c[1].view(torch.uint8))))
                        results.append((f"mx_quantize {name} {fp8} {rule} {tag} vs CPU twin", ok))
                    results += check_fine_casts(x, x_cpu, fp8, f"{name} {fp8} {tag}")
    results.append(("mx_gemm within the float32 accumulation bound", check_gemm()))
    results += raising_as_failure("Gluon MX GEMM", check_gluon_gemm)
    x = inputs["bf16"][:256]
    used = kernels_usable(x)
    results.append(("core quantize_tensorwise on CUDA takes the kernel and matches CPU",
                    used and same_bytes(quantize_tensorwise(x)[0], quantize_tensorwise(x.cpu())[0])))
    return results


def raising_as_failure(name: str, check) -> list[tuple[str, bool]]:
    """``check()``'s results, or one failed result naming the exception: one broken check must not hide the rest."""
    try:
        return check()
    except Exception as error:  # noqa: BLE001 - reported as a failed check, with its type and message
        return [(f"{name} raised {type(error).__name__}: {error}", False)]


def check_fine_casts(x: torch.Tensor, x_cpu: torch.Tensor, fp8: torch.dtype, case: str) -> list[tuple[str, bool]]:
    """Every rowwise and blockwise tile, both scale roundings, against the CPU twin: codes, scales, inverses."""
    results = []
    for tile, power_of_2 in itertools.product(TILES, (True, False)):
        square = tile == (128, 128)
        q, q_t = triton_ops.triton_fine_cast(x, fp8, tile, power_of_2, transpose=square)
        data, scale = fine_cast_twin(x_cpu, tile, fp8, power_of_2)
        copies = [(q, data, scale)] + ([(q_t, data.t(), scale.t())] if square else [])
        ok = all(
            same_bytes(c.data, d.contiguous()) and same_bytes(c.scale, s) and same_bytes(c.cache.inverse, s.reciprocal())
            for c, d, s in copies
        )
        results.append((f"fine_cast {tile[0]}x{tile[1]} power_of_2={int(power_of_2)} {case} vs CPU twin", ok))
    return results


def check_gemm() -> bool:
    g = torch.Generator().manual_seed(1)
    a = quantize_mx_operand(torch.randn(520, 2048, generator=g).cuda(), 32, "rceil", E4M3)
    b = quantize_mx_operand(torch.randn(1000, 2048, generator=g).cuda(), 32, "rceil", E5M2)
    out = triton_ops.triton_mx_gemm(a, b, torch.float32).double()
    a64, b64 = dequantize_operand(a).double(), dequantize_operand(b).double()
    bound = 2048 * 2.0**-23 * (a64.abs() @ b64.abs().t())
    return bool(((out - a64 @ b64.t()).abs() <= bound).all())


def gluon_refusal() -> str | None:
    """Why the opt-in Gluon MX GEMM cannot be checked or timed on this GPU (None: it can)."""
    from fp8_lightning.kernels.availability import GLUON_CAPABILITY_MAJOR, gluon_status

    major, minor = torch.cuda.get_device_capability()
    if major != GLUON_CAPABILITY_MAJOR:
        return f"the Gluon MX GEMM is Hopper's (capability 9.x); this GPU has {major}.{minor}"
    ok, reason = gluon_status()
    return None if ok else reason


def _dense(q) -> tuple[torch.Tensor, torch.Tensor]:
    return q.data.contiguous(), q.scale.view(torch.uint8).contiguous()


def check_gluon_gemm() -> list[tuple[str, bool]]:
    """The Gluon MX GEMM, every tile, block size and operand format, on ragged M and N: bit for bit against the
    shipped kernel (same fold order, same wgmma products), and within the float32 accumulation bound of float64
    math. Skipped, with the reason printed, off Hopper."""
    reason = gluon_refusal()
    if reason is not None:
        print(f"  Gluon MX GEMM not checked: {reason}")
        return []
    from fp8_lightning.kernels import block_gemm, block_gemm_gluon

    results = []
    g = torch.Generator().manual_seed(2)
    cases = [(tile, block) for block in (32, 64, 128) for tile in block_gemm_gluon.tiles_for_block(block)]
    for (tile, block), (fa, fb), out_dtype in itertools.product(
        cases, ((E4M3, E4M3), (E5M2, E4M3)), (torch.float32, torch.bfloat16)
    ):
        a = quantize_mx_operand(torch.randn(200, 1024, generator=g).cuda(), block, "rceil", fa)
        b = quantize_mx_operand(torch.randn(333, 1024, generator=g).cuda(), block, "rceil", fb)
        got = block_gemm_gluon.gluon_mx_gemm(*_dense(a), *_dense(b), out_dtype, tile=tile)
        with environment(**{GLUON_MX_GEMM_ENV: "0"}):  # the shipped kernel even if the session opted in
            shipped = block_gemm.mx_gemm(*_dense(a), *_dense(b), out_dtype)
        a64, b64 = dequantize_operand(a).double(), dequantize_operand(b).double()
        bound = 1024 * 2.0**-23 * (a64.abs() @ b64.abs().t()) + (0 if out_dtype == torch.float32 else 2.0**-8 * (
            a64 @ b64.t()).abs())  # fmt: skip
        case = f"Gluon mx_gemm tile={tile} block={block} a={fa} b={fb} out={out_dtype}"
        results.append((f"{case} vs shipped kernel, bit for bit", same_bytes(got, shipped)))
        within = bool(((got.double() - a64 @ b64.t()).abs() <= bound).all())
        results.append((f"{case} within the float32 bound", within))
        if tile == block_gemm_gluon.tile_for(200, 333, block):
            with environment(**{GLUON_MX_GEMM_ENV: "1"}):  # the opt-in route through the library's op
                chosen = gluon_mx_gemm_status("cuda")[0] and same_bytes(triton_ops.triton_mx_gemm(a, b, out_dtype), got)
            results.append((f"{case} chosen by {GLUON_MX_GEMM_ENV}=1 through triton_ops.triton_mx_gemm", chosen))
    return results


# --------------------------------------------------------------------------------------------------------
# Benchmark
# --------------------------------------------------------------------------------------------------------


def seconds(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100) / 1e3


def copy_bandwidth(nbytes: int = 256 * MB) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / seconds(lambda: dst.copy_(src))


def bandwidth_cases(x: torch.Tensor) -> list[tuple[str, int, object, object]]:
    """(name, bytes the operation must move, kernel call, pure-torch call)."""
    n, s = x.numel(), x.element_size()
    scale = torch.tensor(0.5, device=x.device)
    mx_scales = n // 32
    return [
        ("amax", n * s, lambda: triton_ops.triton_amax(x), lambda: pure(amax, x)),
        ("cast + amax (delayed)", n * s + n, lambda: triton_ops.triton_cast(x, scale, E4M3),
         lambda: (pure(quantize_with_scale, x, scale, E4M3), pure(amax, x))),
        ("cast + transpose + amax (delayed)", n * s + 2 * n, lambda: triton_ops.triton_cast_transpose(x, scale, E4M3),
         lambda: (pure(quantize_with_scale, x, scale, E4M3).t().contiguous(), pure(amax, x))),
        ("tensorwise (amax pass + cast pass)", 2 * n * s + n, lambda: triton_ops.triton_tensorwise_cast(x, E4M3),
         lambda: pure(quantize_tensorwise, x, E4M3)),
        ("mxfp8 rowwise", n * s + n + mx_scales, lambda: triton_ops.triton_mx_quantize(x),
         lambda: pure(quantize_mxfp8, x)),
        ("mxfp8 rowwise + columnwise", n * s + 2 * (n + mx_scales),
         lambda: triton_ops.triton_mx_quantize(x, columnwise=True),
         lambda: (pure(quantize_mxfp8, x), pure(quantize_mxfp8, x.t()))),
        ("rowwise, one copy (per row)", n * s + n, lambda: triton_ops.triton_fine_cast(x, E4M3, (1, 0)),
         lambda: pure(quantize_rowwise, x, E4M3)),
        ("blockwise 1x128 + 128x1 copies", 2 * (n * s + n), lambda: (triton_ops.triton_fine_cast(x, E4M3, (1, 128)),
                                                                    triton_ops.triton_fine_cast(x, E4M3, (128, 1))),
         lambda: (pure(quantize_blockwise, x, (1, 128), E4M3), pure(quantize_blockwise, x, (128, 1), E4M3))),
        ("blockwise 128x128 + W.T", n * s + 2 * n, lambda: triton_ops.triton_fine_cast(x, E4M3, (128, 128), transpose=True),
         lambda: pure(quantize_blockwise, x, (128, 128), E4M3)),
    ]


def bench_bandwidth(copy_bw: float) -> list[dict]:
    rows = []
    for shape in ((8192, 4096), (16384, 8192)):  # bf16: 64 MB and 256 MB
        x = torch.randn(shape, device="cuda").bfloat16()
        for name, nbytes, kernel, fallback in bandwidth_cases(x):
            t_kernel, t_pure = seconds(kernel), seconds(fallback)
            rows.append({
                "kernel": name, "shape": list(shape), "input_mb": x.numel() * x.element_size() / MB,
                "bytes": nbytes, "kernel_s": t_kernel, "kernel_fraction_of_copy": nbytes / t_kernel / copy_bw,
                "pure_torch_s": t_pure, "pure_torch_fraction_of_copy": nbytes / t_pure / copy_bw,
            })
            print(f"  {name:36s} {rows[-1]['input_mb']:5.0f} MB: {rows[-1]['kernel_fraction_of_copy']:.2f} of copy "
                  f"(pure torch {rows[-1]['pure_torch_fraction_of_copy']:.2f})")
        del x
        torch.cuda.empty_cache()
    return rows


def bench_gemm() -> list[dict]:
    from fp8_lightning.kernels.block_gemm import _mx_gemm_autotuned

    rows = []
    for n in (4096, 8192):
        a_hp = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b_hp = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        a, _ = triton_ops.triton_mx_quantize(a_hp)
        b, _ = triton_ops.triton_mx_quantize(b_hp)
        flops = 2 * n**3
        triton_ops.triton_mx_gemm(a, b, torch.bfloat16)  # autotune outside the timed region
        t_bf16 = seconds(lambda: torch.matmul(a_hp, b_hp.t()))
        t_mx = seconds(lambda: triton_ops.triton_mx_gemm(a, b, torch.bfloat16))
        t_pure = seconds(lambda: pure(fp8_mm, a, b, torch.bfloat16))
        t_gluon = None
        if gluon_refusal() is None:  # the opt-in Hopper kernel, timed in the same run
            from fp8_lightning.kernels.block_gemm_gluon import gluon_mx_gemm

            dense = (*_dense(a), *_dense(b))
            t_gluon = seconds(lambda: gluon_mx_gemm(*dense, torch.bfloat16))
        rows.append({
            "n": n, "bf16_tflops": flops / t_bf16 / 1e12, "mx_triton_tflops": flops / t_mx / 1e12,
            "pure_torch_tflops": flops / t_pure / 1e12, "mx_over_bf16": t_bf16 / t_mx,
            "best_config": str(getattr(_mx_gemm_autotuned, "best_config", None)),
            "mx_gluon_tflops": flops / t_gluon / 1e12 if t_gluon else None,
            "gluon_over_shipped": t_mx / t_gluon if t_gluon else None,
        })
        gluon = f", MX Gluon {rows[-1]['mx_gluon_tflops']:.0f}" if t_gluon else ""
        print(f"  {n}^3: bf16 {rows[-1]['bf16_tflops']:.0f}, MX Triton {rows[-1]['mx_triton_tflops']:.0f}{gluon}, "
              f"pure torch {rows[-1]['pure_torch_tflops']:.1f} TFLOP/s")
        del a_hp, b_hp, a, b
        torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------------


def markdown(meta: dict, checks: list[tuple[str, bool]], copy_bw: float | None, bw: list[dict], mm: list[dict]) -> str:
    lines = [
        "# Triton kernels on GPU: check and benchmark",
        "",
        f"- command: `{meta['command']}`",
        f"- device: {meta['device']} (compute capability {meta['capability']})",
        f"- torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}",
        f"- date: {meta['date']}",
        "",
        f"## Bit-exact checks: {sum(ok for _, ok in checks)} of {len(checks)} passed",
        "",
    ]
    lines += [f"- {'ok' if ok else 'FAILED'}: {name}" for name, ok in checks if not ok] or ["- all passed"]
    if copy_bw is not None:
        lines += [
            "",
            f"## Bandwidth (device-to-device copy: {copy_bw / 1e9:.0f} GB/s; target >= {BANDWIDTH_TARGET} of it)",
            "",
            "| kernel | input | bytes moved | Triton: fraction of copy | pure torch: fraction of copy |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['kernel']} | bf16 {r['shape'][0]}x{r['shape'][1]} ({r['input_mb']:.0f} MB) | "
            f"{r['bytes'] / MB:.0f} MB | {r['kernel_fraction_of_copy']:.2f} | {r['pure_torch_fraction_of_copy']:.2f} |"
            for r in bw
        ]
        lines += [
            "",
            "## MXFP8 GEMM (TFLOP/s; target: faster than bf16)",
            "",
            "| M=N=K | torch.matmul bf16 | MX Triton kernel | pure torch (dequantize + fp32 matmul) | MX / bf16 "
            "| MX Gluon kernel (Hopper, opt-in) | Gluon / shipped |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['n']} | {r['bf16_tflops']:.0f} | {r['mx_triton_tflops']:.0f} | {r['pure_torch_tflops']:.1f} | "
            f"{r['mx_over_bf16']:.2f}x | " + (f"{r['mx_gluon_tflops']:.0f} | {r['gluon_over_shipped']:.2f}x |"
                                              if r["mx_gluon_tflops"] else "- | - |")
            for r in mm
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check-only", action="store_true", help="run the bit-exact checks, skip the benchmark")
    parser.add_argument("--out", default="benchmarks/results/kernels_gpu.md", help="Markdown path (JSON next to it)")
    args = parser.parse_args(argv)
    reason = refusal()
    if reason is not None:
        print(f"kernels_gpu: refusing to run: {reason}.")
        return 2
    import triton

    major, minor = torch.cuda.get_device_capability()
    meta = {
        "command": front_door_command("kernels_gpu", argv),
        "device": torch.cuda.get_device_name(), "capability": f"{major}.{minor}", "torch": torch.__version__,
        "triton": triton.__version__, "cuda": torch.version.cuda, "host": platform.node(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    print(f"device: {meta['device']} (sm{major}{minor}), torch {meta['torch']}, triton {meta['triton']}")
    checks = check_kernels()
    failed = [name for name, ok in checks if not ok]
    print(f"checks: {len(checks) - len(failed)} of {len(checks)} passed" + "".join(f"\n  FAILED: {f}" for f in failed))
    copy_bw, bw, mm = None, [], []
    if not args.check_only:
        copy_bw = copy_bandwidth()
        print(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s")
        bw, mm = bench_bandwidth(copy_bw), bench_gemm()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(meta, checks, copy_bw, bw, mm))
    out.with_suffix(".json").write_text(json.dumps({
        **meta, "checks": [{"check": n, "ok": ok} for n, ok in checks], "copy_bandwidth_bytes_per_s": copy_bw,
        "bandwidth": bw, "gemm": mm,
    }, indent=2))
    print(f"wrote {out} and {out.with_suffix('.json')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
