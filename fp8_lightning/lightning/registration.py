"""Make ``Trainer(precision="fp8-hybrid")`` and ``Fabric(precision="fp8-hybrid")`` work.

Lightning validates ``precision=`` against fixed ``Literal`` lists and has no precision registry, so the least
invasive hook is the constructor of its accelerator connector (``_AcceleratorConnector`` for the Trainer,
``_Connector`` for Fabric), wrapped once when ``fp8_lightning`` is imported:

* a known FP8 string becomes the matching plugin, handed over through ``plugins=`` (and ``precision=None``),
  so Lightning's own code path for a user-supplied plugin does the rest and ``trainer.precision`` reports the
  string; every other value goes to Lightning untouched;
* an unknown ``"fp8..."`` string raises an error that lists the valid ones;
* a string together with a precision plugin in ``plugins=`` or carried by the strategy is reported (or, when the
  strategy already carries the very same FP8 precision, accepted);
* combinations that cannot work fail early with what to use instead: FSDP1 (``FSDPStrategy``) and DeepSpeed
  with FP8, and a CUDA device without FP8 support (the core's ``check_device`` message). These checks also
  cover ``plugins=[FP8Precision(...)]``, the documented route that needs no registration.

The wrapping is idempotent and covers ``lightning.pytorch``, ``lightning.fabric`` and, where installed, the
standalone ``pytorch_lightning`` and ``lightning_fabric`` packages.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from typing import Any, Callable

import torch

from fp8_lightning.gemm import check_device
from fp8_lightning.lightning.plugin_base import FP8PrecisionMixin
from fp8_lightning.lightning.strings import is_fp8_precision, recipe_for_precision

_MARK = "_fp8_lightning_wrapped"


@dataclasses.dataclass(frozen=True)
class _Family:
    """One Lightning package's connector and the classes the checks need."""

    connector: str  # "module:Class"
    plugin: str  # "module:Class" of the FP8 plugin for this package
    precision_base: str
    refused: tuple[str, ...]  # strategies that cannot run the FP8 plugin
    result_attr: str  # where the connector stores the final precision plugin


_FAMILIES = (
    _Family(
        "lightning.pytorch.trainer.connectors.accelerator_connector:_AcceleratorConnector",
        "fp8_lightning.lightning.precision:FP8Precision",
        "lightning.pytorch.plugins.precision:Precision",
        ("lightning.pytorch.strategies:FSDPStrategy", "lightning.pytorch.strategies:DeepSpeedStrategy"),
        "precision_plugin",
    ),
    _Family(
        "lightning.fabric.connector:_Connector",
        "fp8_lightning.lightning.fabric:FP8FabricPrecision",
        "lightning.fabric.plugins.precision:Precision",
        ("lightning.fabric.strategies:FSDPStrategy", "lightning.fabric.strategies:DeepSpeedStrategy"),
        "precision",
    ),
    _Family(
        "pytorch_lightning.trainer.connectors.accelerator_connector:_AcceleratorConnector",
        "fp8_lightning.lightning.standalone:FP8Precision",
        "pytorch_lightning.plugins.precision:Precision",
        ("pytorch_lightning.strategies:FSDPStrategy", "pytorch_lightning.strategies:DeepSpeedStrategy"),
        "precision_plugin",
    ),
    _Family(
        "lightning_fabric.connector:_Connector",
        "fp8_lightning.lightning.standalone:FP8FabricPrecision",
        "lightning_fabric.plugins.precision:Precision",
        ("lightning_fabric.strategies:FSDPStrategy", "lightning_fabric.strategies:DeepSpeedStrategy"),
        "precision",
    ),
)


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def register_precision_strings() -> list[str]:
    """Wrap every installed Lightning connector (idempotent). Returns the connectors wrapped now or before."""
    wrapped = []
    for family in _FAMILIES:
        try:
            connector = _load(family.connector)
        except (ImportError, AttributeError):
            continue  # package not installed (the standalone ones are optional)
        if not getattr(connector.__init__, _MARK, False):
            connector.__init__ = _wrap_init(connector.__init__, family)
        wrapped.append(family.connector)
    return wrapped


def _wrap_init(original: Callable, family: _Family) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        translate_precision(bound.arguments, family)
        check_strategy(bound.arguments, family)
        original(*bound.args, **bound.kwargs)
        check_accelerator(self, family)

    setattr(__init__, _MARK, True)
    return __init__


# --------------------------------------------------------------------------------------------------------
# Steps of the wrapped constructor
# --------------------------------------------------------------------------------------------------------


def _as_list(plugins: Any) -> list:
    if plugins is None:
        return []
    return list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]


def _carried_precision(strategy: Any) -> Any:
    """The precision plugin a strategy *instance* already carries (Trainer: ``_precision_plugin``, Fabric:
    ``_precision``), or None."""
    if isinstance(strategy, str):
        return None
    return getattr(strategy, "_precision_plugin", None) or getattr(strategy, "_precision", None)


def translate_precision(arguments: dict, family: _Family) -> None:
    """Turn ``precision="fp8-..."`` into ``plugins=[<FP8 plugin>]`` in the connector's bound arguments."""
    precision = arguments.get("precision")
    if not is_fp8_precision(precision):
        return
    name = precision.strip().lower()
    recipe_for_precision(name)  # unknown strings fail here, listing the valid ones
    plugins = _as_list(arguments.get("plugins"))
    base = _load(family.precision_base)
    given = [p for p in plugins if isinstance(p, base)]
    if given:
        raise ValueError(
            f"precision={precision!r} and plugins=[{given[0]!r}] both choose the precision; pass only one "
            f"(precision={precision!r} alone, or plugins=[FP8Precision(...)] to customise the recipe)."
        )
    carried = _carried_precision(arguments.get("strategy"))
    if carried is not None:
        if isinstance(carried, FP8PrecisionMixin) and carried.precision == name:
            arguments["precision"] = None  # the strategy already brings exactly this precision
            return
        raise ValueError(
            f"precision={precision!r} conflicts with the precision plugin {carried!r} that the strategy carries; "
            "drop precision= or build the strategy without a precision plugin."
        )
    arguments["precision"] = None
    arguments["plugins"] = plugins + [_load(family.plugin)(recipe=recipe_for_precision(name))]
    arguments["plugins"][-1].precision = name


def _fp8_plugin(arguments: dict) -> FP8PrecisionMixin | None:
    for plugin in _as_list(arguments.get("plugins")) + [_carried_precision(arguments.get("strategy"))]:
        if isinstance(plugin, FP8PrecisionMixin):
            return plugin
    return None


def _strategy_class(strategy: Any, family: _Family) -> type | None:
    if not isinstance(strategy, str):
        return type(strategy)
    registry_path = family.connector.split(".trainer.")[0] + ".strategies:StrategyRegistry"
    if "fabric" in family.connector:
        registry_path = family.connector.split(".connector")[0] + ".strategies:STRATEGY_REGISTRY"
    try:
        registry = _load(registry_path)
    except (ImportError, AttributeError):
        return None
    entry = dict.get(registry, strategy.lower())  # the registry's own get() raises for unknown names
    return entry["strategy"] if entry else None


def check_strategy(arguments: dict, family: _Family) -> None:
    """Refuse FP8 with strategies that cannot run it (FSDP1, DeepSpeed), saying what to use instead."""
    if _fp8_plugin(arguments) is None:
        return
    cls = _strategy_class(arguments.get("strategy", "auto"), family)
    if cls is None:
        return
    for path in family.refused:
        try:
            refused = _load(path)
        except (ImportError, AttributeError):
            continue
        if issubclass(cls, refused):
            raise ValueError(
                f"FP8 training cannot run with {cls.__name__} (strategy={arguments.get('strategy')!r}): it wraps "
                "parameters in its own flat buffers and precision plugin, so FP8 layers and scaling state would "
                "be bypassed. For sharded training use ModelParallelStrategy with torch's fully_shard (FSDP2) "
                "or fp8_lightning's FP8 FSDP2 strategy; for data parallelism use strategy='ddp'."
            )


def check_accelerator(connector: Any, family: _Family) -> None:
    """Fail at construction when the chosen CUDA device cannot run FP8 GEMMs and emulation is off."""
    plugin = getattr(connector, family.result_attr, None)
    if not isinstance(plugin, FP8PrecisionMixin):
        return
    devices = [d for d in getattr(connector, "_parallel_devices", []) if isinstance(d, torch.device)]
    for device in devices:
        if device.type == "cuda":
            check_device(device, plugin.emulate)
            return
