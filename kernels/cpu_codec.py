"""Fused FP8 casts for CPU tensors: ``cpu_codec.c``, compiled on first use and called through ctypes.

Why: emulating FP8 on a CPU spends most of its overhead in passes over the data, not in the GEMMs. Eager PyTorch
takes five passes to cast a tensor and decode the codes back to the float32 values a CPU GEMM multiplies, about
ten for an MX operand (block amax, exponent, scale, cast, decode, dequantize), and converts to float8 element by
element. The C functions do each in one pass, with the same bits (``tests/core/test_cpu_codec.py`` compares
them with the pure-torch code on every class of input, both formats, both MX roundings, float32 and bfloat16).

Build: ``$CC`` (default ``cc``) with ``-O3 -march=native`` (without ``-march=native`` where the compiler refuses
it) into ``$FP8_LIGHTNING_CACHE`` (default ``~/.cache/fp8_lightning``). It takes about a second, once per machine.
Each build is recorded in ``cpu_codec-<key>.json``, keyed by a hash of the source, the flags, the compiler and the
CPU: the library's file name (fresh for every build), its size and sha256, and the source's sha256. The library and
then its record are written to temporary files and renamed into place (concurrent processes may build at once).
A library is loaded only when its size and sha256 match its record: a truncated file (which would kill the process
with SIGBUS) or a foreign one is never loaded, and is rebuilt under a fresh name. Without a compiler, or when the
build fails, :func:`status` says why and the library keeps its pure-torch code, which computes the same bits more
slowly. ``FP8_LIGHTNING_DISABLE_CPU_CODEC=1`` asks for the pure-torch code (read on every call).

Threads: ctypes releases the GIL, so a large tensor is cut into ranges cast concurrently by
``torch.get_num_threads()`` threads, as torch's own CPU kernels would use.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from fp8_lightning.kernels.availability import SCALE_ROUNDINGS
from fp8_lightning.kernels.fine_grained_layout import TILES as FINE_TILES  # rowwise per row / column, blockwise
from fp8_lightning.settings import settings

CODEC_DISABLE_ENV = "FP8_LIGHTNING_DISABLE_CPU_CODEC"
CACHE_ENV = "FP8_LIGHTNING_CACHE"
SOURCE = Path(__file__).with_name("cpu_codec.c")
INPUT_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
FORMATS = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}
PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)  # what owns the memory the C code reads (not wrapper subclasses)
PARALLEL_MIN_ELEMENTS = 1 << 20  # below this, one thread: handing out ranges costs more than it saves (measured)

_P, _I64, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "fp8_cast": [_P, _I, _I64, _I64, _F, _I, _P, _P, _P],
    "mx_quantize": [_P, _I, _I64, _I64, _I64, _I64, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P],
    "fp8_decode": [_P, _I64, _I64, _I, _P],
    "mx_decode": [_P, _P, _I64, _I64, _I64, _I, _I, _I, _P],
    "fine_quantize": [_P, _I, _I64, _I64, _I64, _I64, _I64, _I64, _I, _F, _I, _I, _P, _P, _P, _P],
    "nvfp4_amax": [_P, _I, _I64, _I64, _P],
    "nvfp4_quantize": [_P, _I, _I64, _I64, _I64, _I64, _I, _F, _P, _P, _P],
    "nvfp4_uniform": [_I64, _I64, ctypes.c_uint32, _P],
}
NVFP4_TILE_ROWS = (1, 16)  # 1x16 blocks (activations, gradients) or 16x16 tiles (weights)


# --------------------------------------------------------------------------------------------------------
# Build and load
# --------------------------------------------------------------------------------------------------------


def codec_disabled_by_env() -> bool:
    """Whether ``FP8_LIGHTNING_DISABLE_CPU_CODEC`` asked for the pure-torch path (:mod:`fp8_lightning.settings`)."""
    return settings().disable_cpu_codec


def status() -> tuple[bool, str]:
    """Whether the codec is built and loaded here, and the library's path or why not (ignores the variable)."""
    library, reason = _load()
    return library is not None, reason


def enabled() -> bool:
    """Whether the core should use the codec: it loads and ``FP8_LIGHTNING_DISABLE_CPU_CODEC`` is not set."""
    return not codec_disabled_by_env() and _load()[0] is not None


def _cpu_fingerprint() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), platform.processor())
    except OSError:
        return platform.processor()


@functools.lru_cache(maxsize=1)
def _load() -> tuple[ctypes.CDLL | None, str]:
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None, f"no C compiler found (CC={os.environ.get('CC', 'cc')!r}); install gcc or clang"
    try:
        source = SOURCE.read_bytes()
    except OSError as err:
        return None, f"the codec's source is missing ({err}); reinstall fp8-lightning"
    source_hash = hashlib.sha256(source).hexdigest()
    folder = settings().cache
    errors, rejected = [], []
    for flags in (["-O3", "-march=native"], ["-O3"]):
        key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), compiler.encode(),
                                          platform.machine().encode(), _cpu_fingerprint().encode()]))
        manifest = folder / f"cpu_codec-{key.hexdigest()[:16]}.json"
        try:
            target, problem = _verified(manifest, source_hash)
            if problem:
                rejected.append(problem)
            if target is None:  # missing or failed verification: a fresh build under a fresh name
                target = _build(compiler, flags, folder, manifest, source_hash)
            return _bind(ctypes.CDLL(str(target))), str(target)
        except (OSError, AttributeError, ValueError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
            detail = getattr(err, "stderr", None) or err
            errors.append(f"{' '.join(flags)}: {str(detail).strip()[:300]}")
    return None, (
        f"building the CPU codec in {folder} failed (" + "; ".join(rejected + errors) + f"); set {CACHE_ENV} to a "
        "writable folder if that one is not, or CC to a working C compiler"
    )


def _file_digest(path: Path) -> tuple[int, str]:
    """(size in bytes, sha256 hex digest) of the file at ``path``."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def _verified(manifest: Path, source_hash: str) -> tuple[Path | None, str | None]:
    """The library a build recorded in ``manifest`` when its size and sha256 still match the record and it was
    built from this source, else ``(None, why)`` (``(None, None)`` when nothing was built yet).

    A library is only loaded after this check: a truncated file would kill the process with SIGBUS when the
    loader maps it, and a file put there by something else would be executed.
    """
    try:
        record = json.loads(manifest.read_text())
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as err:
        return None, f"unreadable record {manifest} ({err}), rebuilt"
    if not isinstance(record, dict) or not isinstance(record.get("library"), str):
        return None, f"malformed record {manifest}, rebuilt"
    library = manifest.parent / Path(record["library"]).name
    if record.get("source_sha256") != source_hash:
        return None, f"{library.name} was built from another source, rebuilt"
    try:
        size, digest = _file_digest(library)
    except OSError as err:
        return None, f"cached library {library} is unreadable ({err}), rebuilt"
    if (size, digest) != (record.get("size"), record.get("sha256")):
        _remove(library)  # corrupt or foreign: never loaded; processes that mapped it keep their copy
        return None, (
            f"cached library {library.name} did not match its record (size {size} bytes, recorded "
            f"{record.get('size')}; sha256 {'matches' if digest == record.get('sha256') else 'differs'}), rebuilt"
        )
    return library, None


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _build(compiler: str, flags: list[str], folder: Path, manifest: Path, source_hash: str) -> Path:
    """Compile the codec into a fresh file next to ``manifest``, then record its size and sha256 in ``manifest``;
    both are written to temporary files and renamed into place (atomic), library first, so that a record always
    names a complete library. Concurrent builds each keep their own library; the last record wins."""
    folder.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=folder)
    os.close(handle)
    record_handle, record_partial = tempfile.mkstemp(prefix=".record-", suffix=".json", dir=folder)
    os.close(record_handle)
    try:
        command = [compiler, *flags, "-fPIC", "-shared", "-o", partial, str(SOURCE), "-lm"]
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=120)
        size, digest = _file_digest(Path(partial))
        target = folder / f"{manifest.stem}-{uuid.uuid4().hex[:12]}.so"  # fresh: never a name a process mapped
        os.replace(partial, target)
        Path(record_partial).write_text(json.dumps(
            {"library": target.name, "size": size, "sha256": digest, "source_sha256": source_hash}
        ))
        os.replace(record_partial, manifest)
        return target
    finally:
        for leftover in (partial, record_partial):
            if os.path.exists(leftover):
                os.remove(leftover)


def _bind(library: ctypes.CDLL) -> ctypes.CDLL:
    for name, argtypes in _SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, None
    library.fine_quantize.restype = _I  # 0, or -1 when its scratch memory could not be allocated
    return library


def _library() -> ctypes.CDLL:
    library, reason = _load()
    if library is None:
        raise RuntimeError(f"The CPU FP8 codec is not available: {reason}.")
    return library


# --------------------------------------------------------------------------------------------------------
# Ranges over threads
# --------------------------------------------------------------------------------------------------------


_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}


def _pool(threads: int) -> ThreadPoolExecutor:
    """A pool of ``threads`` workers owned by this process: a forked child (data loaders, launchers) inherits
    the parent's pool object but not its threads, so it makes its own."""
    key = (os.getpid(), threads)
    if key not in _POOLS:
        _POOLS[key] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fp8-cpu-codec")
    return _POOLS[key]


def _ranges(units: int, elements: int) -> list[tuple[int, int]]:
    """[begin, end) ranges of ``units`` (rows, block rows or elements) covering ``elements`` values in all."""
    threads = min(torch.get_num_threads(), units)
    if threads <= 1 or elements < PARALLEL_MIN_ELEMENTS:
        return [(0, units)]
    step = -(-units // threads)
    return [(begin, min(begin + step, units)) for begin in range(0, units, step)]


def _over_ranges(call, ranges: list[tuple[int, int]]) -> None:
    """``call(i, begin, end)`` for each range, on the pool's threads when there are several."""
    if len(ranges) == 1:
        call(0, *ranges[0])
        return
    for future in [_pool(len(ranges)).submit(call, i, *r) for i, r in enumerate(ranges)]:
        future.result()


def _run(call, units: int, elements: int) -> None:
    """``call(i, begin, end)`` over :func:`_ranges` of ``units``; small work (the common case) in one call on this
    thread, without building the ranges."""
    if elements < PARALLEL_MIN_ELEMENTS:
        call(0, 0, units)
    else:
        _over_ranges(call, _ranges(units, elements))


# --------------------------------------------------------------------------------------------------------
# The casts
# --------------------------------------------------------------------------------------------------------


def _require(x: torch.Tensor, dtypes, what: str) -> torch.Tensor:
    """``x`` detached and contiguous, after checking it is a plain CPU tensor of one of ``dtypes`` (the C code
    reads its memory directly: anything else would be read wrong, or crash)."""
    if type(x) not in PLAIN_TYPES or not x.is_cpu:
        got = f"a {type(x).__name__} on {x.device}" if torch.is_tensor(x) else type(x).__name__
        raise TypeError(f"cpu_codec.{what} takes plain CPU tensors; got {got}. Use fp8_lightning.quantize instead.")
    if x.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"cpu_codec.{what} takes {allowed} tensors; got {x.dtype}.")
    return x.detach().contiguous()




def _format(dtype, what: str) -> int:
    """The C code's number for the FP8 ``dtype``, after checking it is one the codec writes."""
    if dtype not in FORMATS:
        allowed = ", ".join(str(d).replace("torch.", "") for d in FORMATS)
        raise ValueError(
            f"cpu_codec.{what}: dtype={dtype!r} is not an FP8 format the codec writes; allowed: {allowed}."
        )
    return FORMATS[dtype]


def _check_mx_arguments(block, rounding, what: str) -> None:
    """Refuse what the reference refuses: a rounding other than exactly "rceil" or "floor" (the C code would read
    anything but "rceil" as floor), and a block size that is not a positive integer."""
    if not isinstance(rounding, str) or rounding not in SCALE_ROUNDINGS:
        raise ValueError(
            f"cpu_codec.{what}: scale_rounding={rounding!r} is invalid; allowed: rceil or floor (lower case). "
            "Pass one of them."
        )
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
        raise ValueError(
            f"cpu_codec.{what}: block_size={block!r} is invalid; it must be a positive integer (MX uses 32). Pass the "
            "number of elements that share one scale."
        )


def fp8_cast(
    x: torch.Tensor, scale: float, dtype: torch.dtype, with_amax: bool = False
) -> tuple[torch.Tensor, torch.Tensor, float | None]:
    """``(saturate(x * scale) in dtype, the codes' float32 values, max |x| or None)`` in one pass (the amax is
    NaN when x holds NaN)."""
    x = _require(x, INPUT_DTYPES, "fp8_cast")
    fmt = _format(dtype, "fp8_cast")
    n = x.numel()
    codes = torch.empty_like(x, dtype=dtype)  # x is contiguous: so are these (faster than empty(shape))
    values = torch.empty_like(x, dtype=torch.float32)
    function, source = _library().fp8_cast, x.data_ptr()
    if n < PARALLEL_MIN_ELEMENTS:  # one range on this thread: the common, small case, without the machinery below
        amax_out = (ctypes.c_float * 1)() if with_amax else None
        function(source, INPUT_DTYPES[x.dtype], 0, n, scale, fmt, codes.data_ptr(), values.data_ptr(), amax_out)
        return codes, values, (amax_out[0] if with_amax else None)
    ranges = _ranges(n, n)
    amaxes = torch.zeros(len(ranges), dtype=torch.float32) if with_amax else None

    def call(i, begin, end):
        amax_out = amaxes.data_ptr() + 4 * i if with_amax else None
        function(source, INPUT_DTYPES[x.dtype], begin, end, scale, fmt, codes.data_ptr(), values.data_ptr(), amax_out)

    _over_ranges(call, ranges)
    top = None if amaxes is None else (amaxes.max().item() if len(ranges) > 1 else amaxes.item())
    return codes, values, top


def mx_quantize(
    x: torch.Tensor, block: int, rounding: str, dtype: torch.dtype, rowwise: bool = True, columnwise: bool = False,
    column_values: bool = True,
):
    """MX copies of a 2-D ``x`` (M, K) from one read, each ``(data, E8M0 scales, float32 values)`` or None:

    * rowwise: blocks along K; data and values (M, K), scales (M, K // block);
    * columnwise: blocks down the columns, M zero-padded to whole blocks, in x's layout: data and values
      (M_pad, K), scales (M_pad // block, K); transposed, the operand of x.T. ``column_values=False``: its
      values are not made (None).
    """
    x = _require(x, INPUT_DTYPES, "mx_quantize")
    _check_mx_arguments(block, rounding, "mx_quantize")
    fmt = _format(dtype, "mx_quantize")
    if x.dim() != 2 or (rowwise and x.shape[1] % block):
        raise ValueError(
            f"cpu_codec.mx_quantize takes a 2-D tensor whose rows hold whole blocks of {block}; got {tuple(x.shape)}."
        )
    m, k = x.shape
    groups = -(-m // block)
    row = col = None
    if rowwise:
        row = (torch.empty((m, k), dtype=dtype), torch.empty((m, k // block), dtype=torch.float8_e8m0fnu),
               torch.empty((m, k), dtype=torch.float32))
    if columnwise:
        col = (torch.empty((groups * block, k), dtype=dtype), torch.empty((groups, k), dtype=torch.float8_e8m0fnu),
               torch.empty((groups * block, k), dtype=torch.float32) if column_values else None)
    outputs = (row or (None,) * 3) + (col or (None,) * 3)  # codes, scales, values: rowwise, then columnwise
    pointers = [None if t is None else t.data_ptr() for t in outputs]
    function, args = _library().mx_quantize, (fmt, int(rounding == "rceil"))

    def call(_, begin, end):
        work = torch.empty(2 * k, dtype=torch.float32)
        function(x.data_ptr(), INPUT_DTYPES[x.dtype], m, begin, end, k, block, *args, *pointers, work.data_ptr())

    _run(call, groups, m * k)
    return row, col  # written in place, allocated in their final dtypes


def fp8_decode(codes: torch.Tensor) -> torch.Tensor:
    """The float32 values of E4M3 or E5M2 ``codes`` (``codes.float()``, bit for bit; NaN codes give NaN)."""
    codes = _require(codes, FORMATS, "fp8_decode")
    n = codes.numel()
    values = torch.empty_like(codes, dtype=torch.float32)
    function, fmt = _library().fp8_decode, FORMATS[codes.dtype]

    def call(_, begin, end):
        function(codes.data_ptr(), begin, end, fmt, values.data_ptr())

    _run(call, n, n)
    return values


def mx_decode(codes: torch.Tensor, scales: torch.Tensor, columnwise: bool) -> torch.Tensor:
    """MX values (each E4M3/E5M2 code times its E8M0 block scale) of 2-D codes (M, K), with blocks along K (scales
    (M, K // block)) or, ``columnwise``, down the columns (scales (M // block, K))."""
    codes, scales = _require(codes, FORMATS, "mx_decode"), _require(scales, (torch.float8_e8m0fnu,), "mx_decode")
    along = 0 if columnwise else 1  # the dimension the blocks run along
    if codes.dim() != 2 or scales.dim() != 2 or scales.shape[along] == 0 or codes.shape[along] % scales.shape[along] \
            or scales.shape[1 - along] != codes.shape[1 - along]:
        raise ValueError(f"cpu_codec.mx_decode: scales {tuple(scales.shape)} do not match codes {tuple(codes.shape)}.")
    m, k = codes.shape
    block = codes.shape[along] // scales.shape[along]
    values = torch.empty((m, k), dtype=torch.float32)
    function, fmt = _library().mx_decode, FORMATS[codes.dtype]

    def call(_, begin, end):
        function(codes.data_ptr(), scales.data_ptr(), begin, end, k, block, int(columnwise), fmt, values.data_ptr())

    _run(call, m, m * k)
    return values


def fine_quantize(
    x: torch.Tensor, tile: tuple[int, int], dtype: torch.dtype, power_of_2: bool, eps: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(data, scale, inverse, values)`` of a non-empty 2-D ``x`` (M, K) cast in ``tile`` windows, in x's layout,
    in one pass per band of tile rows:

    * rowwise, ``(1, 0)`` one scale per row (scale (M, 1)) or ``(0, 1)`` one per column (scale (1, K)): the bits of
      ``rowwise.quantize_rowwise`` with ``eps``; values are the codes' float32 values (the rowwise GEMM scales
      its float32 accumulator);
    * blockwise, ``(1, 128)``, ``(128, 1)`` or ``(128, 128)`` (ragged edges make smaller tiles): the bits of
      ``blockwise.quantize_blockwise`` (``eps`` unused); scale (ceil(M / rows), ceil(K / cols)); values are the
      dequantized ``code * (1 / scale)`` in float32, what the emulated blockwise GEMM multiplies.

    ``inverse`` is ``scale.reciprocal()`` (the factor a scaled GEMM applies), bit for bit.
    """
    x = _require(x, INPUT_DTYPES, "fine_quantize")
    fmt = _format(dtype, "fine_quantize")
    tile = tuple(tile)
    if tile not in FINE_TILES:
        allowed = ", ".join(map(str, FINE_TILES))
        raise ValueError(f"cpu_codec.fine_quantize: tile={tile} is invalid; allowed: {allowed}.")
    if x.dim() != 2 or x.numel() == 0:
        raise ValueError(f"cpu_codec.fine_quantize takes a non-empty 2-D tensor; got shape {tuple(x.shape)}.")
    m, k = x.shape
    block_rule = 0 not in tile
    rows, cols = (tile[0] or m), (tile[1] or k)
    bands, tiles = -(-m // rows), -(-k // cols)
    data, values = torch.empty_like(x, dtype=dtype), torch.empty_like(x, dtype=torch.float32)
    scale, inverse = torch.empty((bands, tiles), dtype=torch.float32), torch.empty((bands, tiles), dtype=torch.float32)
    function, head = _library().fine_quantize, (x.data_ptr(), INPUT_DTYPES[x.dtype], m, k)
    tail = (rows, cols, fmt, eps, int(power_of_2), int(block_rule), data.data_ptr(), scale.data_ptr(),
            inverse.data_ptr(), values.data_ptr())

    def call(_, begin, end):
        if function(*head, begin, end, *tail):
            raise MemoryError(f"cpu_codec.fine_quantize: no memory for {2 * tiles} floats of scratch.")

    _run(call, bands, m * k)
    return data, scale, inverse, values


def nvfp4_amax(x: torch.Tensor) -> torch.Tensor:
    """``x.abs().amax()`` of a non-empty float32/bf16 ``x`` as a float32 scalar, from one read (NaN when x holds
    NaN; which NaN is not specified: ``nvfp4.global_scale_from_amax`` maps every NaN to 1)."""
    x = _require(x, INPUT_DTYPES, "nvfp4_amax")
    n = x.numel()
    if n == 0:
        raise ValueError("cpu_codec.nvfp4_amax takes a non-empty tensor.")
    ranges = [(0, n)] if n < PARALLEL_MIN_ELEMENTS else _ranges(n, n)
    tops = torch.zeros(len(ranges), dtype=torch.int32)
    function = _library().nvfp4_amax

    def call(i, begin, end):
        function(x.data_ptr(), INPUT_DTYPES[x.dtype], begin, end, tops.data_ptr() + 4 * i)

    _over_ranges(call, ranges)
    return tops.max().view(torch.float32)  # magnitude bits order like the magnitudes, NaN above inf


def nvfp4_quantize(
    x: torch.Tensor, global_scale: float, tile_rows: int = 1, uniform: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, block_scales)`` of a non-empty 2-D float32/bf16 ``x`` (M, K) with the float32 ``global_scale``:
    the bits of ``fp8_lightning.nvfp4.quantize_nvfp4``, in one pass over each band of ``tile_rows`` rows.

    Rows (to whole tiles) and K (to whole blocks of 16) are zero-padded: codes uint8 (M_pad, K_pad / 2), the even
    element in the low nibble; block_scales float8_e4m3fn (M_pad / tile_rows, K_pad / 16). ``uniform``: None
    (round to nearest even) or float32 numbers in [0, 1) of shape (M_pad, K_pad) (stochastic rounding).
    """
    x = _require(x, INPUT_DTYPES, "nvfp4_quantize")
    if tile_rows not in NVFP4_TILE_ROWS:
        raise ValueError(f"cpu_codec.nvfp4_quantize: tile_rows={tile_rows!r} is invalid; allowed: 1 or 16.")
    if x.dim() != 2 or x.numel() == 0:
        raise ValueError(f"cpu_codec.nvfp4_quantize takes a non-empty 2-D tensor; got shape {tuple(x.shape)}.")
    m, k = x.shape
    bands, pk = -(-m // tile_rows), -(-k // 16) * 16
    if uniform is not None:
        uniform = _require(uniform, (torch.float32,), "nvfp4_quantize")
        if tuple(uniform.shape) != (bands * tile_rows, pk):
            raise ValueError(f"cpu_codec.nvfp4_quantize: uniform has shape {tuple(uniform.shape)}; the padded shape "
                             f"{(bands * tile_rows, pk)} is needed.")
    codes = torch.empty((bands * tile_rows, pk // 2), dtype=torch.uint8)
    scales = torch.empty((bands, pk // 16), dtype=torch.float8_e4m3fn)
    function, head = _library().nvfp4_quantize, (x.data_ptr(), INPUT_DTYPES[x.dtype], m, k)
    tail = (tile_rows, float(global_scale), None if uniform is None else uniform.data_ptr(), codes.data_ptr(),
            scales.data_ptr())

    def call(_, begin, end):
        function(*head, begin, end, *tail)

    _run(call, bands, m * k)
    return codes, scales


def nvfp4_uniform(shape: tuple[int, int], key: int) -> torch.Tensor:
    """``fp8_lightning.nvfp4.uniform_like(shape, key)`` on the CPU, bit for bit: float32 in [0, 1) from the 32-bit
    counter hash of each flat position and ``key`` (taken modulo 2**32, as the reference's arithmetic does)."""
    rows, cols = shape
    out = torch.empty((rows, cols), dtype=torch.float32)
    n = rows * cols
    function, key = _library().nvfp4_uniform, int(key) & 0xFFFFFFFF

    def call(_, begin, end):
        function(begin, end, key, out.data_ptr())

    _run(call, n, n)
    return out
