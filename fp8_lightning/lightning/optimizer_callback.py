"""``FP8OptimizerStates``: give any LightningModule FP8 optimizer states without touching the module.

The module's ``configure_optimizers`` keeps returning ``torch.optim.AdamW(...)``. Adding the callback to the
trainer (``Trainer(callbacks=[FP8OptimizerStates(preset="default")])``)
wraps every supported optimizer the strategy built in an :class:`~fp8_lightning.optim.FP8Optimizer`. From the
Hydra command line: ``+callbacks.fp8_optimizer._target_=fp8_lightning.lightning.optimizer_callback.FP8OptimizerStates``
(or pick ``optimizer=fp8_adamw``, which builds the wrapper directly).

When: ``on_fit_start``. In Lightning 2.6 the trainer builds the optimizers in ``strategy.setup`` (after DDP or
FSDP2 has wrapped or sharded the model, so sharded parameters are already DTensors), then calls
``on_fit_start``, and only then restores optimizer states from a checkpoint: wrapping there means a resumed run
loads the FP8 states saved by the wrapper, exactly.

Learning-rate schedulers built in ``configure_optimizers`` hold the inner optimizer; they keep working because the
wrapper shares its ``param_groups``. Unsupported optimizers are left alone with a warning (or refused with
``strict=True``), so adding the callback never breaks a run that it cannot help.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from fp8_lightning.lightning.plugin_base import strict_bool
from fp8_lightning.optim import FP8Optimizer, config_from


class FP8OptimizerStates(Callback):
    """Wrap the trainer's optimizers in :class:`FP8Optimizer` at fit start.

    Args:
        preset: ``"default"``, ``"max_savings"`` or ``"fp32"`` (see ``fp8_lightning.optim.config``).
        strict: refuse (``TypeError``) instead of warning when an optimizer cannot be wrapped.
        release_gradients: step each parameter during backward and free its gradient at once
            (:meth:`FP8Optimizer.release_gradients_in_backward`): single process, no gradient clipping, no
            gradient accumulation; refused otherwise.
        **options: overrides of the preset (``block_size``, ``master_weights``, ``exp_avg_sq``, ...).
    """

    def __init__(self, preset: str = "default", strict: bool = False, release_gradients: bool = False,
                 **options: Any) -> None:
        self.config = config_from(preset, **options)  # fail at construction on a bad option, not mid-fit
        self.strict = strict_bool(strict, type(self).__name__, "strict")
        self.release_gradients = strict_bool(release_gradients, type(self).__name__, "release_gradients")

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        trainer.strategy.optimizers = [self._wrap(opt) for opt in trainer.strategy.optimizers]
        if self.release_gradients:
            check_release_gradients(trainer)
            for optimizer in trainer.strategy.optimizers:
                if isinstance(optimizer, FP8Optimizer):
                    optimizer.release_gradients_in_backward()

    def _wrap(self, optimizer: Any) -> Any:
        if isinstance(optimizer, FP8Optimizer):
            return optimizer
        try:
            return FP8Optimizer(optimizer, self.config)
        except (TypeError, ValueError) as error:
            if self.strict:
                raise
            rank_zero_warn(f"FP8OptimizerStates left {type(optimizer).__name__} in full precision: {error}")
            return optimizer

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict()}


def check_release_gradients(trainer: "pl.Trainer") -> None:
    """Refuse settings that need every gradient before the step (see ``release_gradients``)."""
    problems = []
    if trainer.world_size > 1:
        problems.append(f"world_size={trainer.world_size} (gradients are reduced across ranks after backward)")
    if trainer.accumulate_grad_batches != 1:
        problems.append(f"accumulate_grad_batches={trainer.accumulate_grad_batches}")
    if trainer.gradient_clip_val:
        problems.append(f"gradient_clip_val={trainer.gradient_clip_val}")
    if problems:
        raise ValueError(
            "FP8OptimizerStates(release_gradients=True) steps each parameter during backward, which cannot work "
            f"with {', '.join(problems)}. Remove those settings or use release_gradients=False."
        )
