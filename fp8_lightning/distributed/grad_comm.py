"""FP8 gradient all-reduce for DDP: ``fp8_compress_hook`` and its state ``FP8CommState``.

    ddp_model.register_comm_hook(FP8CommState(), fp8_compress_hook)
    Trainer(strategy=DDPStrategy(ddp_comm_hook=fp8_compress_hook, ddp_comm_state=FP8CommState()))

The design in full: ``docs/design/notes.md``, section ``fp8_lightning.distributed.grad_comm``.
"""

# no `from __future__ import annotations`: DDP checks the hook's annotations as objects (dist.GradBucket)

import dataclasses

import torch
import torch.distributed as dist

from fp8_lightning.distributed import grad_codec as codec
from fp8_lightning.formats import fp8_dtype

DEFAULT_GRAD_BLOCK_SIZE = 4096


def parse_block_size(block_size: int | None) -> int | None:
    """``block_size`` checked: a positive int, or None for one scale per chunk."""
    if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
        raise ValueError(
            f"block_size={block_size!r} is not a positive integer; give the number of elements that share one scale "
            f"(default {DEFAULT_GRAD_BLOCK_SIZE}) or None for one scale per chunk."
        )
    return block_size


def gradient_dtype(fp8_format: str | torch.dtype) -> torch.dtype:
    """The float8 dtype gradients travel in: ``"e4m3"`` (default, 3 mantissa bits) or ``"e5m2"`` (more range)."""
    try:
        dtype = fp8_dtype(fp8_format)
    except (ValueError, TypeError):
        dtype = None
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or str(fp8_format).upper() == "HYBRID":
        raise ValueError(f"fp8_format={fp8_format!r} is not a gradient format; use 'e4m3' or 'e5m2'.")
    return dtype


@dataclasses.dataclass
class FP8CommState:
    """Settings and the automatic factor of :func:`fp8_compress_hook` (one state per DDP model).

    Args:
        fp8_format: ``"e4m3"`` (default; blocks keep 3 mantissa bits) or ``"e5m2"``.
        block_size: elements sharing one scale (None: one scale per rank's chunk of a bucket).
        growth_interval: calls of a bucket without overflow before its factor doubles.
        max_factor: cap of the automatic factor (a power of two).
        process_group: the data-parallel group (None: the default group).
    """

    fp8_format: str = "e4m3"
    block_size: int | None = DEFAULT_GRAD_BLOCK_SIZE
    growth_interval: int = 50
    max_factor: float = 2.0**12
    process_group: dist.ProcessGroup | None = None
    factors: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict, repr=False)
    clean_calls: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict, repr=False)
    backoffs: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.dtype = gradient_dtype(self.fp8_format)
        self.block_size = parse_block_size(self.block_size)
        if int(self.growth_interval) < 1:
            raise ValueError(f"growth_interval={self.growth_interval!r} must be >= 1 (calls between doublings).")
        if self.max_factor < 1:
            raise ValueError(f"max_factor={self.max_factor!r} must be >= 1.")

    def factor(self, key: int, device: torch.device) -> torch.Tensor:
        """The current automatic factor of bucket ``key`` (a float32 scalar tensor, 1 at first)."""
        if key not in self.factors:
            self.factors[key] = torch.ones((), dtype=torch.float32, device=device)
            self.clean_calls[key] = torch.zeros((), dtype=torch.float32, device=device)
            self.backoffs[key] = torch.zeros((), dtype=torch.float32, device=device)
        return self.factors[key]

    def update(self, key: int, used: torch.Tensor) -> None:
        """After a call: ``used`` is the factor all owners could use (smaller than the state's on overflow).
        Back off to it at once; after ``growth_interval`` clean calls, double (up to ``max_factor``). No host
        synchronisation: the state stays tensors on the gradient's device."""
        factor, clean = self.factors[key], self.clean_calls[key]
        overflowed = used < factor
        clean = torch.where(overflowed, torch.zeros_like(clean), clean + 1)
        grow = clean >= self.growth_interval
        factor = torch.where(grow, (used * 2).clamp(max=self.max_factor), used)
        self.factors[key] = factor
        self.clean_calls[key] = torch.where(grow, torch.zeros_like(clean), clean)
        self.backoffs[key] = self.backoffs[key] + overflowed.float()

    @property
    def overflow_backoffs(self) -> int:
        """How many times a factor backed off, over all buckets (reads the device: for reports and tests)."""
        return int(sum(v.item() for v in self.backoffs.values()))


def agreed_blocks(flat: torch.Tensor, dtype: torch.dtype, block_size: int | None, group) -> tuple:
    """Steps 1-2 of the scheme for a flat gradient: ``(blocks, scales, nonfinite, scaled_sum)``, where
    ``scaled_sum`` is this rank's float32 sum of its chunk in scaled units (see :mod:`grad_codec`)."""
    world = dist.get_world_size(group)
    blocks = codec.to_blocks(flat, world, *codec.padded_layout(flat.numel(), world, block_size))
    agreed = codec.block_amaxes(blocks)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    amax, nonfinite = codec.split_agreed(agreed, blocks.shape[:2])
    scales = codec.grad_block_scales(amax, dtype)
    sent = codec.encode_blocks(blocks, scales, dtype)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    return blocks, scales, nonfinite, codec.sum_codes(received, dtype)


def all_gather_flat(output: torch.Tensor, input: torch.Tensor, group) -> None:
    """All-gather into a flat tensor: ``all_gather_single`` where torch has it (2.13; it deprecates
    ``all_gather_into_tensor``), else ``all_gather_into_tensor``."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input, group=group)


def fp8_all_reduce_mean(flat: torch.Tensor, state: FP8CommState, key: int = 0) -> torch.Tensor:
    """The mean over the ranks of ``flat`` (float32, same shape), moved in FP8 as the module docstring says."""
    group = state.process_group
    world = dist.get_world_size(group)
    if world == 1:
        return flat.float()
    blocks, scales, nonfinite, scaled_sum = agreed_blocks(flat, state.dtype, state.block_size, group)
    used = codec.fitting_factor(scaled_sum, world, state.factor(key, flat.device), state.dtype)
    payload = torch.cat([codec.encode_mean(scaled_sum, world, used, state.dtype).reshape(-1),
                         used.reshape(1).view(torch.uint8)])
    gathered = payload.new_empty(world * payload.numel())
    all_gather_flat(gathered, payload, group)
    gathered = gathered.view(world, payload.numel())
    used_by_owner = gathered[:, -4:].contiguous().view(torch.float32)  # [world, 1]
    codes = gathered[:, :-4].reshape(blocks.shape)
    mean = codec.decode_mean(codes, scales, used_by_owner, state.dtype)
    state.update(key, used_by_owner.min())
    return codec.from_blocks(codec.nan_where(mean, nonfinite), flat.numel()).view(flat.shape)


def fp8_compress_hook(state: FP8CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket over the ranks with FP8 on the wire (see the module docstring).

    Register with ``ddp_model.register_comm_hook(FP8CommState(), fp8_compress_hook)``."""
    if not isinstance(state, FP8CommState):
        raise TypeError(
            f"fp8_compress_hook needs an FP8CommState as its state, got {type(state).__name__}; register it with "
            "register_comm_hook(FP8CommState(), fp8_compress_hook) (Lightning: DDPStrategy(ddp_comm_state=...))."
        )
    buffer = bucket.buffer()
    buffer.copy_(fp8_all_reduce_mean(buffer, state, bucket.index()))
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future
