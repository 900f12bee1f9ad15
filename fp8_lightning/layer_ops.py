"""Moved to :mod:`fp8_lightning.ops.layer`; the name ``traced.py`` still imports from here, re-exported."""

from fp8_lightning.ops.layer import scaled_gemm

__all__ = ["scaled_gemm"]
