"""FP8 gradient reduce-scatter for FSDP2: ``FP8ReduceScatter``, a ``set_custom_reduce_scatter`` communication.

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(FP8ReduceScatter())

FSDP2 reduces each parameter group's gradients with one reduce-scatter of a flat buffer whose chunk ``r`` is the
shard of rank ``r``. This one moves that buffer in FP8 (the first two steps of
:mod:`fp8_lightning.distributed.grad_comm`): one MAX all-reduce agrees a scale per block, an all-to-all sends
each chunk's FP8 codes (``uint8``) to its owner, and the owner sums them in float32 and divides by the world size.
No FP8 result travels back (the shard is the result), so there is no automatic factor here. Wire bytes per rank:
``(w-1)/w * n`` plus ``2(w-1)/w * 8`` per block of scales, against ``(w-1)/w * 2n`` for a bf16 reduce-scatter
(``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``) and ``(w-1)/w * 4n`` for float32. A block that held NaN
or inf on any rank comes back NaN. The input may be float32 or bf16 (``reduce_dtype``); the sum is float32.

The seam (``FSDPModule.set_custom_reduce_scatter`` and ``torch.distributed.fsdp._fully_shard._fsdp_api.
ReduceScatter``) exists in torch 2.9 and later; :func:`fp8_reduce_scatter_unsupported_reason` says why not where
it is missing. It supports 1-D FSDP (one shard group); with HSDP the replica all-reduce that follows stays in
``reduce_dtype``.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from fp8_lightning.distributed import grad_codec as codec
from fp8_lightning.distributed.grad_comm import DEFAULT_GRAD_BLOCK_SIZE, agreed_blocks, gradient_dtype, parse_block_size


def fp8_reduce_scatter_unsupported_reason() -> str | None:
    """Why this torch cannot take a custom FSDP2 reduce-scatter (None when it can)."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter  # noqa: F401
    except ImportError as error:
        return f"torch {torch.__version__} has no FSDP2 custom reduce-scatter API ({error}); torch >= 2.9 has it"
    if not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        return f"torch {torch.__version__} has no FSDPModule.set_custom_reduce_scatter; torch >= 2.9 has it"
    return None


def _reduce_scatter_base() -> type:
    reason = fp8_reduce_scatter_unsupported_reason()
    if reason is not None:
        return object
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    return ReduceScatter


def divisor_of(op, world: int) -> float:
    """What FSDP2's reduce op asks the sum to be divided by: AVG -> world, SUM -> 1, PREMUL_SUM(f) -> 1 / f."""
    kind = getattr(op, "op", op)
    if kind == dist.ReduceOp.AVG:
        return float(world)
    if kind == dist.ReduceOp.SUM:
        return 1.0
    factor = getattr(op, "factor", None)
    if kind == dist.ReduceOp.PREMUL_SUM and isinstance(factor, float) and factor != 0:
        return 1.0 / factor
    raise ValueError(f"FP8ReduceScatter supports the reduce ops AVG, SUM and PREMUL_SUM(factor), got {op!r}.")


class FP8ReduceScatter(_reduce_scatter_base()):
    """FSDP2 gradient reduce-scatter with FP8 codes on the wire and a float32 sum (see the module docstring).

    Args:
        fp8_format: ``"e4m3"`` (default) or ``"e5m2"``.
        block_size: elements sharing one agreed scale (None: one scale per rank's chunk).
    """

    def __init__(self, fp8_format: str = "e4m3", block_size: int | None = DEFAULT_GRAD_BLOCK_SIZE) -> None:
        reason = fp8_reduce_scatter_unsupported_reason()
        if reason is not None:
            raise RuntimeError(f"FP8ReduceScatter cannot be used: {reason}. Upgrade torch, or leave it off.")
        self.dtype = gradient_dtype(fp8_format)
        self.block_size = parse_block_size(block_size)

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, op, async_op=False
    ) -> None:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if input_tensor.numel() != world * output_tensor.numel():
            raise ValueError(
                f"FP8ReduceScatter: input of {input_tensor.numel()} elements is not {world} x the output's "
                f"{output_tensor.numel()}."
            )
        divisor = divisor_of(op, world)
        _, scales, nonfinite, scaled_sum = agreed_blocks(input_tensor, self.dtype, self.block_size, group)
        mean = scaled_sum / scales[rank].unsqueeze(-1) / divisor
        mine = codec.nan_where(mean, nonfinite[rank]).reshape(-1)[: output_tensor.numel()]
        output_tensor.copy_(mine.view(output_tensor.shape))
        return None  # the collectives above ran synchronously (in the stream FSDP2 made current)

    def __repr__(self) -> str:
        return f"FP8ReduceScatter(dtype={self.dtype}, block_size={self.block_size})"


def enable_fp8_reduce_scatter(
    module: torch.nn.Module, fp8_format: str = "e4m3", block_size: int | None = DEFAULT_GRAD_BLOCK_SIZE
) -> int:
    """Give every FSDP2 module under ``module`` (itself included) an :class:`FP8ReduceScatter`; returns how many.

    Call it after ``fully_shard``. Raises when torch lacks the seam or when nothing under ``module`` is sharded."""
    reason = fp8_reduce_scatter_unsupported_reason()
    if reason is not None:
        raise RuntimeError(f"FP8 gradient reduce-scatter is not available: {reason}.")
    from torch.distributed.fsdp import FSDPModule

    comm = FP8ReduceScatter(fp8_format, block_size)
    sharded = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not sharded:
        raise ValueError(
            f"enable_fp8_reduce_scatter found no FSDP2 module under {type(module).__name__}; call fully_shard first."
        )
    for m in sharded:
        m.set_custom_reduce_scatter(comm)
    return len(sharded)
