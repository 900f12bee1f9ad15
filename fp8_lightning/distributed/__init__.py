"""FSDP2 support: FP8 parameter all-gather (tensor subclasses with FSDP2's extension hooks), the coalesced
whole-weight amax reduction, and the helpers that prepare and shard an FP8 model. No Lightning imports."""

from fp8_lightning.distributed.amax import WeightAmaxSync
from fp8_lightning.distributed.sharding import (
    AllGatherReport,
    apply_activation_checkpointing,
    default_shard_targets,
    disable_fp8_all_gather,
    enable_fp8_all_gather,
    fp8_checkpoint_context,
    is_sharded,
    shard_model,
    weight_amax_reductions,
)
from fp8_lightning.distributed.weight import FP8GatheredWeight, FP8ShardedWeight, fp8_all_gather_unsupported_reason

__all__ = [
    "AllGatherReport",
    "FP8GatheredWeight",
    "FP8ShardedWeight",
    "WeightAmaxSync",
    "apply_activation_checkpointing",
    "default_shard_targets",
    "disable_fp8_all_gather",
    "enable_fp8_all_gather",
    "fp8_all_gather_unsupported_reason",
    "fp8_checkpoint_context",
    "is_sharded",
    "shard_model",
    "weight_amax_reductions",
]
