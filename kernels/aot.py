"""Ahead-of-time compilation of every kernel launch configuration for GPUs that are not here (sm_89, sm_90a, sm_100a).

Why: the Triton interpreter, which runs the kernel tests on a CPU, accepts code that the GPU compiler refuses, and
says nothing about registers. Triton compiles down to a cubin without a GPU (``triton.compile`` with a
``GPUTarget``, ptxas from the triton wheel), so a CPU can prove that every configuration the wrappers can launch
compiles for Ada, Hopper and Blackwell, and read ptxas's report: registers per thread, spilled bytes, and the shared
memory Triton allocates.

:func:`launch_space` (:mod:`~fp8_lightning.kernels.aot_variants`) lists the configurations the wrappers launch.
:func:`compile_variant` compiles one
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
import multiprocessing
import os
import pickle
import re
import tempfile
import traceback
from collections.abc import Iterable, Iterator

from fp8_lightning.kernels.aot_variants import (
    DTYPE_AXES,
    FP8,
    TARGETS,
    Variant,
    axes,
    launch_space,
    pairwise_cover,
    ptr,
    short,
)
from fp8_lightning.kernels.availability import INTERPRET_ENV


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

    from fp8_lightning.kernels import (
        block_gemm, fine_grained_cast, fp8_adam, grouped_cast, grouped_gemm, mxfp8, nvfp4_cast, per_tensor,
    )
    from fp8_lightning.kernels.availability import gluon_status

    gluon = [importlib.import_module("fp8_lightning.kernels.block_gemm_gluon")] if gluon_status()[0] else []
    for module in (per_tensor, mxfp8, block_gemm, fp8_adam, fine_grained_cast, grouped_cast, grouped_gemm, nvfp4_cast,
                   *gluon):
        if hasattr(module, name):
            return getattr(module, name)
    raise KeyError(f"no kernel named {name!r} in fp8_lightning.kernels")


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
        if isinstance(value, str) and value.endswith(":16"):  # an integer a launch sees divisible by 16
            signature[name] = value[:-3]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, str):
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


__all__ = ["DTYPE_AXES", "FP8", "TARGETS", "Variant", "axes", "launch_space", "pairwise_cover", "ptr", "short",
           "Report", "Compiler", "CompileError", "compile_variant", "parse_ptxas_log", "sendable", "WGMMA_SERIALIZED"]
