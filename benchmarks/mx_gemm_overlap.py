"""Can Triton keep the Hopper MX GEMM's wgmma in flight while the CUDA cores scale the previous block?

The MX GEMM (``fp8_lightning/kernels/block_gemm.py``) folds every K block's product into its accumulator with
the block's scales: ``acc += dot(a_k, b_k) * sa_k[:, None] * sb_k[None, :]``. Overlap would mean issuing block
k+1's wgmma before folding block k, and waiting with ``wgmma.wait_group 1`` (one group left in flight) rather
than 0. This compiles, for sm_90a on this CPU (ptxas from the triton wheel), the kernel as it is and the forms that
could give that overlap: the product of the next block issued before the fold (software pipelining by hand, with
a fresh accumulator or a hoisted zero one), two blocks per iteration, ``loop_unroll_factor``,
``disallow_acc_multi_buffer`` and ``warp_specialize``; and, for comparison, the overlap written out by hand in
Gluon, Triton's lower-level dialect: the package's opt-in Hopper kernel (``kernels/block_gemm_gluon.py``, which the
Triton interpreter cannot run). Per form and tile it prints
registers, spilled bytes, the number of wgmma sites and the N of every ``wgmma.wait_group N`` in the PTX.

Usage::

    python -m benchmarks mx-gemm-overlap [--out FILE.md]

The ``triton.language`` forms take the kernel's arguments and are written to compute its result (K a multiple of
two blocks for ``two_blocks_per_iteration``), but only their PTX is looked at: none of them has run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
from pathlib import Path

import triton
import triton.language as tl
from benchmarks import command as front_door_command
from fp8_lightning.kernels import aot
from fp8_lightning.kernels.block_gemm import _e8m0_to_float, _mx_gemm_kernel
from fp8_lightning.testing import wgmma_waits

TILES = ("128x128/warps8/stages4", "64x128/warps4/stages3", "64x64/warps4/stages5")


@triton.jit
def _tile_origin(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    grid_n = (N + BLOCK_N - 1) // BLOCK_N
    group_size = GROUP_M * grid_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum((M + BLOCK_M - 1) // BLOCK_M - first_m, GROUP_M)
    return (first_m + (pid % group_size) % rows_in_group) * BLOCK_M, ((pid % group_size) // rows_in_group) * BLOCK_N


@triton.jit
def _scales(a_scale_ptr, b_scale_ptr, off_m, off_n, M, N, stride_asm, stride_bsn,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    a_scale_ptrs = a_scale_ptr + ((off_m + tl.arange(0, BLOCK_M)) % M).to(tl.int64) * stride_asm
    b_scale_ptrs = b_scale_ptr + ((off_n + tl.arange(0, BLOCK_N)) % N).to(tl.int64) * stride_bsn
    return a_scale_ptrs, b_scale_ptrs


@triton.jit
def _fold(acc, p, a_scale_ptrs, b_scale_ptrs, kb, stride_ask, stride_bsk):
    sa = _e8m0_to_float(tl.load(a_scale_ptrs + kb * stride_ask))
    sb = _e8m0_to_float(tl.load(b_scale_ptrs + kb * stride_bsk))
    return acc + (p * sa[:, None]) * sb[None, :]


@triton.jit
def _product(a_desc, b_desc, off_m, off_n, kb, zero, BLOCK_K: tl.constexpr, ZERO_ACC: tl.constexpr):
    a = a_desc.load([off_m, kb * BLOCK_K])
    b = b_desc.load([off_n, kb * BLOCK_K])
    if ZERO_ACC:
        return tl.dot(a, tl.trans(b), zero)
    return tl.dot(a, tl.trans(b))


@triton.jit
def _store(c_ptr, acc, off_m, off_n, M, N, stride_cm, stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    cm = (off_m + tl.arange(0, BLOCK_M)).to(tl.int64)
    cn = (off_n + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask = (cm[:, None] < M) & (cn[None, :] < N)
    tl.store(c_ptr + cm[:, None] * stride_cm + cn[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _software_pipelined(a_desc, a_scale_ptr, b_desc, b_scale_ptr, c_ptr, M, N, K,
                        stride_asm, stride_ask, stride_bsn, stride_bsk, stride_cm, stride_cn,
                        BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                        ZERO_ACC: tl.constexpr, STAGES: tl.constexpr, UNROLL: tl.constexpr, DISALLOW: tl.constexpr,
                        WARP_SPECIALIZE: tl.constexpr):  # fmt: skip
    """Block k+1's product issued before block k's fold; the product carried across iterations."""
    off_m, off_n = _tile_origin(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    a_scale_ptrs, b_scale_ptrs = _scales(a_scale_ptr, b_scale_ptr, off_m, off_n, M, N, stride_asm, stride_bsn,
                                         BLOCK_M, BLOCK_N)  # fmt: skip
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    zero = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    p = _product(a_desc, b_desc, off_m, off_n, 0, zero, BLOCK_K, ZERO_ACC)
    for kb in tl.range(1, K // BLOCK_K, num_stages=STAGES, loop_unroll_factor=UNROLL,
                       disallow_acc_multi_buffer=DISALLOW, warp_specialize=WARP_SPECIALIZE):  # fmt: skip
        p_next = _product(a_desc, b_desc, off_m, off_n, kb, zero, BLOCK_K, ZERO_ACC)
        acc = _fold(acc, p, a_scale_ptrs, b_scale_ptrs, kb - 1, stride_ask, stride_bsk)
        p = p_next
    acc = _fold(acc, p, a_scale_ptrs, b_scale_ptrs, K // BLOCK_K - 1, stride_ask, stride_bsk)
    _store(c_ptr, acc, off_m, off_n, M, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N)


@triton.jit
def _one_block_per_iteration(a_desc, a_scale_ptr, b_desc, b_scale_ptr, c_ptr, M, N, K,
                             stride_asm, stride_ask, stride_bsn, stride_bsk, stride_cm, stride_cn,
                             BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             GROUP_M: tl.constexpr, ZERO_ACC: tl.constexpr, STAGES: tl.constexpr,
                             UNROLL: tl.constexpr, DISALLOW: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):  # fmt: skip
    """The kernel's own loop (product, then fold) under ``tl.range``'s options."""
    off_m, off_n = _tile_origin(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    a_scale_ptrs, b_scale_ptrs = _scales(a_scale_ptr, b_scale_ptr, off_m, off_n, M, N, stride_asm, stride_bsn,
                                         BLOCK_M, BLOCK_N)  # fmt: skip
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    zero = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for kb in tl.range(0, K // BLOCK_K, num_stages=STAGES, loop_unroll_factor=UNROLL,
                       disallow_acc_multi_buffer=DISALLOW, warp_specialize=WARP_SPECIALIZE):  # fmt: skip
        p = _product(a_desc, b_desc, off_m, off_n, kb, zero, BLOCK_K, ZERO_ACC)
        acc = _fold(acc, p, a_scale_ptrs, b_scale_ptrs, kb, stride_ask, stride_bsk)
    _store(c_ptr, acc, off_m, off_n, M, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N)


@triton.jit
def _two_blocks_per_iteration(a_desc, a_scale_ptr, b_desc, b_scale_ptr, c_ptr, M, N, K,
                              stride_asm, stride_ask, stride_bsn, stride_bsk, stride_cm, stride_cn,
                              BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              GROUP_M: tl.constexpr):  # fmt: skip
    """Both products of an iteration issued before either fold."""
    off_m, off_n = _tile_origin(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    a_scale_ptrs, b_scale_ptrs = _scales(a_scale_ptr, b_scale_ptr, off_m, off_n, M, N, stride_asm, stride_bsn,
                                         BLOCK_M, BLOCK_N)  # fmt: skip
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for kb in range(0, K // BLOCK_K, 2):
        p0 = _product(a_desc, b_desc, off_m, off_n, kb, acc, BLOCK_K, False)
        p1 = _product(a_desc, b_desc, off_m, off_n, kb + 1, acc, BLOCK_K, False)
        acc = _fold(acc, p0, a_scale_ptrs, b_scale_ptrs, kb, stride_ask, stride_bsk)
        acc = _fold(acc, p1, a_scale_ptrs, b_scale_ptrs, kb + 1, stride_ask, stride_bsk)
    _store(c_ptr, acc, off_m, off_n, M, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N)


def _gluon_variant(tile: str) -> aot.Variant:
    """The package's Gluon kernel (``kernels/block_gemm_gluon.py``) at ``tile`` (its stages suffix dropped: the
    Gluon kernel always has two)."""
    shape_and_warps = tile.rsplit("/", 1)[0]
    return next(v for v in aot.launch_space() if v.kernel == "_gluon_mx_gemm_kernel"
                and v.config == f"a=fp8e4nv b=fp8e4nv out=bf16 block=32 tile={shape_and_warps}")  # fmt: skip


def _options(zero_acc=False, stages=None, unroll=None, disallow=False, warp_specialize=False) -> tuple:
    return (("ZERO_ACC", zero_acc), ("STAGES", stages), ("UNROLL", unroll), ("DISALLOW", disallow),
            ("WARP_SPECIALIZE", warp_specialize))  # fmt: skip


def forms() -> dict:
    """Name -> (kernel, its constexpr arguments beyond the MX GEMM's); kernel None: the package's Gluon kernel."""
    pipelined, looped = _software_pipelined, _one_block_per_iteration
    return {
        "as shipped (block_gemm._mx_gemm_kernel)": (_mx_gemm_kernel, ()),
        "software-pipelined, fresh product (tl.dot(a, b))": (pipelined, _options()),
        "software-pipelined, hoisted zero accumulator (tl.dot(a, b, zero))": (pipelined, _options(zero_acc=True)),
        "software-pipelined, tl.range(disallow_acc_multi_buffer=True)": (pipelined, _options(disallow=True)),
        "software-pipelined, tl.range(num_stages=2)": (pipelined, _options(stages=2)),
        "software-pipelined, tl.range(loop_unroll_factor=2)": (pipelined, _options(unroll=2)),
        "software-pipelined, tl.range(warp_specialize=True)": (pipelined, _options(warp_specialize=True)),
        "two blocks per iteration, both products first": (_two_blocks_per_iteration, ()),
        "one block per iteration, hoisted zero accumulator": (looped, _options(zero_acc=True)),
        "one block per iteration, tl.range(loop_unroll_factor=2)": (looped, _options(unroll=2)),
        "one block per iteration, tl.range(disallow_acc_multi_buffer=True)": (looped, _options(disallow=True)),
        "one block per iteration, tl.range(warp_specialize=True)": (looped, _options(warp_specialize=True)),
        "Gluon: asynchronous wgmma, warpgroup_mma_wait(1) before the fold (block_gemm_gluon)": (None, None),
    }


def _variant(tile: str) -> aot.Variant:
    return next(v for v in aot.launch_space() if v.kernel == "_mx_gemm_kernel"
                and v.config == f"a=fp8e4nv b=fp8e4nv out=bf16 block=32 config={tile}")  # fmt: skip


def measure() -> list[tuple]:
    rows = []
    for name, (fn, options) in forms().items():
        for tile in TILES:
            variant = _gluon_variant(tile) if fn is None else _variant(tile)
            variant = dataclasses.replace(variant, args=variant.args + (options or ()))
            try:
                report = aot.compile_variant(variant, "sm_90a", fn)
            except Exception as err:  # a form the compiler refuses is a row of the table
                rows.append((name, tile, "FAILED", "", "", str(err).splitlines()[0][:120]))
                continue
            sites, waits = wgmma_waits(report.ptx)
            rows.append((name, tile, report.registers, report.spill_bytes, sites, " ".join(map(str, waits))))
            print(" | ".join(map(str, rows[-1])), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the markdown table here")
    args = parser.parse_args(argv)
    rows = measure()
    lines = [
        f"- command: `{front_door_command('mx_gemm_overlap', argv)}`",
        f"- machine: CPU only (no GPU); triton {triton.__version__} (its bundled ptxas); target sm_90a; "
        f"operands E4M3, output bf16, block 32; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "",
        "| form | tile | registers | spilled bytes | wgmma sites | wgmma.wait_group N (every wait) |",
        "|---|---|---:|---:|---:|---|",
        *("| " + " | ".join(map(str, row)) + " |" for row in rows),
    ]
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
