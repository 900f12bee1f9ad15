"""``FP8Precision``: the ``lightning.pytorch`` precision plugin that trains a LightningModule in FP8.

    trainer = Trainer(precision="fp8-hybrid")                       # after `import fp8_lightning`
    trainer = Trainer(plugins=[FP8Precision(recipe="tensorwise")])  # no registration needed (LightningCLI too)

Each hook is a few lines; the shared behaviour is in :mod:`fp8_lightning.lightning.plugin_base` and the
numerics in the core. The optimizer step is where the once-per-step work happens: the divergence guard runs
right after the closure (forward and backward of the last micro-batch) and before the weights change, and the
amax reduction and scale update run once after the step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from lightning.pytorch.plugins.precision import Precision
from typing_extensions import override

from fp8_lightning.guard import DivergenceGuard, GuardEvent
from fp8_lightning.lightning.plugin_base import FP8PrecisionMixin, ModuleFilter
from fp8_lightning.capability_table import warn_if_not_native
from fp8_lightning.convert import scaled_modules
from fp8_lightning.policy import LayersLike
from fp8_lightning.profitability import (
    ProfitabilityGate, ProfitabilityLike, profitability_default, profitability_setting, resolve_gate,
)
from fp8_lightning.recipes import RecipeLike
from fp8_lightning.settings import settings


class FP8TrainerHooks(FP8PrecisionMixin):
    """The Trainer-specific hooks, independent of which Lightning package provides the ``Precision`` base."""

    def __init__(
        self,
        recipe: RecipeLike = None,
        module_filter_fn: ModuleFilter | None = None,
        dtype: torch.dtype | str | None = None,
        replace_layers: bool = True,
        emulate: bool = False,
        divergence_guard: DivergenceGuard | bool | dict | None = None,
        profitability: ProfitabilityLike = "auto",
        layers: LayersLike = None,
    ) -> None:
        super().__init__(recipe, module_filter_fn, dtype, replace_layers, emulate, divergence_guard, layers)
        resolve_gate(profitability)  # fail fast on an invalid value
        self.profitability = profitability

    @override
    def convert_module(self, module: Any) -> Any:
        trainer = getattr(module, "_trainer", None)
        device = getattr(getattr(trainer, "strategy", None), "root_device", None)
        with profitability_setting(trainer_gate(self.profitability, trainer) or False):
            module = super().convert_module(module)
        if device is not None:  # each recipe the layer policy gave, also when the gate is off (profitability=False)
            for recipe in dict.fromkeys(layer.fp8_recipe for _, layer in scaled_modules(module)):
                warn_if_not_native(recipe, device)
        return module

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        def closure_then_guard() -> Any:
            result = closure()
            log_guard_events(model, self.fp8_before_optimizer_step(optimizer))
            return result

        output = super().optimizer_step(optimizer, model, closure_then_guard, **kwargs)
        self.fp8_after_optimizer_step()
        return output

    def __repr__(self) -> str:
        return f"{type(self).__name__}(precision={self.precision!r}, recipe={self.recipe!r})"


def trainer_gate(profitability: ProfitabilityLike, trainer: Any) -> ProfitabilityGate | None:
    """The gate of a Trainer's conversion: for the device the Trainer will train on (Lightning converts before it
    moves the model) and, unless ``profitability`` is a gate the user built, for its ``accumulate_grad_batches``
    micro-batches per optimizer step where they share each weight's cast: on a CPU, or on a GPU with
    ``FP8_LIGHTNING_WEIGHT_CHECKSUM=0`` (by default a GPU casts again at each micro-batch, see
    :class:`~fp8_lightning.layer_scaling.LayerScaling`)."""
    chosen = profitability_default() if profitability is None else profitability
    device = getattr(getattr(trainer, "strategy", None), "root_device", None)
    gate = resolve_gate(chosen, device)
    accumulate = getattr(trainer, "accumulate_grad_batches", 1)  # a GradientAccumulationScheduler's: 1 here
    shared = getattr(device, "type", None) == "cpu" or not settings().weight_checksum
    if gate is None or isinstance(chosen, ProfitabilityGate) or type(accumulate) is not int or not shared:
        return gate
    return dataclasses.replace(gate, microbatches=max(accumulate, 1))


def log_guard_events(model: Any, events: list[GuardEvent]) -> None:
    """Send fallback events to the Trainer's loggers (``fp8_guard/<layer>`` = 1 at the step it happened)."""
    trainer = getattr(model, "_trainer", None)
    if not events or trainer is None:
        return
    metrics = {f"fp8_guard/{e.layer}": 1.0 for e in events}
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)


class FP8Precision(FP8TrainerHooks, Precision):
    """Train the model's ``nn.Linear`` layers and fused experts in FP8 (``lightning.pytorch`` precision plugin).

    Args:
        recipe: scaling recipe: a :class:`~fp8_lightning.recipes.Recipe`, a name (``"delayed"``,
            ``"tensorwise"``, ``"mxfp8"``) or a dict with a ``name`` key (YAML); ``DelayedScaling()`` by default.
        module_filter_fn: ``fn(module, name) -> bool``; layers for which it returns False stay high precision.
        dtype: dtype of the non-FP8 parts: ``None`` gives bf16 autocast on CUDA and float32 on CPU.
        replace_layers: convert ``nn.Linear`` layers (False: use the layers the model converted itself).
        emulate: allow FP8 numerics emulated in float32 on CUDA devices without FP8 tensor cores.
        divergence_guard: ``True``, a :class:`~fp8_lightning.guard.DivergenceGuard` or a dict of its fields to
            let troubled layers fall back to high precision.
        profitability: keep layers too small to gain from FP8 in high precision (see
            :mod:`fp8_lightning.profitability`): ``"auto"`` gates on CUDA and converts everything on CPU; True,
            False or a ``ProfitabilityGate(tokens=...)``.
        layers: the per-layer recipe policy (:mod:`fp8_lightning.policy`), for linear layers and fused experts
            modules alike: name patterns, first/last blocks or a callable -> a recipe or None (high precision).

    After the model is set up, ``conversion_report`` lists converted and skipped layers and experts (with the reasons).
    """
