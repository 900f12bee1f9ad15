"""Lightning adapters: precision plugins for the Trainer and Fabric, the precision strings, callbacks.

Thin by design: the hooks wire Lightning's life cycle to the core (``fp8_lightning.convert``, ``.stats``,
``.guard``), which never imports Lightning. The names below are loaded on first use, so that
``fp8_lightning.lightning.hook`` (imported by ``import fp8_lightning``) does not import Lightning itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fp8_lightning.lightning.hook import lazy_names

if TYPE_CHECKING:
    from fp8_lightning.lightning.callbacks import FP8StatsMonitor
    from fp8_lightning.lightning.fabric import FP8FabricPrecision
    from fp8_lightning.lightning.optimizer_callback import FP8OptimizerStates
    from fp8_lightning.lightning.precision import FP8Precision
    from fp8_lightning.lightning.registration import register_precision_strings
    from fp8_lightning.lightning.strings import PRECISION_RECIPES, PRECISION_STRINGS, precision_choices

_LAZY = {
    "FP8FabricPrecision": "fp8_lightning.lightning.fabric",
    "FP8OptimizerStates": "fp8_lightning.lightning.optimizer_callback",
    "FP8Precision": "fp8_lightning.lightning.precision",
    "FP8StatsMonitor": "fp8_lightning.lightning.callbacks",
    "PRECISION_RECIPES": "fp8_lightning.lightning.strings",
    "PRECISION_STRINGS": "fp8_lightning.lightning.strings",
    "precision_choices": "fp8_lightning.lightning.strings",
    "register_precision_strings": "fp8_lightning.lightning.registration",
}

__all__ = [
    "FP8FabricPrecision",
    "FP8OptimizerStates",
    "FP8Precision",
    "FP8StatsMonitor",
    "PRECISION_RECIPES",
    "PRECISION_STRINGS",
    "precision_choices",
    "register_precision_strings",
]


__getattr__, __dir__ = lazy_names(globals(), _LAZY)
