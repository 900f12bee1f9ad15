"""The collectives of tensor and sequence parallelism, as autograd functions over plain (local) tensors.

Megatron's four region boundaries, with the token dimension of a sequence-parallel activation given explicitly:

* :class:`GradientAllReduce`: identity forward, gradients summed over the group (entering a colwise region with a
  replicated input, whose gradient each rank holds a part of);
* :class:`AllReduce`: outputs summed over the group (leaving a rowwise region), identity backward;
* :class:`GatherTokens` / :class:`ReduceScatterTokens`: all-gather along the tokens forward and reduce-scatter of
  the gradient backward, and the converse (entering and leaving a sequence-parallel region in high precision);
* :class:`SequenceGathered`: the FP8 form of :class:`GatherTokens`: the forward's codes and scales were gathered
  already (:func:`gather_tokens`); the gradient is reduce-scattered in high precision, as TransformerEngine does.

Ranks' token shards are concatenated along the token dimension, inside each index of the dimensions before it
(a (B, S, H) activation sharded along S gathers to (B, S * tp, H) in sequence order).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fp8_lightning.quantize import is_transposed_2d


def _comm_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a dtype every backend sends: one-byte floats (FP8 codes, E8M0 scales) as uint8."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


def all_gather_stacked(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``t`` stacked along a new first dimension, in rank order (one all-gather)."""
    local = _comm_view(t.contiguous()).reshape(-1)  # gloo takes a flat output of world x the input's numel
    world = dist.get_world_size(group)
    out = local.new_empty(world * local.numel())
    dist.all_gather_into_tensor(out, local, group=group)
    out = out.view(world, *t.shape)
    return out.view(t.dtype) if out.dtype != t.dtype else out


def gather_tokens(t: torch.Tensor, dim: int, outer: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``t`` joined along ``dim``, where ``dim`` runs over ``outer`` groups of tokens (one per index of
    the dimensions before the token dimension of the activation, e.g. the batch) and each rank holds a contiguous
    run of each group. A transposed view gathers as its rows, so the result has the layout of ``t``."""
    if t.dim() == 2 and dim == 1 and is_transposed_2d(t):
        return gather_tokens(t.t(), 0, outer, group).t()
    stacked = all_gather_stacked(t, group)  # (tp, ..., outer * run, ...)
    shape = list(t.shape)
    run = shape[dim] // outer
    grouped = stacked.reshape(stacked.shape[0], *shape[:dim], outer, run, *shape[dim + 1:])
    shape[dim] *= stacked.shape[0]
    return grouped.movedim(0, dim + 1).reshape(shape)  # (..., outer, tp, run, ...)


def reduce_scatter_tokens(t: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum over ranks of ``t``, each rank keeping its run of ``dim`` (``t``'s size along ``dim`` split evenly)."""
    world = dist.get_world_size(group)
    stacked = torch.stack(t.chunk(world, dim=dim))
    out = stacked.new_empty(stacked[0].numel())
    dist.reduce_scatter_tensor(out, stacked.reshape(-1), op=dist.ReduceOp.SUM, group=group)
    return out.view(stacked.shape[1:])


class GradientAllReduce(torch.autograd.Function):
    """Identity forward; the gradient is summed over ``group``."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


class AllReduce(torch.autograd.Function):
    """The sum over ``group`` forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherTokens(torch.autograd.Function):
    """All-gather along token dimension ``dim`` forward; reduce-scatter of the gradient backward."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return gather_tokens(x, dim, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_tokens(grad, ctx.dim, ctx.group), None, None


class ReduceScatterTokens(torch.autograd.Function):
    """Reduce-scatter along token dimension ``dim`` forward; all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return reduce_scatter_tokens(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_tokens(grad, ctx.dim, 1, ctx.group), None, None


class SequenceGathered(torch.autograd.Function):
    """The gathered activation ``values`` (made from codes gathered in FP8) as the output of this rank's ``x``:
    backward reduce-scatters the gradient along token dimension ``dim``."""

    @staticmethod
    def forward(ctx, x, values, dim, group):
        ctx.dim, ctx.group = dim, group
        return values.view_as(values)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_tokens(grad, ctx.dim, ctx.group), None, None, None
