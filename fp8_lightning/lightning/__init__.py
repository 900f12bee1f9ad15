"""Lightning adapters: precision plugins for the Trainer and Fabric, the precision strings, callbacks.

Thin by design: the hooks wire Lightning's life cycle to the core (``fp8_lightning.convert``, ``.stats``,
``.guard``), which never imports Lightning.
"""

from fp8_lightning.lightning.callbacks import FP8StatsMonitor
from fp8_lightning.lightning.fabric import FP8FabricPrecision
from fp8_lightning.lightning.optimizer_callback import FP8OptimizerStates
from fp8_lightning.lightning.precision import FP8Precision
from fp8_lightning.lightning.registration import register_precision_strings
from fp8_lightning.lightning.strings import PRECISION_RECIPES, PRECISION_STRINGS, precision_choices

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
