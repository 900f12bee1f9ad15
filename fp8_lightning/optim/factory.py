"""``fp8_adamw``: build AdamW with FP8 states in one call (a Hydra ``_partial_`` target).

``conf/optimizer/fp8_adamw.yaml`` points at this function with ``_partial_: true``; the training entry point
then calls the partial with the model's parameters, exactly like ``torch.optim.AdamW``.
"""

from __future__ import annotations

from typing import Any

import torch

from fp8_lightning.optim.optimizer import FP8Optimizer

_FP8_OPTIONS = ("exp_avg", "exp_avg_sq", "master_weights", "min_quantize_numel", "use_triton", "block_size")


def fp8_adamw(params: Any, lr: float = 1e-3, preset: Any = "default", **kwargs: Any) -> FP8Optimizer:
    """``FP8Optimizer(torch.optim.AdamW(params, lr=lr, **adamw_kwargs), preset, **fp8_options)``.

    ``kwargs`` may mix AdamW arguments (``betas``, ``eps``, ``weight_decay``, ...) and FP8 options
    (``exp_avg``, ``exp_avg_sq``, ``master_weights``, ``min_quantize_numel``, ``use_triton``, ``block_size``).
    """
    fp8_options = {key: kwargs.pop(key) for key in _FP8_OPTIONS if key in kwargs}
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])  # a ListConfig from YAML
    return FP8Optimizer(torch.optim.AdamW(params, lr=lr, **kwargs), preset, **fp8_options)
