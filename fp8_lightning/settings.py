"""Every ``FP8_LIGHTNING_*`` environment variable, read once into one frozen object.

The library's backend choices (Triton kernels or pure torch on CUDA, the C codec or pure torch on CPU, which GEMM)
used to read the environment on every call, from several modules. They now read :func:`settings`: the variables
are parsed and validated the first time it is called, and the answer stays the same for the life of the process,
so a compiled graph and the eager code never disagree about it. A bad value fails at that first read with the
variable, the value and what is allowed.

The design in full: ``docs/design/notes.md``, section ``fp8_lightning.settings``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Mapping

PREFIX = "FP8_LIGHTNING_"
GEMM_BACKENDS = ("auto", "scaled_mm", "emulate")
GROUPED_GEMM_BACKENDS = ("auto", "torch", "triton")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


# (variable, default, effect): the documentation's table is rendered from this (``environment_table``), and a test
# checks that every ``Settings`` field's variable is here.
VARIABLES = (
    (PREFIX + "GEMM", "auto", "`auto`: the fastest exact GEMM for the device (float matmul of the FP8 values on CPU, "
     "`torch._scaled_mm` on CUDA); `scaled_mm`: `torch._scaled_mm` everywhere (also CPU); `emulate`: dequantize and "
     "matmul in float32"),
    (PREFIX + "EMULATE", "0", "`1`: emulate FP8 numerics in float32 on devices without FP8 GEMMs instead of refusing "
     "(as `emulate=True`)"),
    (PREFIX + "DISABLE_TRITON", "0", "`1`: CUDA tensors take the pure-PyTorch path instead of the Triton kernels"),
    (PREFIX + "TRITON_EXPLICIT_ROUNDING", "0", "ignored on a GPU, with a warning (the explicitly rounded transposed "
     "casts were wrong on an H100 with Triton 3.6, and the hardware conversion already rounds to nearest even); "
     "always on under `TRITON_INTERPRET=1`"),
    (PREFIX + "DISABLE_CPU_CODEC", "0", "`1`: CPU tensors take the pure-PyTorch path instead of the C codec"),
    (PREFIX + "GLUON_MX_GEMM", "0", "`1`: on Hopper (capability 9.x) the MX GEMM runs the Gluon kernel whose wgmma "
     "overlaps the scale math instead of the shipped Triton kernel"),
    (PREFIX + "GROUPED_GEMM", "auto", "the kernel of the rowwise expert (grouped) GEMMs on CUDA. `auto`: "
     "`torch._scaled_grouped_mm` where torch has it for the device (sm_90 in torch 2.11), else the Triton grouped "
     "GEMM (sm_89, sm_100); `torch`: torch's wherever it runs (else Triton); `triton`: the Triton kernel everywhere "
     "(sm_89+)"),
    (PREFIX + "WEIGHT_CHECKSUM", "1", "`0`: a training forward reuses the step's FP8 weight on the version counter "
     "alone. By default a reuse between micro-batches first checks that no edit through `weight.data` changed the "
     "weight: by a checksum on a CPU (two reads of the weight per cast and per reuse), by casting again on a GPU "
     "(no device sync)"),
    (PREFIX + "CACHE", "~/.cache/fp8_lightning", "where the C codec is built and the measured GPU roofline is kept "
     "(`FP8_LIGHTNING_CACHE_DIR`, its older name, is still read)"),
)


def environment_table() -> str:
    """:data:`VARIABLES` as a Markdown table (the documentation's copy is checked against it)."""
    rows = [f"| `{name}` | `{default}` | {effect} |" for name, default, effect in VARIABLES]
    return "\n".join(["| variable | default | effect |", "|---|---|---|", *rows])


@dataclasses.dataclass(frozen=True)
class Settings:
    """The parsed environment (:data:`VARIABLES` lists each field's variable)."""

    gemm: str = "auto"
    emulate: bool = False
    disable_triton: bool = False
    triton_explicit_rounding: bool = False
    disable_cpu_codec: bool = False
    cache: Path = Path.home() / ".cache" / "fp8_lightning"
    gluon_mx_gemm: bool = False
    weight_checksum: bool = True
    grouped_gemm: str = "auto"

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> "Settings":
        """Parse ``environ``; raise ``ValueError`` naming the variable for a value that is not allowed."""
        gemm = environ.get(PREFIX + "GEMM", "auto").strip().lower()
        if gemm not in GEMM_BACKENDS:
            raise ValueError(
                f"{PREFIX}GEMM={environ[PREFIX + 'GEMM']!r} is not allowed; use one of {', '.join(GEMM_BACKENDS)} "
                "(or unset it for auto)."
            )
        grouped = environ.get(PREFIX + "GROUPED_GEMM", "auto").strip().lower()
        if grouped not in GROUPED_GEMM_BACKENDS:
            raise ValueError(
                f"{PREFIX}GROUPED_GEMM={environ[PREFIX + 'GROUPED_GEMM']!r} is not allowed; use one of "
                f"{', '.join(GROUPED_GEMM_BACKENDS)} (or unset it for auto)."
            )
        cache = environ.get(PREFIX + "CACHE") or environ.get(PREFIX + "CACHE_DIR")
        return cls(
            gemm=gemm,
            emulate=_flag(environ, "EMULATE"),
            disable_triton=_flag(environ, "DISABLE_TRITON"),
            triton_explicit_rounding=_flag(environ, "TRITON_EXPLICIT_ROUNDING"),
            disable_cpu_codec=_flag(environ, "DISABLE_CPU_CODEC"),
            cache=Path(cache).expanduser() if cache else cls.cache,
            gluon_mx_gemm=_flag(environ, "GLUON_MX_GEMM"),
            weight_checksum=_flag(environ, "WEIGHT_CHECKSUM", "1"),
            grouped_gemm=grouped,
        )


def _flag(environ: Mapping[str, str], name: str, default: str = "0") -> bool:
    value = environ.get(PREFIX + name, default).strip().lower()
    if value not in _TRUE + _FALSE:
        raise ValueError(
            f"{PREFIX}{name}={environ[PREFIX + name]!r} is not a boolean; use 1 or 0 (true/false, yes/no, on/off)."
        )
    return value in _TRUE


_current: Settings | None = None


def settings() -> Settings:
    """The process's settings, read from the environment on the first call."""
    global _current
    if _current is None:
        _current = Settings.from_environ()
    return _current


def reload_settings() -> Settings:
    """Read the environment again (after changing a variable) and return the new settings."""
    global _current
    _current = Settings.from_environ()
    return _current
