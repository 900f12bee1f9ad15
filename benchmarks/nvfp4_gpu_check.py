"""The Triton NVFP4 cast on a GPU against the pure-torch reference, byte for byte, and its speed.

Checks: for a grid of shapes up to 4096 x 4096 (ragged ones, a transposed view), float32 and bfloat16 inputs with
NaN, infinities and subnormals, 1x16 blocks and 16x16 tiles, round to nearest even and stochastic rounding, RHT on
and off, ``triton_ops.triton_nvfp4_cast`` must write the codes, block scales and global scale of
``nvfp4._quantize_reference`` (of ``nvfp4.rht_blocks`` of the padded input for the RHT, with
``nvfp4._uniform_reference`` numbers for stochastic rounding) on the same device. Timing (CUDA events, median of
``--iters`` after warm-up, bf16 4096 x 4096 by default): the Triton cast (amax pass + cast), the reference, and a
bf16 copy of the same tensor (a memory-bound floor). Runs on any CUDA GPU Triton supports (no FP4 tensor cores
needed); without one it says so and exits 0. Exit status 1 on any mismatch.

Usage::

    python -m benchmarks nvfp4-gpu --out results/nvfp4_gpu.md
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import torch

from benchmarks.bench_common import cuda_median_ms, write_gpu_report

from fp8_lightning import nvfp4

SHAPES = [(1, 16), (33, 70), (130, 272), (1000, 3000), (4096, 4096)]
KEY = 0x5EED1234


def hard_input(rows: int, cols: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    """Rows of magnitudes 2**-20 .. 2**20, a zero row, NaN, +-inf and a subnormal of the dtype."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-20, 20, (rows, 1), generator=g).float())
    if rows > 4 and cols > 8:
        x[1] = 0.0
        x[2, 3], x[3, cols - 1], x[4, 0] = float("nan"), float("inf"), float("-inf")
        x[0, 5] = 1e-40 if dtype == torch.float32 else 1e-39  # float32 / bf16 subnormal
    return x.to(device=device, dtype=dtype)


def reference(x, tile_rows, signs, key):
    if signs is not None:
        x = nvfp4.rht_blocks(nvfp4._pad_to(x.float(), 1, 16), signs)
    uniform = None
    if key is not None:
        padded = (-(-x.shape[0] // tile_rows) * tile_rows, -(-x.shape[1] // 16) * 16)
        uniform = nvfp4._uniform_reference(padded, key, x.device)
    return nvfp4._quantize_reference(x, None, tile_rows, uniform)


def check_case(x, tile_rows, rht, stochastic) -> str | None:
    """None when the kernel's bytes equal the reference's, else what differs."""
    from fp8_lightning.ops import triton_ops

    signs = nvfp4.rht_signs(7).to(x.device) if rht else None
    key = KEY if stochastic else None
    expected = reference(x, tile_rows, signs, key)
    codes, scales, g = triton_ops.triton_nvfp4_cast(x, None, tile_rows, signs, key)
    if codes.shape != expected.codes.shape or scales.shape != expected.block_scales.shape:
        return f"shapes {tuple(codes.shape)}/{tuple(scales.shape)} vs {tuple(expected.codes.shape)}"
    bad_codes = int((codes != expected.codes).sum())
    bad_scales = int((scales.view(torch.uint8) != expected.block_scales.view(torch.uint8)).sum())
    bad_global = not torch.equal(g.view(torch.int32), expected.global_scale.view(torch.int32))
    if bad_codes or bad_scales or bad_global:
        return f"{bad_codes} code bytes, {bad_scales} scales differ; global scale equal: {not bad_global}"
    return None


def timings(rows: int, cols: int, iters: int) -> list[tuple[str, float]]:
    from fp8_lightning.ops import triton_ops

    x = hard_input(rows, cols, torch.bfloat16, "cuda", seed=1).nan_to_num()
    signs = nvfp4.rht_signs(7).cuda()
    out = [("bf16 copy (x.clone())", cuda_median_ms(lambda: x.clone(), iters))]
    for tile_rows, rht, stochastic in ((1, False, False), (16, False, False), (1, True, True)):
        s = signs if rht else None
        key = KEY if stochastic else None
        name = f"{tile_rows}x16 rht={int(rht)} stochastic={int(stochastic)}"
        out.append((f"Triton cast, {name}", cuda_median_ms(lambda: triton_ops.triton_nvfp4_cast(x, None, tile_rows, s, key),
                                                     iters)))
        out.append((f"pure-torch reference, {name}", cuda_median_ms(lambda: reference(x, tile_rows, s, key), iters)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the markdown report here (also under $OUT when set)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--budget", type=float, default=80.0, help="seconds for the byte checks (the rest is skipped)")
    parser.add_argument("--time-shape", type=int, nargs=2, default=(4096, 4096))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("nvfp4-gpu: skipped, needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 0
    from fp8_lightning.kernels.availability import device_status

    ok, reason = device_status(torch.device("cuda"))
    if not ok:
        print(f"nvfp4-gpu: skipped, the Triton kernels cannot run here: {reason}")
        return 0
    started = time.time()
    import torch.nn.functional as F

    api = {name: hasattr(getattr(F, kind, None), member) for name, kind, member in (
        ("ScalingType.BlockWise1x16", "ScalingType", "BlockWise1x16"), ("ScalingType.TensorWise", "ScalingType",
                                                                        "TensorWise"),
        ("SwizzleType.SWIZZLE_32_4_4", "SwizzleType", "SWIZZLE_32_4_4"), ("SwizzleType.NO_SWIZZLE", "SwizzleType",
                                                                          "NO_SWIZZLE"))}
    lines = [f"# NVFP4 cast on {torch.cuda.get_device_name()} (torch {torch.__version__})", "",
             "torch.nn.functional names the NVFP4 GEMM call uses: "
             + ", ".join(f"{name} {'present' if ok else 'MISSING'}" for name, ok in api.items()), "",
             "## Bytes: Triton cast vs pure-torch reference on the GPU", "",
             "| shape | dtype | layout | tile | rht | stochastic | result |", "|---|---|---|---|---|---|---|"]
    failures, skipped = 0, 0
    for (rows, cols), dtype in itertools.product(SHAPES, (torch.float32, torch.bfloat16)):
        base = hard_input(rows, cols, dtype, "cuda")
        views = [("row-major", base)] + ([("transposed view", base.t())] if rows == 130 else [])
        for (layout, x), tile_rows, rht, sr in itertools.product(views, (1, 16), (False, True), (False, True)):
            if time.time() - started > args.budget:
                skipped += 1
                continue
            problem = check_case(x, tile_rows, rht, sr)
            failures += problem is not None
            lines.append(f"| {tuple(x.shape)} | {str(dtype)[6:]} | {layout} | {tile_rows}x16 | {int(rht)} | {int(sr)} "
                         f"| {'same bytes' if problem is None else 'DIFFERS: ' + problem} |")
    lines += ["", f"{failures} mismatching cases; {skipped} not run (past the {args.budget:.0f} s budget).", "",
              f"## Time per cast, {args.time_shape[0]} x {args.time_shape[1]} bf16 (median of {args.iters}, CUDA events)",
              "", "| what | ms |", "|---|---:|"]
    lines += [f"| {name} | {ms:.4f} |" for name, ms in timings(*args.time_shape, args.iters)]
    lines += ["", f"Wall time {time.time() - started:.1f} s."]
    report = "\n".join(lines) + "\n"
    print(report)
    write_gpu_report(report, args.out, "nvfp4_gpu.md")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
