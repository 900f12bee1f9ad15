"""FP8 optimizer states: ``FP8Optimizer`` wraps Adam/AdamW/SGD and stores their states in FP8/FP16.

See ``optimizer.py`` for the design, ``state_formats.py`` for the storage formats, ``master_weights.py`` for the
master-weight choices and ``config.py`` for the presets.
"""

from fp8_lightning.optim.checkpoint import master_parameters, to_plain_state_dict
from fp8_lightning.optim.config import PRESETS, FP8OptimizerConfig, config_from
from fp8_lightning.optim.factory import fp8_adamw
from fp8_lightning.optim.optimizer import SUPPORTED_OPTIMIZERS, FP8Optimizer
from fp8_lightning.optim.state_formats import StateFormat

__all__ = [
    "FP8Optimizer",
    "FP8OptimizerConfig",
    "PRESETS",
    "SUPPORTED_OPTIMIZERS",
    "StateFormat",
    "config_from",
    "fp8_adamw",
    "master_parameters",
    "to_plain_state_dict",
]
