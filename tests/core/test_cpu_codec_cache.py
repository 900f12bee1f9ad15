"""The C codec's cache is verified before anything in it is loaded, and its entry points check their arguments.

Each test starts fresh processes on a private cache folder (``FP8_LIGHTNING_CACHE``): a library that fails
verification must be caught before the loader maps it, which only a new process shows (a truncated library mapped
by the loader kills the process with SIGBUS).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8_lightning.ops import dispatch
from fp8_lightning.kernels import cpu_codec

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler (cc) to build the codec")
ROOT = Path(__file__).resolve().parents[2]

# Builds (or loads) the codec, casts through it and checks the bits against the pure-torch reference, then prints
# the codec's status and whether the loaded library carries the foreign test library's marker.
_PROBE = """
import json, torch
from fp8_lightning import quantize
from fp8_lightning.kernels import cpu_codec
ok, reason = cpu_codec.status()
library = cpu_codec._load()[0]
same = None
if ok:
    x = torch.randn(64, 64)
    codes, _, _ = cpu_codec.fp8_cast(x, 2.0, torch.float8_e4m3fn)
    want = (x * 2.0).clamp(-448, 448).to(torch.float8_e4m3fn)
    same = torch.equal(codes.view(torch.uint8), want.view(torch.uint8))
print(json.dumps({"ok": ok, "reason": reason, "same": same, "foreign": hasattr(library, "foreign_marker")}))
"""


def _probe(cache: Path) -> dict:
    env = {**os.environ, cpu_codec.CACHE_ENV: str(cache), "PYTHONPATH": str(ROOT)}
    env.pop(cpu_codec.CODEC_DISABLE_ENV, None)
    done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"rc={done.returncode} (SIGBUS is -7)\n{done.stderr[-2000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cached_libraries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.glob("cpu_codec-*.so"))


@needs_cc
def test_a_truncated_cached_library_is_rebuilt_not_mapped(tmp_path):
    """Guards against a truncated cached .so killing every new process with SIGBUS: it must fail verification and
    be rebuilt under a fresh name (or the process falls back with the reason)."""
    first = _probe(tmp_path)
    assert first["ok"] and first["same"], first
    libraries = _cached_libraries(tmp_path)
    assert libraries
    for library in libraries:
        with open(library, "r+b") as handle:
            handle.truncate(library.stat().st_size // 3)
    second = _probe(tmp_path)
    assert second["ok"] and second["same"], second
    assert Path(second["reason"]) not in libraries  # a fresh name, never the truncated file


_FOREIGN_C = r"""
#include <stdint.h>
int foreign_marker(void) { return 42; }
%s
"""
_CODEC_SYMBOLS = "".join(f"void {name}(void) {{}}\n" for name in cpu_codec._SIGNATURES)


@needs_cc
@pytest.mark.parametrize("symbols", ["none", "codec"], ids=["missing-symbols", "matching-symbols"])
def test_a_foreign_library_under_the_cached_name_is_not_loaded(tmp_path, symbols):
    """Guards against loading a foreign .so put under the cached name: one without the codec's symbols broke every
    CPU FP8 call with AttributeError, one with them was executed. Either way it must be refused and rebuilt."""
    assert _probe(tmp_path)["ok"]
    source = tmp_path / "foreign.c"
    source.write_text(_FOREIGN_C % (_CODEC_SYMBOLS if symbols == "codec" else ""))
    foreign = tmp_path / "foreign.bin"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(foreign), str(source)], check=True, capture_output=True)
    for library in _cached_libraries(tmp_path):
        shutil.copyfile(foreign, library)
    result = _probe(tmp_path)
    assert result["ok"] and result["same"] and not result["foreign"], result


@needs_cc
def test_each_build_records_its_size_and_hash(monkeypatch, tmp_path):
    """Guards the record the verification reads: written next to the library, naming it, with its size, sha256 and
    the source's sha256, and no partial files left behind."""
    from tests.environment import set_env

    set_env(monkeypatch, **{cpu_codec.CACHE_ENV: str(tmp_path)})
    cpu_codec._load.cache_clear()
    try:
        ok, path = cpu_codec.status()
        assert ok
        records = list(tmp_path.glob("cpu_codec-*.json"))
        assert len(records) == 1 and sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [records[0].name, Path(path).name]
        )
        record = json.loads(records[0].read_text())
        size, digest = cpu_codec._file_digest(Path(path))
        assert record["library"] == Path(path).name and (record["size"], record["sha256"]) == (size, digest)
        assert record["source_sha256"] == cpu_codec.hashlib.sha256(cpu_codec.SOURCE.read_bytes()).hexdigest()
    finally:
        cpu_codec._load.cache_clear()


@needs_cc
def test_a_failed_rebuild_falls_back_with_the_reason(monkeypatch, tmp_path):
    """Guards the fallback: when the cached library fails verification and no rebuild is possible, the codec is
    off, the library keeps its pure-torch path, and the status names the rejected file."""
    from tests.environment import set_env

    set_env(monkeypatch, **{cpu_codec.CACHE_ENV: str(tmp_path)})
    cpu_codec._load.cache_clear()
    try:
        assert cpu_codec.status()[0]
        for library in _cached_libraries(tmp_path):
            library.write_bytes(b"\x7fELF")

        def broken_build(*args, **kwargs):
            raise subprocess.CalledProcessError(1, "cc", stderr="compiler broken")

        monkeypatch.setattr(cpu_codec, "_build", broken_build)
        cpu_codec._load.cache_clear()
        ok, reason = cpu_codec.status()
        assert not ok and "did not match its record" in reason and "compiler broken" in reason, reason
        assert dispatch.cpu_codec() is None
        data, scale = dispatch.fast_quantize_mxfp8(torch.randn(4, 64))
        assert data.shape == (4, 64) and scale.shape == (4, 2)
    finally:
        cpu_codec._load.cache_clear()


@pytest.mark.skipif(not cpu_codec.status()[0], reason=f"the CPU codec is not built here: {cpu_codec.status()[1]}")
@pytest.mark.parametrize("rounding", ["up", "RCEIL", "", None, "Floor"])
def test_a_scale_rounding_other_than_rceil_or_floor_is_refused(rounding):
    """Guards against the codec reading any rounding but "rceil" as floor: it refuses what the reference refuses,
    directly and through the public quantize_mxfp8."""
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="scale_rounding=.* is invalid; allowed: rceil or floor"):
        cpu_codec.mx_quantize(x, 32, rounding, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="scale_rounding=.* is invalid; allowed: rceil or floor"):
        dispatch.fast_quantize_mxfp8(x, scale_rounding=rounding)


@pytest.mark.skipif(not cpu_codec.status()[0], reason=f"the CPU codec is not built here: {cpu_codec.status()[1]}")
@pytest.mark.parametrize("block", [0, -32, 32.0, True])
def test_a_block_size_that_is_not_a_positive_integer_is_refused(block):
    """Guards against raw errors (ZeroDivisionError, a negative shape) from block_size 0 or negative."""
    with pytest.raises(ValueError, match="block_size=.* is invalid; it must be a positive integer"):
        cpu_codec.mx_quantize(torch.randn(4, 64), block, "rceil", torch.float8_e4m3fn)


@pytest.mark.skipif(not cpu_codec.status()[0], reason=f"the CPU codec is not built here: {cpu_codec.status()[1]}")
def test_an_output_dtype_that_is_not_fp8_is_refused():
    """Guards against a bare KeyError for an output dtype the codec cannot write."""
    with pytest.raises(ValueError, match="dtype=torch.float16 is not an FP8 format the codec writes"):
        cpu_codec.fp8_cast(torch.randn(8), 1.0, torch.float16)


@pytest.mark.parametrize("block_size", [0, -32, 32.0, True])
def test_the_reference_refuses_a_block_size_that_is_not_a_positive_integer(block_size):
    """The pure-torch path (no codec) names the argument instead of dividing by zero."""
    from fp8_lightning import mx

    with pytest.raises(ValueError, match="block_size=.* must be a positive integer"):
        mx.quantize_mxfp8(torch.randn(4, 64), block_size=block_size)


@pytest.mark.parametrize("rounding", ["up", "RCEIL", None])
@pytest.mark.parametrize("rows", [4, 0], ids=["rows", "empty"])
def test_quantize_mxfp8_checks_the_rounding_before_choosing_a_backend(monkeypatch, rounding, rows):
    """Guards the paths that never reach the codec's own check: the Triton kernel (CUDA), which also reads anything
    but "rceil" as floor, and an empty tensor; the message names the public function, not a backend."""

    def no_backend(*_):
        raise AssertionError("a backend was chosen before the arguments were checked")

    monkeypatch.setattr(dispatch, "_mx_kernels", no_backend)
    with pytest.raises(ValueError, match=r"^quantize_mxfp8: scale_rounding=.* is invalid; allowed: rceil or floor"):
        dispatch.fast_quantize_mxfp8(torch.randn(rows, 64), scale_rounding=rounding)
