"""The same plugins for the standalone ``pytorch_lightning`` and ``lightning_fabric`` packages.

Those packages ship their own copies of Lightning's classes, so a plugin must subclass *their* ``Precision``.
The classes keep the names ``FP8Precision`` / ``FP8FabricPrecision`` (checkpoints store the plugin state under
the class name, so checkpoints interchange between the two packages). Import this module only where the
packages are installed; :mod:`.registration` does so when it finds them.
"""

from __future__ import annotations

from fp8_lightning.lightning.fabric import FP8FabricHooks
from fp8_lightning.lightning.precision import FP8TrainerHooks

try:
    from pytorch_lightning.plugins.precision import Precision as _PLPrecision
except ImportError:  # pragma: no cover - the package is optional
    _PLPrecision = None

try:
    from lightning_fabric.plugins.precision import Precision as _LFPrecision
except ImportError:  # pragma: no cover - the package is optional
    _LFPrecision = None

if _PLPrecision is not None:

    class FP8Precision(FP8TrainerHooks, _PLPrecision):
        """:class:`fp8_lightning.lightning.precision.FP8Precision` for ``pytorch_lightning.Trainer``."""

else:  # pragma: no cover
    FP8Precision = None

if _LFPrecision is not None:

    class FP8FabricPrecision(FP8FabricHooks, _LFPrecision):
        """:class:`fp8_lightning.lightning.fabric.FP8FabricPrecision` for ``lightning_fabric.Fabric``."""

else:  # pragma: no cover
    FP8FabricPrecision = None
