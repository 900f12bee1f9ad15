"""Learning-rate schedules that Hydra configs can pick as partials (``scheduler(optimizer=...)``).

Linear warm-up followed by cosine decay to ``min_lr_ratio * lr`` is the usual GPT schedule; it is written as a
pure function of the step (:func:`warmup_cosine_factor`) so that it can be checked against the formula, and wrapped
in a :class:`~torch.optim.lr_scheduler.LambdaLR` stepped once per optimizer step.
"""

from __future__ import annotations

import functools
import math

import torch


def warmup_cosine_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the base learning rate at optimizer step ``step`` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr_ratio
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(
    optimizer: torch.optim.Optimizer, warmup_steps: int = 0, total_steps: int = 1000, min_lr_ratio: float = 0.1
) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` with linear warm-up over ``warmup_steps`` and cosine decay until ``total_steps``."""
    if warmup_steps < 0 or total_steps < 1 or not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(
            f"warmup_cosine got warmup_steps={warmup_steps}, total_steps={total_steps}, "
            f"min_lr_ratio={min_lr_ratio}; need warmup_steps >= 0, total_steps >= 1 and 0 <= min_lr_ratio <= 1 "
            "(set scheduler.total_steps to trainer.max_steps)."
        )
    factor = functools.partial(
        warmup_cosine_factor, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
