"""Ahead-of-time compilation of every kernel launch configuration for GPUs that are not here (sm_89, sm_90a, sm_100a).

Why: the Triton interpreter, which runs the kernel tests on a CPU, accepts code that the GPU compiler refuses, and
says nothing about registers. Triton compiles down to a cubin without a GPU (``triton.compile`` with a
``GPUTarget``, ptxas from the triton wheel), so a CPU can prove that every configuration the wrappers can launch
compiles for Ada, Hopper and Blackwell, and read ptxas's report: registers per thread, spilled bytes, and the shared
memory Triton allocates.

:func:`launch_space` lists the configurations the wrappers launch, built from the wrappers' own constants (tile
sizes, block sizes, autotune configs), with the arguments typed and specialized the way a launch on contiguous
tensors specializes them (pointers 16-byte aligned, unit strides constant). :func:`compile_variant` compiles one
and returns a :class:`Report`; a :class:`Compiler` compiles a batch in several processes. ``benchmarks/aot_compile.py``
writes the table; ``tests/kernels/test_aot_compile.py`` fails when a configuration does not compile or spills.

The compiles run in worker processes started for them (:class:`Compiler`): Triton's Gluon bindings leave IR objects
alive once a Gluon kernel has compiled, and the process that compiled it prints nanobind's leak report (hundreds of
lines on stderr) when it exits. A worker's own output goes to a temporary file, so the report never reaches the
caller's terminal; reports and errors come back as values.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import dataclasses
import io
import itertools
import multiprocessing
import os
import pickle
import re
import tempfile
import traceback
from collections.abc import Iterable, Iterator

import torch

from fp8_lightning.formats import fp8_emax
from fp8_lightning.kernels.availability import INTERPRET_ENV
from fp8_lightning.kernels.availability import SUPPORTED_INPUT_DTYPES as INPUT_DTYPES

# Ada (L4, L40, RTX 4090: FP8 mma.sync, no wgmma or TMA), Hopper, Blackwell.
TARGETS = {"sm_89": 89, "sm_90a": 90, "sm_100a": 100}
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_TYPE = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5", torch.uint8: "u8", torch.int8: "i8", torch.int16: "i16", torch.int32: "i32",
    torch.int64: "i64",
}


def ptr(dtype: torch.dtype) -> str:
    """Triton's signature type of a pointer to ``dtype``."""
    return "*" + _TYPE[dtype]


def short(dtype: torch.dtype) -> str:
    return _TYPE[dtype]


@dataclasses.dataclass(frozen=True)
class Variant:
    """One launch configuration: the kernel, each argument's type (a string) or constexpr value, and launch options."""

    kernel: str
    config: str  # human-readable: what distinguishes this variant
    args: tuple  # (name, "type" or constexpr value) in any order
    num_warps: int = 4
    num_stages: int = 3
    targets: tuple = tuple(TARGETS)  # the GPUs whose wrapper can launch it


@dataclasses.dataclass(frozen=True)
class Report:
    """ptxas's report on one compiled variant, and its PTX (plain values: it travels back from a worker process)."""

    variant: Variant
    target: str
    registers: int
    spill_bytes: int  # spill stores + spill loads
    shared_bytes: int
    ptx: str = dataclasses.field(repr=False, default="")
    wgmma_serialized: bool = False  # ptxas's C7514: it serialized the wgmma (a non-wgmma instruction reads an
    # in-flight accumulator), so no product overlaps the instructions around it


def _kernel_fn(name: str):
    import importlib

    from fp8_lightning.kernels import block_gemm, fine_grained_cast, fp8_adam, grouped_cast, mxfp8, per_tensor
    from fp8_lightning.kernels.availability import gluon_status

    gluon = [importlib.import_module("fp8_lightning.kernels.block_gemm_gluon")] if gluon_status()[0] else []
    for module in (per_tensor, mxfp8, block_gemm, fp8_adam, fine_grained_cast, grouped_cast, *gluon):
        if hasattr(module, name):
            return getattr(module, name)
    raise KeyError(f"no kernel named {name!r} in fp8_lightning.kernels")


# ----------------------------------------------------------------------------------------------------------
# The launch space, from the wrappers' constants
# ----------------------------------------------------------------------------------------------------------


def _per_tensor_variants() -> list[Variant]:
    from fp8_lightning.kernels.per_tensor import FLAT_BLOCK as BLOCK, TRANSPOSE_TILE as TILE, format_constants
    from fp8_lightning.kernels.per_tensor import PER_TENSOR_NUM_WARPS as NUM_WARPS

    out = [Variant("_amax_kernel", f"x={short(x)} BLOCK={BLOCK}",
                   (("x_ptr", ptr(x)), ("amax_bits_ptr", "*i32"), ("n", "i32"), ("BLOCK", BLOCK)))
           for x in INPUT_DTYPES]  # fmt: skip
    for x, q, rounding in itertools.product(INPUT_DTYPES, FP8, (False, True)):
        consts = tuple({**format_constants(q), "EXPLICIT_ROUNDING": rounding}.items())
        tag = f"x={short(x)} out={short(q)} explicit_rounding={int(rounding)}"
        for record in (False, True):
            out.append(Variant("_cast_kernel", f"{tag} record={int(record)} BLOCK={BLOCK}", (
                ("x_ptr", ptr(x)), ("scale_ptr", "*fp32"), ("out_ptr", ptr(q)), ("amax_bits_ptr", "*i32"),
                ("n", "i32"), *consts, ("RECORD_AMAX", record), ("BLOCK", BLOCK))))
            out.append(Variant("_cast_transpose_kernel", f"{tag} record={int(record)} TILE={TILE}", (
                ("x_ptr", ptr(x)), ("scale_ptr", "*fp32"), ("out_ptr", ptr(q)), ("out_t_ptr", ptr(q)),
                ("amax_bits_ptr", "*i32"), ("M", "i32"), ("K", "i32"), ("stride_xm", "i32"), ("stride_xk", 1),
                *consts, ("RECORD_AMAX", record), ("TILE", TILE))))
            for transpose in (False, True):
                out.append(Variant("_delayed_cast_kernel", f"{tag} record={int(record)} transpose={int(transpose)}", (
                    ("x_ptr", ptr(x)), ("scale_ptr", "*fp32"), ("out_ptr", ptr(q)), ("out_t_ptr", ptr(q)),
                    ("sync_ptr", "*i32"), ("pending_ptr", "*fp32"), ("count_ptr", "*i64"),
                    ("pending_out_ptr", "*fp32"), ("count_out_ptr", "*i64"), ("inverse_out_ptr", "*fp32"),
                    ("M", "i32"), ("K", "i32"), *consts, ("RECORD", record), ("TRANSPOSE", transpose),
                    ("BLOCK", BLOCK), ("TILE", TILE))))
        for pow2, keep, transpose in itertools.product((False, True), repeat=3):
            count = "*i64" if keep else "*i32"
            out.append(Variant("_tensorwise_cast_kernel",
                               f"{tag} power_of_2={int(pow2)} keep_previous={int(keep)} transpose={int(transpose)}", (
                ("x_ptr", ptr(x)), ("amax_bits_ptr", "*i32"), ("out_ptr", ptr(q)), ("out_t_ptr", ptr(q)),
                ("scale_out_ptr", "*fp32"), ("prev_scale_ptr", "*fp32"), ("count_ptr", count),
                ("count_out_ptr", count), ("inverse_out_ptr", "*fp32"), ("M", "i32"), ("K", "i32"), ("eps", "fp32"),
                *consts, ("POWER_OF_2", pow2), ("KEEP_PREVIOUS", keep), ("TRANSPOSE", transpose), ("BLOCK", BLOCK),
                ("TILE", TILE))))  # fmt: skip
    return [dataclasses.replace(variant, num_warps=NUM_WARPS) for variant in out]


def _mx_quantize_variants() -> list[Variant]:
    from fp8_lightning.kernels.availability import MX_BLOCK_SIZES
    from fp8_lightning.kernels.mxfp8 import launches, quantize_num_warps, tile_shape
    from fp8_lightning.kernels.per_tensor import format_constants

    out = []
    requests = ((True, False), (False, True), (True, True))
    for x, q, bs, rceil, rounding in itertools.product(INPUT_DTYPES, FP8, MX_BLOCK_SIZES, (False, True), (False, True)):
        for row, col in dict.fromkeys(d for request in requests for d in launches(bs, *request)):
            tile = tile_shape(bs, row, col)
            consts = {**format_constants(q), "EXPLICIT_ROUNDING": rounding}
            out.append(Variant("_mx_quantize_kernel", (
                f"x={short(x)} out={short(q)} block={bs} tile={tile[0]}x{tile[1]} rceil={int(rceil)} "
                f"rowwise={int(row)} colwise={int(col)} explicit_rounding={int(rounding)}"), (
                ("x_ptr", ptr(x)), ("row_ptr", ptr(q)), ("row_scale_ptr", "*u8"), ("col_ptr", ptr(q)),
                ("col_scale_ptr", "*u8"), ("R", "i32"), ("C", "i32"), ("R_PAD", "i32"), ("C_PAD", "i32"),
                ("stride_r", "i32"), ("stride_c", 1), ("BLOCK_SIZE", bs), ("EMAX", fp8_emax(q)), ("RCEIL", rceil),
                *consts.items(), ("ROWWISE", row), ("COLWISE", col), ("BLOCK_R", tile[0]), ("BLOCK_C", tile[1])),
                num_warps=quantize_num_warps(tile)))  # fmt: skip
    return out


def _mx_gemm_variants() -> list[Variant]:
    from fp8_lightning.kernels.availability import GEMM_OUT_DTYPES, MX_GEMM_BLOCK_SIZES
    from fp8_lightning.kernels.block_gemm import _config_key, mx_gemm_configs

    selected = {t: {_config_key(c) for c in mx_gemm_configs(divmod(cap, 10))} for t, cap in TARGETS.items()}
    out = []
    for a, b, c, bs, cfg in itertools.product(FP8, FP8, GEMM_OUT_DTYPES, MX_GEMM_BLOCK_SIZES, mx_gemm_configs()):
        meta = cfg.kwargs
        bm, bn = meta["BLOCK_M"], meta["BLOCK_N"]
        out.append(Variant("_mx_gemm_kernel", (
            f"a={short(a)} b={short(b)} out={short(c)} block={bs} "
            f"config={bm}x{bn}/warps{cfg.num_warps}/stages{cfg.num_stages}"), (
            ("a_desc", f"tensordesc<{short(a)}[{bm}, {bs}]>"), ("a_scale_ptr", "*u8"),
            ("b_desc", f"tensordesc<{short(b)}[{bn}, {bs}]>"), ("b_scale_ptr", "*u8"), ("c_ptr", ptr(c)),
            ("M", "i32"), ("N", "i32"), ("K", "i32"), ("stride_asm", "i32"), ("stride_ask", 1),
            ("stride_bsn", "i32"), ("stride_bsk", 1), ("stride_cm", "i32"), ("stride_cn", 1), ("BLOCK_K", bs),
            *meta.items()),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            targets=tuple(t for t in TARGETS if _config_key(cfg) in selected[t])))
    return out


def _gluon_mx_gemm_variants() -> list[Variant]:
    """The Hopper-only Gluon MX GEMM (opt-in): every tile it can pick at each block size, for sm_90a alone; none
    when this Triton has no usable Gluon. Its descriptors carry their shared-memory layout in their type."""
    from fp8_lightning.kernels.availability import GEMM_OUT_DTYPES, MX_GEMM_BLOCK_SIZES
    from fp8_lightning.kernels.availability import gluon_status

    if not gluon_status()[0]:
        return []
    from fp8_lightning.kernels.block_gemm_gluon import GROUP_M, shared_layout, tiles_for_block

    def desc(dtype, rows, bs):
        return f"tensordesc<{short(dtype)}[{rows}, {bs}],{shared_layout(rows, bs, dtype)!r}>"

    out = []
    for a, b, c, bs in itertools.product(FP8, FP8, GEMM_OUT_DTYPES, MX_GEMM_BLOCK_SIZES):
        out += [Variant("_gluon_mx_gemm_kernel", (
            f"a={short(a)} b={short(b)} out={short(c)} block={bs} tile={bm}x{bn}/warps{warps}"), (
            ("a_desc", desc(a, bm, bs)), ("a_scale_ptr", "*u8"), ("b_desc", desc(b, bn, bs)), ("b_scale_ptr", "*u8"),
            ("c_ptr", ptr(c)), *((name, "i32") for name in ("M", "N", "K", "stride_asm", "stride_bsn", "stride_cm")),
            ("BLOCK_M", bm), ("BLOCK_N", bn), ("BLOCK_K", bs), ("GROUP_M", GROUP_M), ("num_warps", warps)),
            num_warps=warps, targets=("sm_90a",)) for bm, bn, warps in tiles_for_block(bs)]  # fmt: skip
    return out


def _fp8_adam_variants() -> list[Variant]:
    from fp8_lightning.kernels.fp8_adam import (
        MASTER_CODES, MAX_BLOCK, MIN_BLOCK, adam_num_warps, kernel_formats, state_constants,
    )

    masters = {  # master kind -> (param pointer, master pointer)
        "none": ("*fp32", "*fp32"), "fp32": ("*bf16", "*fp32"), "bf16_remainder": ("*i16", "*i16"),
        "bf16_int8_remainder": ("*i16", "*i8"),
    }
    blocks = [1 << p for p in range(MIN_BLOCK.bit_length() - 1, MAX_BLOCK.bit_length())]
    out = []
    for block, master, m, v, v_sqrt, rounding in itertools.product(
        blocks, masters, FP8, (torch.float16, *FP8), (False, True), (False, True)
    ):
        param, master_ptr = masters[master]
        grad = "*fp32" if master == "none" else "*bf16"
        out.append(Variant("_fp8_adam_kernel", (
            f"BLOCK={block} master={master} m={short(m)} v={short(v)} v_sqrt={int(v_sqrt)} "
            f"explicit_rounding={int(rounding)}"), (
            ("param_ptr", param), ("grad_ptr", grad), ("master_ptr", master_ptr), ("m_ptr", ptr(m)),
            ("m_scale_ptr", "*fp32"), ("v_ptr", ptr(v)), ("v_scale_ptr", "*fp32"), ("n", "i32"),
            *((name, "fp32") for name in ("lr", "beta1", "beta2", "eps", "weight_decay", "step_size",
                                          "bias_correction2_sqrt")),
            ("BLOCK", block), ("MASTER", MASTER_CODES[master]), ("DECOUPLED", True), ("MAXIMIZE", False),
            *kernel_formats(state_constants(m), state_constants(v)).items(), ("V_FP8", v != torch.float16),
            ("V_SQRT", v_sqrt), ("EXPLICIT_ROUNDING", rounding)), num_warps=adam_num_warps(block)))  # fmt: skip
    return out


def _fine_cast_variants() -> list[Variant]:
    """The rowwise and blockwise casts: every tile, with the scale strides a launch on a contiguous x passes (a
    stride of 1 is specialized)."""
    from fp8_lightning.kernels.fine_grained_cast import NUM_WARPS
    from fp8_lightning.kernels.fine_grained_layout import BLOCKWISE_EDGE as TILE, TILES, along_rows, piece
    from fp8_lightning.kernels.per_tensor import format_constants

    def scale_strides(tile, transpose):  # (line, window) strides of scale, then of scale_t
        own = {(TILE, TILE): ("i32", 1), (1, TILE): (1, "i32"), (TILE, 1): (1, "i32")}.get(tile, (1, 1))
        return own + (("i32", 1) if transpose else ("i32", "i32"))

    requests = [(tile, False) for tile in TILES] + [((TILE, TILE), True)]
    out = []
    for x, q, (tile, transpose), pow2, rounding in itertools.product(
        INPUT_DTYPES, FP8, requests, (False, True), (False, True)
    ):
        rows = along_rows(tile)
        block_lines, chunk = piece(tile, rows)
        s_line, s_window, t_window, t_line = scale_strides(tile, transpose)
        out.append(Variant("_fine_cast_kernel", (
            f"x={short(x)} out={short(q)} tile={tile[0]}x{tile[1]} transpose={int(transpose)} power_of_2={int(pow2)} "
            f"explicit_rounding={int(rounding)}"), (
            ("x_ptr", ptr(x)), ("data_ptr", ptr(q)), ("data_t_ptr", ptr(q)), ("scale_ptr", "*fp32"),
            ("inverse_ptr", "*fp32"), ("scale_t_ptr", "*fp32"), ("inverse_t_ptr", "*fp32"), ("LINES", "i32"),
            ("LENGTH", "i32"), ("WINDOW", "i32"), ("stride_line", "i32" if rows else 1),
            ("stride_pos", 1 if rows else "i32"), ("stride_scale_line", s_line), ("stride_scale_window", s_window),
            ("stride_scale_t_window", t_window), ("stride_scale_t_line", t_line), ("eps", "fp32"),
            *{**format_constants(q), "EXPLICIT_ROUNDING": rounding}.items(), ("POWER_OF_2", pow2),
            ("BLOCKWISE", TILE in tile), ("SQUARE", tile == (TILE, TILE)), ("TRANSPOSE", transpose),
            ("BLOCK_LINES", block_lines), ("CHUNK", chunk)), num_warps=NUM_WARPS))  # fmt: skip
    return out


def _grouped_cast_variants() -> list[Variant]:
    """The grouped columnwise casts: tokens (groups padded to 16) and stacked weights (unpadded), contiguous x."""
    from fp8_lightning.kernels.grouped_cast import BLOCK_COLUMNS, CHUNK, NUM_WARPS
    from fp8_lightning.kernels.per_tensor import format_constants

    out = []
    for x, q, align, pow2, rounding in itertools.product(INPUT_DTYPES, FP8, (1, 16), (False, True), (False, True)):
        out.append(Variant("_grouped_column_cast_kernel", (
            f"x={short(x)} out={short(q)} align={align} power_of_2={int(pow2)} explicit_rounding={int(rounding)}"), (
            ("x_ptr", ptr(x)), ("data_ptr", ptr(q)), ("scale_ptr", "*fp32"), ("inverse_ptr", "*fp32"),
            ("starts_ptr", "*i32"), ("rows_ptr", "*i32"), ("out_starts_ptr", "*i64"), ("COLUMNS", "i32"),
            ("stride_row", "i32"), ("stride_column", 1), ("out_line_stride", "i32"), ("eps", "fp32"),
            *{**format_constants(q), "EXPLICIT_ROUNDING": rounding}.items(), ("POWER_OF_2", pow2),
            ("ALIGN", align), ("BLOCK", BLOCK_COLUMNS), ("CHUNK", CHUNK)), num_warps=NUM_WARPS))  # fmt: skip
    return out


def launch_space() -> list[Variant]:
    """Every configuration the wrappers can launch (dtypes, constexprs, every autotune config)."""
    return (
        _per_tensor_variants() + _mx_quantize_variants() + _mx_gemm_variants() + _gluon_mx_gemm_variants()
        + _fp8_adam_variants() + _fine_cast_variants() + _grouped_cast_variants()
    )


def axes(variant: Variant) -> dict:
    """The variant's configuration as ``{axis: value}`` (parsed from its ``config`` string)."""
    return dict(item.split("=", 1) for item in variant.config.split())


# Axes naming data types: each value is compiled at least once, not with every value of every other axis.
DTYPE_AXES = frozenset({"x", "out", "a", "b", "m", "v", "master"})


def pairwise_cover(variants: list[Variant]) -> list[tuple[Variant, str]]:
    """A small set of (variant, target) jobs in which every pair of values of a kernel's shape and option axes (the
    target being one more) occurs at least once, and every value of its data-type axes: what the test suite
    compiles (about 100 jobs, where the full sweep is 4,650 and takes 45 minutes)."""
    jobs = [(v, t) for v in variants for t in v.targets]

    def facts(job):
        variant, target = job
        items = {**axes(variant), "target": target}
        shape = sorted((k, v) for k, v in items.items() if k not in DTYPE_AXES)
        return {(variant.kernel, *pair) for pair in itertools.combinations(shape, 2)} | {
            (variant.kernel, k, v) for k, v in items.items() if k in DTYPE_AXES
        }

    chosen = []
    for kernel in dict.fromkeys(v.kernel for v, _ in jobs):
        candidates = [(job, facts(job)) for job in jobs if job[0].kernel == kernel]
        uncovered = set().union(*(f for _, f in candidates))
        while uncovered:
            job, covered = max(candidates, key=lambda c: len(c[1] & uncovered))
            chosen.append(job)
            uncovered -= covered
    return chosen


# ----------------------------------------------------------------------------------------------------------
# Compiling one variant
# ----------------------------------------------------------------------------------------------------------

_USED = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


WGMMA_SERIALIZED = "(C7514)"  # ptxas: "Potential Performance Loss: wgmma.mma_async instructions are serialized"


def parse_ptxas_log(log: str) -> tuple[int, int]:
    """(registers, spilled bytes) from ``ptxas -v``'s report of one kernel."""
    registers = _USED.search(log)
    if registers is None:
        raise ValueError(f"no register count in the ptxas report:\n{log}")
    spills = _SPILLS.search(log)
    spilled = int(spills.group(1)) + int(spills.group(2)) if spills else 0
    return int(registers.group(1)), spilled


def _source(variant: Variant, fn=None):
    from triton.compiler import ASTSource

    fn = fn or _kernel_fn(variant.kernel)
    if type(fn).__name__ == "GluonJITFunction":  # Triton's lower-level dialect (an experiment's kernel)
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    elif type(fn).__name__ != "JITFunction":
        raise RuntimeError(
            f"{variant.kernel} is a {type(fn).__name__}: ahead-of-time compilation needs the compiled kernels; "
            "import fp8_lightning.kernels without TRITON_INTERPRET=1"
        )
    given = dict(variant.args)
    missing = [name for name in fn.arg_names if name not in given]
    if missing or len(given) != len(fn.arg_names):
        raise ValueError(f"{variant.kernel}: arguments {missing} untyped, or extra ones in {sorted(given)}")
    signature, constexprs, attrs = {}, {}, {}
    for index, name in enumerate(fn.arg_names):
        value = given[name]
        if isinstance(value, str):
            signature[name] = value
            if value.startswith("*"):  # torch allocations are 16-byte aligned; launches specialize on it
                attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "constexpr"
            constexprs[name] = value
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def compile_variant(variant: Variant, target: str, fn=None) -> Report:
    """Compile ``variant`` for ``target`` (a key of :data:`TARGETS`) and read ptxas's report.

    The compile runs in a worker process that every call shares (a :class:`Compiler`, started on the first call and
    stopped at exit), so that no Gluon leak report reaches this process's stderr. ``fn``: compile this
    ``@triton.jit`` function, with the variant's arguments, instead of the kernel the variant names; that compile
    runs in this process, since the worker finds kernels by name in the kernel modules.
    """
    _check_target(target)
    if fn is not None:
        return _compile_here(variant, target, fn)
    return _shared_compiler().compile(variant, target)


def _check_target(target: str) -> None:
    if target not in TARGETS:
        raise ValueError(f"target={target!r} is not one of {sorted(TARGETS)}")


def _compile_here(variant: Variant, target: str, fn=None) -> Report:
    """Compile in this process. ptxas only runs when Triton's cache misses, so each call compiles into a fresh cache
    directory."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    _check_target(target)
    log = io.StringIO()
    with tempfile.TemporaryDirectory() as cache, knobs.cache.scope(), knobs.nvidia.scope():
        knobs.cache.dir = cache
        knobs.nvidia.dump_ptxas_log = True
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(
                _source(variant, fn), target=GPUTarget("cuda", TARGETS[target], 32),
                options={"num_warps": variant.num_warps, "num_stages": variant.num_stages},
            )
    registers, spilled = parse_ptxas_log(log.getvalue())
    return Report(variant, target, registers, spilled, kernel.metadata.shared, kernel.asm["ptx"],
                  wgmma_serialized=WGMMA_SERIALIZED in log.getvalue())


# ----------------------------------------------------------------------------------------------------------
# Compiling in worker processes
# ----------------------------------------------------------------------------------------------------------


class CompileError(RuntimeError):
    """A compile that failed in a worker with an exception that could not be sent back as it was: its type and
    message (the worker's traceback is in the chained cause)."""


class Compiler:
    """Compiles variants in ``processes`` worker processes, reused for every job until :meth:`close` (or the end of a
    ``with`` block).

    Why separate processes: once a Gluon kernel has compiled, Triton's Gluon bindings (``gluon_ir``) keep IR objects
    alive, and nanobind prints a leak report of hundreds of lines on stderr when that process exits. Each worker points
    its stdout and stderr (file descriptors 1 and 2, so C++ output too) at a temporary file, which is deleted on close;
    reports and exceptions come back as values, and the end of the file explains a worker that died. Workers are
    started with ``spawn``, not ``fork``: callers have threads (pytest, the executor's own), and a fresh interpreter
    imports the kernels compiled whatever ``TRITON_INTERPRET`` says here.
    """

    def __init__(self, processes: int = 1):
        if processes < 1:
            raise ValueError(f"processes={processes} must be at least 1")
        self.processes = processes
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._log: str | None = None

    def __enter__(self) -> Compiler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers (what they print as they exit goes to the file), then delete the file."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self._log is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._log)
            self._log = None

    def submit(self, variant: Variant, target: str) -> concurrent.futures.Future:
        """Queue one compile; the future's result is its :class:`Report` (read it with :meth:`result`)."""
        _check_target(target)
        try:
            return self._executor().submit(_compile_in_worker, variant, target)
        except concurrent.futures.process.BrokenProcessPool:  # a worker died on an earlier job: start afresh
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
            return self._executor().submit(_compile_in_worker, variant, target)

    def result(self, future: concurrent.futures.Future) -> Report:
        """A submitted compile's report; raises the compile's exception, or a RuntimeError with the end of the
        workers' output when a worker died."""
        try:
            return future.result()
        except concurrent.futures.process.BrokenProcessPool as err:
            raise RuntimeError(f"an ahead-of-time compile worker died; the end of its output:\n{self._tail()}") from err

    def compile(self, variant: Variant, target: str) -> Report:
        """Compile ``variant`` for ``target`` in a worker and return ptxas's report."""
        return self.result(self.submit(variant, target))

    def results(self, jobs: Iterable[tuple[Variant, str]]) -> Iterator[tuple[Variant, str, Report | Exception]]:
        """Compile every ``(variant, target)`` job; yield ``(variant, target, report or exception)`` as each ends."""
        futures = {self.submit(variant, target): (variant, target) for variant, target in jobs}
        for future in concurrent.futures.as_completed(futures):
            variant, target = futures.pop(future)  # drop the report (its PTX) once it is handed over
            try:
                outcome = self.result(future)
            except Exception as err:  # a kernel that does not compile is an outcome, not the end of the batch
                outcome = err
            yield variant, target, outcome

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._log is None:
            fd, self._log = tempfile.mkstemp(prefix="fp8-lightning-aot-worker-", suffix=".log")
            os.close(fd)
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self.processes, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker,
                initargs=(self._log,),
            )
        return self._pool

    def _tail(self, chars: int = 4000) -> str:
        try:
            with open(self._log, errors="replace") as log:
                return log.read()[-chars:] or "(none: it died before its set-up, so its stderr is this process's)"
        except (OSError, TypeError):
            return "(none kept)"


_SHARED: Compiler | None = None


def _shared_compiler() -> Compiler:
    """The one-worker :class:`Compiler` behind :func:`compile_variant`: started once, stopped at exit."""
    global _SHARED
    if _SHARED is None:
        _SHARED = Compiler(1)
        atexit.register(_SHARED.close)
    return _SHARED


def _start_worker(log: str) -> None:
    """A worker's set-up: its stdout and stderr go to ``log``, and it compiles the kernels, never interprets them."""
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.pop(INTERPRET_ENV, None)  # read when the kernel modules are imported, which has not happened yet


def _compile_in_worker(variant: Variant, target: str) -> Report:
    try:
        return _compile_here(variant, target)
    except Exception as err:
        returned = sendable(err)
        if returned is err:
            raise
        raise returned from err


def sendable(err: Exception) -> Exception:
    """``err`` when it survives pickling (the way it returns from a worker), else a :class:`CompileError` with its
    type and message: an exception the caller's process could not rebuild would break the whole worker pool."""
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:
        return CompileError("".join(traceback.format_exception_only(err)).strip())
    return err
