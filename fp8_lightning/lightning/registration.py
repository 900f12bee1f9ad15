"""Make ``Trainer(precision="fp8-hybrid")`` and ``Fabric(precision="fp8-hybrid")`` work.

Lightning validates ``precision=`` against fixed ``Literal`` lists and has no precision registry, so the least
invasive hook is the constructor of its accelerator connector (``_AcceleratorConnector`` for the Trainer,
``_Connector`` for Fabric), wrapped once when both ``fp8_lightning`` and the Lightning package are imported
(``fp8_lightning.lightning.hook`` decides when):

* a known FP8 string becomes the matching plugin, handed over through ``plugins=`` (and ``precision=None``),
  so Lightning's own code path for a user-supplied plugin does the rest and ``trainer.precision`` reports the
  string; every other value goes to Lightning untouched;
* an unknown ``"fp8..."`` string raises an error that lists the valid ones;
* a string together with a precision plugin in ``plugins=`` or carried by the strategy is reported (or, when the
  strategy already carries the very same FP8 precision, accepted);
* combinations that cannot work fail early with what to use instead: FSDP1 (``FSDPStrategy``) and DeepSpeed
  with FP8, and a CUDA device without FP8 support (the core's ``check_device`` message). These checks also
  cover ``plugins=[FP8Precision(...)]``, the documented route that needs no registration;
* with an FP8 plugin, the strategy checks a checkpoint file before loading it (``checkpoint.check_before_loading``).

The wrapping is idempotent and covers ``lightning.pytorch``, ``lightning.fabric`` and the standalone
``pytorch_lightning`` and ``lightning_fabric`` packages when the program imports them (before or after this
package; never imported from here, so the user's logging set-up stays as it was). ``Trainer`` and ``Fabric`` also
list the FP8 strings in their ``precision`` annotation, which LightningCLI checks (``--trainer.precision
fp8-hybrid``). When Lightning's private names move, registration raises :class:`RegistrationError` naming the
``plugins=[FP8Precision(...)]`` route, which needs none of this.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import os
import sys
import typing
from typing import Any, Callable, Iterator, Literal, Union

import torch

from fp8_lightning.gemm import check_device
from fp8_lightning.lightning.checkpoint import check_before_loading
from fp8_lightning.lightning.plugin_base import FP8PrecisionMixin
from fp8_lightning.lightning.strings import ACCEPTED_PRECISION_STRINGS, is_fp8_precision, recipe_for_precision
from fp8_lightning.privates import carried_precision, parallel_devices

_MARK = "_fp8_lightning_wrapped"


class RegistrationError(RuntimeError):
    """Lightning's private names this registration wraps are not where it expects them."""


@dataclasses.dataclass(frozen=True)
class _Family:
    """One Lightning package's connector and the classes the checks need."""

    connector: str  # "module:Class"
    plugin: str  # "module:Class" of the FP8 plugin for this package
    precision_base: str
    refused: tuple[str, ...]  # strategies that cannot run the FP8 plugin
    result_attr: str  # where the connector stores the final precision plugin
    front: str  # "module:Class" whose ``precision`` annotation LightningCLI / jsonargparse check

    @property
    def package(self) -> str:
        return self.connector.split(".")[0]


_FAMILIES = (
    _Family(
        "lightning.pytorch.trainer.connectors.accelerator_connector:_AcceleratorConnector",
        "fp8_lightning.lightning.precision:FP8Precision",
        "lightning.pytorch.plugins.precision:Precision",
        ("lightning.pytorch.strategies:FSDPStrategy", "lightning.pytorch.strategies:DeepSpeedStrategy"),
        "precision_plugin",
        "lightning.pytorch:Trainer",
    ),
    _Family(
        "lightning.fabric.connector:_Connector",
        "fp8_lightning.lightning.fabric:FP8FabricPrecision",
        "lightning.fabric.plugins.precision:Precision",
        ("lightning.fabric.strategies:FSDPStrategy", "lightning.fabric.strategies:DeepSpeedStrategy"),
        "precision",
        "lightning.fabric:Fabric",
    ),
    _Family(
        "pytorch_lightning.trainer.connectors.accelerator_connector:_AcceleratorConnector",
        "fp8_lightning.lightning.standalone:FP8Precision",
        "pytorch_lightning.plugins.precision:Precision",
        ("pytorch_lightning.strategies:FSDPStrategy", "pytorch_lightning.strategies:DeepSpeedStrategy"),
        "precision_plugin",
        "pytorch_lightning:Trainer",
    ),
    _Family(
        "lightning_fabric.connector:_Connector",
        "fp8_lightning.lightning.standalone:FP8FabricPrecision",
        "lightning_fabric.plugins.precision:Precision",
        ("lightning_fabric.strategies:FSDPStrategy", "lightning_fabric.strategies:DeepSpeedStrategy"),
        "precision",
        "lightning_fabric:Fabric",
    ),
)
_WRAPPED_ARGUMENTS = ("precision", "plugins", "strategy")  # what the wrapper reads from the connector's signature
FABRIC_CLI_PRECISION = "LT_PRECISION"  # how `fabric run --precision` passes the value to Fabric()


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def register_precision_strings() -> list[str]:
    """Wrap the Lightning connectors (idempotent). Returns the connectors wrapped now or before.

    ``lightning`` (a dependency) is wrapped at once; the standalone ``pytorch_lightning`` / ``lightning_fabric``
    packages only when they are imported: now, or later through :mod:`fp8_lightning.lightning.hook` (installed by
    ``import fp8_lightning``). Importing them here would change the user's environment (the standalone package
    reroutes Lightning's loggers). Raises :class:`RegistrationError`, naming the
    ``plugins=`` route, when Lightning's private names moved.
    """
    wrapped = []
    for family in _FAMILIES:
        if family.package == "lightning" or family.package in sys.modules:
            _register(family)
            wrapped.append(family.connector)
    return wrapped


def register_package(package: str) -> None:
    """Wrap the connectors of one Lightning package (``lightning``, ``pytorch_lightning`` or ``lightning_fabric``),
    which the caller has imported (idempotent)."""
    for family in _FAMILIES:
        if family.package == package:
            _register(family)


def _register(family: _Family) -> None:
    try:
        connector, front = _load(family.connector), _load(family.front)
    except (ImportError, AttributeError) as err:
        raise _cannot_register(family, f"{type(err).__name__}: {err}") from err
    parameters = inspect.signature(connector.__init__).parameters
    missing = [name for name in _WRAPPED_ARGUMENTS if name not in parameters]
    if missing:
        raise _cannot_register(family, f"{family.connector} has no argument(s) {missing}")
    if not getattr(connector.__init__, _MARK, False):
        connector.__init__ = _wrap_init(connector.__init__, family)
    accept_fp8_in_annotation(front)


def _cannot_register(family: _Family, why: str) -> RegistrationError:
    return RegistrationError(
        f"fp8_lightning cannot register precision='fp8-...' with this {family.package} version ({why}). "
        "Pass the plugin instead, which needs no registration: Trainer(plugins=[FP8Precision(recipe=...)]) or "
        "Fabric(plugins=[FP8FabricPrecision(recipe=...)])."
    )


def accept_fp8_in_annotation(cls: type) -> None:
    """Add the FP8 strings to the ``precision`` annotation of ``cls.__init__`` (Trainer, Fabric), which
    LightningCLI (jsonargparse) checks command-line values against: ``--trainer.precision fp8-hybrid``."""
    init = inspect.unwrap(cls.__init__)
    annotation = init.__annotations__.get("precision")
    fp8 = Literal[ACCEPTED_PRECISION_STRINGS]  # type: ignore[valid-type]
    if annotation is None or isinstance(annotation, str) or fp8 in typing.get_args(annotation):
        return
    init.__annotations__["precision"] = Union[annotation, fp8]


def _wrap_init(original: Callable, family: _Family) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        from_env = precision_from_fabric_cli(bound.arguments, family)
        translate_precision(bound.arguments, family, from_env)
        check_strategy(bound.arguments, family)
        with _env_hidden(FABRIC_CLI_PRECISION) if from_env else contextlib.nullcontext():
            original(*bound.args, **bound.kwargs)
        check_accelerator(self, family)
        check_checkpoints_before_loading(self, family)

    setattr(__init__, _MARK, True)
    return __init__


# --------------------------------------------------------------------------------------------------------
# Steps of the wrapped constructor
# --------------------------------------------------------------------------------------------------------


def precision_from_fabric_cli(arguments: dict, family: _Family) -> bool:
    """``fabric run --precision X`` hands X to ``Fabric()`` through ``LT_PRECISION``, which Fabric's connector
    reads itself, with Fabric's rule (``_Connector._argument_from_env``): the variable wins over ``precision=``,
    except under ``fabric run`` (``LT_CLI_USED=1``) when both are given and differ, which is an error. When the
    variable or the argument is an FP8 string, apply that rule here, before the string is translated (True when
    the variable was taken; the connector must then not see it). Other values stay Lightning's business."""
    value = os.environ.get(FABRIC_CLI_PRECISION)
    current = arguments.get("precision")
    if family.result_attr != "precision" or value is None or not (is_fp8_precision(value) or is_fp8_precision(current)):
        return False
    if current is not None and str(current) != value and os.environ.get("LT_CLI_USED", "0") not in ("", "0"):
        raise ValueError(
            f"Your code has `Fabric(precision={current!r}, ...)` but it conflicts with the value `--precision={value}` "
            "set through the CLI. Remove it either from the CLI or from the Lightning Fabric object."
        )
    arguments["precision"] = value
    return True


@contextlib.contextmanager
def _env_hidden(name: str) -> Iterator[None]:
    value = os.environ.pop(name)
    try:
        yield
    finally:
        os.environ[name] = value


def _as_list(plugins: Any) -> list:
    if plugins is None:
        return []
    return list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]


def translate_precision(arguments: dict, family: _Family, from_env: bool = False) -> None:
    """Turn ``precision="fp8-..."`` into ``plugins=[<FP8 plugin>]`` in the connector's bound arguments
    (``from_env``: the string came from ``LT_PRECISION``, which errors then name)."""
    precision = arguments.get("precision")
    if not is_fp8_precision(precision):
        return
    name = precision.strip().lower()
    given_as = f"{FABRIC_CLI_PRECISION}={precision!r} (the environment variable)" if from_env else (
        f"precision={precision!r}")
    try:
        recipe_for_precision(name)  # unknown strings fail here, listing the valid ones
    except ValueError as err:
        if not from_env:
            raise
        raise ValueError(f"{given_as}: {err} Or unset {FABRIC_CLI_PRECISION}.") from None
    plugins = _as_list(arguments.get("plugins"))
    base = _load(family.precision_base)
    given = [p for p in plugins if isinstance(p, base)]
    if given:
        fix = f"unset {FABRIC_CLI_PRECISION}" if from_env else f"precision={precision!r} alone"
        raise ValueError(
            f"{given_as} and plugins=[{given[0]!r}] both choose the precision; pass only one "
            f"({fix}, or plugins=[FP8Precision(...)] to customise the recipe)."
        )
    carried = carried_precision(arguments.get("strategy"))
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
    for plugin in _as_list(arguments.get("plugins")) + [carried_precision(arguments.get("strategy"))]:
        if isinstance(plugin, FP8PrecisionMixin):
            return plugin
    return None


def _strategy_class(strategy: Any, family: _Family) -> type | None:
    if not isinstance(strategy, str):
        return type(strategy)
    registry = _strategy_registry(family)
    if registry is None:
        return None
    entry = dict.get(registry, strategy.lower())  # the registry's own get() raises for unknown names
    return entry["strategy"] if entry else None


def _strategy_registry(family: _Family) -> Any:
    registry_path = family.connector.split(".trainer.")[0] + ".strategies:StrategyRegistry"
    if "fabric" in family.connector:
        registry_path = family.connector.split(".connector")[0] + ".strategies:STRATEGY_REGISTRY"
    try:
        return _load(registry_path)
    except (ImportError, AttributeError):
        return None


def check_fp8_strategy_name(arguments: dict, family: _Family) -> None:
    """An ``"fp8..."`` strategy name that is not registered (``strategy="FP8DDPStrategy"``, ``"fp8-ddp"``) gets the
    registered FP8 names, where Lightning's own error lists only its examples."""
    strategy = arguments.get("strategy")
    registry = _strategy_registry(family)
    if not isinstance(strategy, str) or not strategy.strip().lower().startswith("fp8") or registry is None:
        return
    names = sorted(name for name in dict.keys(registry) if name.startswith("fp8"))
    if strategy.lower() not in names and names:
        raise ValueError(
            f"strategy={strategy!r} is not a registered strategy name; the FP8 ones are {', '.join(names)}. Pass "
            f"one of them (strategy={names[0]!r}), or an instance such as strategy=FP8DDPStrategy(...)."
        )


def check_strategy(arguments: dict, family: _Family) -> None:
    """Refuse FP8 with strategies that cannot run it (FSDP1, DeepSpeed), saying what to use instead."""
    check_fp8_strategy_name(arguments, family)
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


def check_checkpoints_before_loading(connector: Any, family: _Family) -> None:
    """With an FP8 precision plugin, the strategy checks a checkpoint file before loading it (a truncated or
    corrupted file is named in one message instead of resuming into NaN: ``checkpoint.check_before_loading``)."""
    if isinstance(getattr(connector, family.result_attr, None), FP8PrecisionMixin):
        check_before_loading(getattr(connector, "strategy", None))


def check_accelerator(connector: Any, family: _Family) -> None:
    """Fail at construction when the chosen CUDA device cannot run FP8 GEMMs and emulation is off."""
    plugin = getattr(connector, family.result_attr, None)
    if not isinstance(plugin, FP8PrecisionMixin):
        return
    devices = [d for d in parallel_devices(connector) if isinstance(d, torch.device)]
    for device in devices:
        if device.type == "cuda":
            check_device(device, plugin.emulate)
            return
