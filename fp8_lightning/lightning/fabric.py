"""``FP8FabricPrecision``: the Fabric counterpart of :class:`~fp8_lightning.lightning.precision.FP8Precision`.

    fabric = Fabric(precision="fp8-hybrid")                       # after `import fp8_lightning`
    fabric = Fabric(plugins=[FP8FabricPrecision(recipe="mxfp8")])
    model, optimizer = fabric.setup(model, optimizer)             # converts nn.Linear layers in place

Fabric has no closure: the divergence guard runs when ``optimizer.step()`` is called (the backward is done, the
weights are not updated yet) and the amax reduction and scale update right after it. Fabric checkpoints only
what is put in the state dict, so include the plugin::

    fabric.save(path, {"model": model, "optimizer": optimizer, "fp8": fabric.strategy.precision})
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.plugins.precision import Precision
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from fp8_lightning.lightning.plugin_base import FP8PrecisionMixin


class FP8FabricHooks(FP8PrecisionMixin):
    """The Fabric-specific hooks, independent of which package provides the ``Precision`` base."""

    _resume_checked = False

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if not self._resume_checked:
            self._resume_checked = True
            warn_if_resumed_without_fp8_state(self, optimizer)
        self.fp8_before_optimizer_step(optimizer)
        output = super().optimizer_step(optimizer, **kwargs)
        self.fp8_after_optimizer_step()
        return output

    def __repr__(self) -> str:
        return f"{type(self).__name__}(precision={self.precision!r}, recipe={self.recipe!r})"


def warn_if_resumed_without_fp8_state(plugin: FP8PrecisionMixin, optimizer: Any) -> bool:
    """Warn (once per plugin, at its first optimizer step) when the program resumed from a checkpoint without the
    FP8 state: the optimizer already holds state (it was loaded: torch optimizers create it at their first step),
    yet this plugin has taken no step and loaded no state, and it has state that a resumed run needs
    (:meth:`~fp8_lightning.lightning.plugin_base.FP8PrecisionMixin.carries_state`: not for MXFP8, rowwise or
    blockwise layers without a divergence guard). Returns whether it warned."""
    resumed = any(bool(state) for state in getattr(optimizer, "state", {}).values())
    if not resumed or plugin.optimizer_steps or plugin._loaded_fp8_state or not plugin.carries_state():
        return False
    rank_zero_warn(
        "The optimizer state was restored from a checkpoint, but the FP8 scaling state was not: amax histories, "
        "scales and divergence-guard decisions restart from scratch, so the resumed run can differ from an "
        "uninterrupted one. Save and load the precision plugin with the rest of the state: fabric.save(path, "
        "{..., 'fp8': fabric.strategy.precision}) and fabric.load(path, {..., 'fp8': fabric.strategy.precision})."
    )
    return True


class FP8FabricPrecision(FP8FabricHooks, Precision):
    """FP8 training with ``lightning.fabric.Fabric``; same arguments as
    :class:`~fp8_lightning.lightning.precision.FP8Precision`."""
