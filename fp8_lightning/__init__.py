"""fp8_lightning: FP8 mixed-precision training for PyTorch Lightning, on NVIDIA GPUs and emulated on a CPU.

The core (formats, recipes, scaling, quantize, gemm, linear, convert, autocast) is plain PyTorch and never imports
Lightning; the Lightning adapters live in ``fp8_lightning.lightning``.
"""

from typing import TYPE_CHECKING

from fp8_lightning.autocast import fp8_autocast, is_fp8_enabled
from fp8_lightning.capability_table import capabilities
from fp8_lightning.ops.dispatch import fast_dequantize_mxfp8 as dequantize_mxfp8
from fp8_lightning.ops.dispatch import fast_dequantize_tensorwise as dequantize_tensorwise
from fp8_lightning.ops.dispatch import fast_quantize_mxfp8 as quantize_mxfp8
from fp8_lightning.ops.dispatch import fast_quantize_tensorwise as quantize_tensorwise
from fp8_lightning.convert import (
    ConversionReport,
    convert_to_fp8,
    fp8_modules,
    sync_scales,
)
from fp8_lightning.saved_state import fp8_state_dict, load_fp8_state_dict
from fp8_lightning.formats import Format, fp8_max
from fp8_lightning.grouped import GroupedExperts, fp8_grouped_mm
from fp8_lightning.gemm import fp8_gemm_support, fp8_mm
from fp8_lightning.linear import FP8Linear
from fp8_lightning.optim import FP8Optimizer
from fp8_lightning.profitability import ProfitabilityGate
from fp8_lightning.nvfp4 import NVFP4Tensor, dequantize_nvfp4, quantize_nvfp4
from fp8_lightning.policy import RecipePolicy, first_last_high_precision
from fp8_lightning.quantize import Quantized
from fp8_lightning.recompute import FP8RecomputeError, fp8_checkpoint_context
from fp8_lightning.recipes import (
    BlockwiseScaling,
    DelayedScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
    RowwiseScaling,
    TensorwiseScaling,
    recipe_from,
)
from fp8_lightning.guard import DivergenceGuard
from fp8_lightning.lightning import hook as _hook
from fp8_lightning.lightning.hook import lazy_names

if TYPE_CHECKING:  # the names __getattr__ below loads on first use
    from fp8_lightning.lightning.callbacks import FP8StatsMonitor as FP8StatsMonitor
    from fp8_lightning.lightning.ddp import FP8DDPStrategy as FP8DDPStrategy
    from fp8_lightning.lightning.ddp import register_ddp_strategy as register_ddp_strategy
    from fp8_lightning.lightning.fabric import FP8FabricPrecision as FP8FabricPrecision
    from fp8_lightning.lightning.fsdp import FP8FSDPStrategy as FP8FSDPStrategy
    from fp8_lightning.lightning.fsdp import register_fsdp_strategy as register_fsdp_strategy
    from fp8_lightning.lightning.optimizer_callback import FP8OptimizerStates as FP8OptimizerStates
    from fp8_lightning.lightning.precision import FP8Precision as FP8Precision
    from fp8_lightning.lightning.registration import RegistrationError as RegistrationError
    from fp8_lightning.lightning.registration import register_precision_strings as register_precision_strings

# The Lightning adapters (and with them Lightning) load on first use: ``import fp8_lightning.formats`` and the rest
# of the core never import Lightning.
_LIGHTNING = {
    "FP8DDPStrategy": "fp8_lightning.lightning.ddp",
    "FP8FSDPStrategy": "fp8_lightning.lightning.fsdp",
    "FP8FabricPrecision": "fp8_lightning.lightning.fabric",
    "FP8OptimizerStates": "fp8_lightning.lightning.optimizer_callback",
    "FP8Precision": "fp8_lightning.lightning.precision",
    "FP8StatsMonitor": "fp8_lightning.lightning.callbacks",
    "RegistrationError": "fp8_lightning.lightning.registration",
    "register_ddp_strategy": "fp8_lightning.lightning.ddp",
    "register_fsdp_strategy": "fp8_lightning.lightning.fsdp",
    "register_precision_strings": "fp8_lightning.lightning.registration",
}


__getattr__, __dir__ = lazy_names(globals(), _LIGHTNING)


# Trainer(precision="fp8-hybrid"), Fabric(precision="fp8-hybrid"), Trainer(strategy="fp8_fsdp" / "fp8_ddp"):
# registered now with the Lightning packages already imported, and with the others when they are imported.
_hook.install()

__version__ = "0.1.0"

__all__ = [
    "BlockwiseScaling",
    "ConversionReport",
    "DelayedScaling",
    "DivergenceGuard",
    "FP8DDPStrategy",
    "FP8FSDPStrategy",
    "FP8FabricPrecision",
    "FP8Linear",
    "FP8Optimizer",
    "FP8OptimizerStates",
    "FP8Precision",
    "FP8RecomputeError",
    "FP8StatsMonitor",
    "Format",
    "GroupedExperts",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "NVFP4Tensor",
    "ProfitabilityGate",
    "Quantized",
    "Recipe",
    "RecipePolicy",
    "RowwiseScaling",
    "TensorwiseScaling",
    "capabilities",
    "convert_to_fp8",
    "dequantize_mxfp8",
    "dequantize_nvfp4",
    "dequantize_tensorwise",
    "fp8_autocast",
    "fp8_checkpoint_context",
    "fp8_gemm_support",
    "fp8_grouped_mm",
    "fp8_max",
    "fp8_mm",
    "fp8_modules",
    "first_last_high_precision",
    "fp8_state_dict",
    "is_fp8_enabled",
    "load_fp8_state_dict",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "quantize_tensorwise",
    "recipe_from",
    "sync_scales",
]
