"""Moved to :mod:`fp8_lightning.ops.dispatch`; the names ``scaling.py`` still imports from here, re-exported."""

from fp8_lightning.ops.dispatch import amax_and_value, fused_cast, quantize_operand

__all__ = ["amax_and_value", "fused_cast", "quantize_operand"]
