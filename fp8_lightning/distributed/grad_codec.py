"""The arithmetic of FP8 gradient communication: blocks, agreed scales, the float32 sum and the split of 1/N.

A flat gradient of ``n`` elements is reduced by ``world`` ranks. It is padded and laid out as
``[world, blocks, block_size]``: row ``r`` is the chunk rank ``r`` owns (reduces), and every block of it has one
scale. The functions here are pure tensor math (no communication) so they can be checked against float64:

* :func:`block_amaxes` — each rank's per-block max |g|, with non-finite blocks flagged instead of poisoning it;
  ranks then agree (all-reduce MAX) so that every rank encodes a block with the *same* scale,
  ``fp8_max / amax`` (:func:`grad_block_scales`), which never overflows;
* :func:`encode_blocks` / :func:`sum_codes` — FP8 codes on the sending side, their float32 sum on the owner. The sum
  stays in *scaled* units (``sum_i g_i * scale``, at most ``world * fp8_max``): it is never formed in FP8;
* :func:`fitting_factor` and :func:`encode_mean` — FP8-LM's split of the 1/N of the mean when the owner sends the
  reduced block back in FP8: ``factor / N`` is applied before the encode, ``1 / factor`` after the decode. A large
  factor keeps a mean that cancelled out of the subnormals; too large a one would overflow, so the factor backs
  off (halves) as far as the block needs, and grows again slowly (:class:`~fp8_lightning.distributed.grad_comm.
  FP8CommState`);
* :func:`nan_where` — a block that held NaN or inf on any rank comes back NaN, so non-finite gradients are
  never hidden by the saturating cast.
"""

from __future__ import annotations

import torch

from fp8_lightning.ops.dispatch import fast_fp8_to_float32, fast_to_fp8_saturated
from fp8_lightning.formats import fp8_max
from fp8_lightning.quantize import max_over_amax


def padded_layout(numel: int, world: int, block_size: int | None) -> tuple[int, int]:
    """``(blocks per chunk, block size)`` of a flat tensor of ``numel`` elements split over ``world`` ranks.

    ``block_size=None`` gives one block (one scale) per chunk."""
    chunk = -(-numel // world)
    if block_size is None:
        return 1, max(chunk, 1)
    return max(-(-chunk // block_size), 1), block_size


def to_blocks(flat: torch.Tensor, world: int, blocks: int, block_size: int) -> torch.Tensor:
    """``flat`` in float32 as ``[world, blocks, block_size]``: row ``r`` starts with chunk ``r`` of ``flat``
    (``ceil(n / world)`` elements, what rank ``r`` owns), zero-padded to whole blocks."""
    chunk = -(-flat.numel() // world)
    rows = flat.new_zeros(world * chunk, dtype=torch.float32)
    rows[: flat.numel()] = flat.reshape(-1)
    out = flat.new_zeros(world, blocks * block_size, dtype=torch.float32)
    out[:, :chunk] = rows.view(world, chunk)
    return out.view(world, blocks, block_size)


def from_blocks(values: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`to_blocks`: the first ``numel`` elements of ``[world, blocks, block_size]`` chunks."""
    world = values.shape[0]
    chunk = -(-numel // world)
    return values.reshape(world, -1)[:, :chunk].reshape(-1)[:numel]


def block_amaxes(blocks: torch.Tensor) -> torch.Tensor:
    """Per-block ``max |x|`` over finite blocks, then a 1 for each non-finite block: one vector of ``2 * count``
    float32 values for an all-reduce with MAX (NaN never enters the collective; the flag carries it)."""
    amax = blocks.abs().amax(dim=-1)
    nonfinite = ~torch.isfinite(amax)
    return torch.cat([amax.masked_fill(nonfinite, 0.0).reshape(-1), nonfinite.float().reshape(-1)])


def split_agreed(agreed: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """The agreed ``(amax, non-finite mask)`` of each block, from the MAX-reduced :func:`block_amaxes` vector."""
    amax, flags = agreed.chunk(2)
    return amax.view(shape), flags.view(shape) > 0


def grad_block_scales(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``fp8_max / amax`` per block (float32, capped at float32 max: an all-zero block gets a finite scale)."""
    return max_over_amax(fp8_max(dtype), amax)


def encode_blocks(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturated FP8 codes of ``blocks * scale`` as ``uint8`` (what gloo and NCCL can move)."""
    return fast_to_fp8_saturated(blocks * scales.unsqueeze(-1), dtype).view(torch.uint8)


def _decode(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float32 values of ``uint8`` FP8 codes (still in scaled units)."""
    return fast_fp8_to_float32(codes.view(dtype))


def sum_codes(received: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float32 sum over the senders (dim 0) of received codes ``[world, blocks, block_size]``, in scaled units."""
    return _decode(received, dtype).sum(dim=0)


def fitting_factor(scaled_sum: torch.Tensor, world: int, factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The largest power of two ``<= factor`` with which ``scaled_sum * factor / world`` stays within ``fp8_max``.

    ``factor`` is a power of two >= 1; since ``|scaled_sum| <= world * fp8_max``, a factor of 1 always fits."""
    peak = scaled_sum.abs().amax().float()
    room = fp8_max(dtype) * world / peak.clamp(min=torch.finfo(torch.float32).tiny)
    _, exponent = torch.frexp(room)  # room = mantissa * 2**exponent, mantissa in [0.5, 1)
    fits = torch.ldexp(torch.ones_like(room), exponent - 1)
    return torch.minimum(factor, fits.clamp(min=1.0))


def encode_mean(scaled_sum: torch.Tensor, world: int, factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 codes of the mean with ``factor / world`` applied before the cast (its ``1 / factor`` comes after)."""
    return fast_to_fp8_saturated(scaled_sum * (factor / world), dtype).view(torch.uint8)


def decode_mean(codes: torch.Tensor, scales: torch.Tensor, factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float32 mean from :func:`encode_mean` codes: divided by the agreed block scale times the factor."""
    return _decode(codes, dtype) / factor.unsqueeze(-1) / scales.unsqueeze(-1)  # two divisions: no overflow


def nan_where(values: torch.Tensor, nonfinite: torch.Tensor) -> torch.Tensor:
    """``values`` with every block that held NaN or inf on some rank set to NaN."""
    return values.masked_fill(nonfinite.unsqueeze(-1), float("nan"))
