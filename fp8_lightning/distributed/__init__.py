"""Distributed FP8: tensor and sequence parallel styles; FSDP2's FP8 parameter all-gather (tensor subclasses with
FSDP2's extension hooks), the coalesced whole-weight amax reduction, and the helpers that prepare and shard an FP8
model; FP8 gradient communication (a DDP communication hook and an FSDP2 reduce-scatter). No Lightning imports."""

from fp8_lightning.distributed.amax import WeightAmaxSync
from fp8_lightning.distributed.expert_weight import (
    FP8GatheredExperts,
    FP8ShardedExperts,
    experts_gather_unsupported_reason,
)
from fp8_lightning.distributed.grad_comm import FP8CommState, fp8_all_reduce_mean, fp8_compress_hook
from fp8_lightning.distributed.reduce_scatter import (
    FP8ReduceScatter,
    enable_fp8_reduce_scatter,
    fp8_reduce_scatter_unsupported_reason,
)
from fp8_lightning.distributed.sharding import (
    AllGatherReport,
    apply_activation_checkpointing,
    default_shard_targets,
    disable_fp8_all_gather,
    enable_fp8_all_gather,
    is_sharded,
    shard_model,
    weight_amax_reductions,
)
from fp8_lightning.distributed.tensor_parallel import (
    FP8ColwiseParallel,
    FP8RowwiseParallel,
    PrepareFP8ModuleInput,
    gather_sequence,
)
from fp8_lightning.recompute import fp8_checkpoint_context
from fp8_lightning.distributed.weight import FP8GatheredWeight, FP8ShardedWeight, fp8_all_gather_unsupported_reason

__all__ = [
    "AllGatherReport",
    "FP8ColwiseParallel",
    "FP8CommState",
    "FP8ReduceScatter",
    "FP8RowwiseParallel",
    "PrepareFP8ModuleInput",
    "FP8GatheredExperts",
    "FP8GatheredWeight",
    "FP8ShardedExperts",
    "FP8ShardedWeight",
    "WeightAmaxSync",
    "apply_activation_checkpointing",
    "default_shard_targets",
    "disable_fp8_all_gather",
    "enable_fp8_all_gather",
    "enable_fp8_reduce_scatter",
    "experts_gather_unsupported_reason",
    "fp8_all_gather_unsupported_reason",
    "fp8_all_reduce_mean",
    "fp8_compress_hook",
    "fp8_reduce_scatter_unsupported_reason",
    "fp8_checkpoint_context",
    "gather_sequence",
    "is_sharded",
    "shard_model",
    "weight_amax_reductions",
]
