"""The update rules, on float32 tensors, written to match ``torch.optim`` operation for operation.

The FP8 optimizer decodes one parameter's states to float32, calls one of these functions, and encodes the
results again; the functions themselves know nothing about storage formats. They follow the single-tensor
(``foreach=False``) code paths of ``torch.optim.Adam``/``AdamW``/``SGD`` in the same order of floating-point
operations, so that with float32 storage the wrapper reproduces ``torch.optim`` bit for bit (a test checks this).

``adam_update`` covers Adam (L2 weight decay added to the gradient) and AdamW (decoupled decay applied to the
weight), ``maximize``; ``sgd_update`` covers SGD with momentum, dampening, Nesterov, weight decay, ``maximize``.
"""

from __future__ import annotations

import math

import torch


def adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool = False,
) -> None:
    """One Adam/AdamW step in place on float32 ``param``, ``exp_avg``, ``exp_avg_sq`` (``step`` counts from 1)."""
    if maximize:
        grad = -grad
    if weight_decay != 0:
        if decoupled_weight_decay:
            param.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = math.sqrt(bias_correction2)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def sgd_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor | None,
    *,
    lr: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    weight_decay: float,
    maximize: bool = False,
) -> torch.Tensor | None:
    """One SGD step in place on float32 ``param``; returns the new momentum buffer (None without momentum).

    ``momentum_buffer`` is None on the first step (the buffer then starts as a copy of the gradient, as in
    ``torch.optim.SGD``).
    """
    if maximize:
        grad = -grad
    if weight_decay != 0:
        grad = grad.add(param, alpha=weight_decay)
    if momentum != 0:
        if momentum_buffer is None:
            momentum_buffer = torch.clone(grad).detach()
        else:
            momentum_buffer.mul_(momentum).add_(grad, alpha=1 - dampening)
        grad = grad.add(momentum_buffer, alpha=momentum) if nesterov else momentum_buffer
    param.add_(grad, alpha=-lr)
    return momentum_buffer
