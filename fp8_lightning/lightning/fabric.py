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
from typing_extensions import override

from fp8_lightning.lightning.plugin_base import FP8PrecisionMixin


class FP8FabricHooks(FP8PrecisionMixin):
    """The Fabric-specific hooks, independent of which package provides the ``Precision`` base."""

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        self.fp8_before_optimizer_step(optimizer)
        output = super().optimizer_step(optimizer, **kwargs)
        self.fp8_after_optimizer_step()
        return output

    def __repr__(self) -> str:
        return f"{type(self).__name__}(precision={self.precision!r}, recipe={self.recipe!r})"


class FP8FabricPrecision(FP8FabricHooks, Precision):
    """FP8 training with ``lightning.fabric.Fabric``; same arguments as
    :class:`~fp8_lightning.lightning.precision.FP8Precision`."""
