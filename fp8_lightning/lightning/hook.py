"""Register fp8_lightning with Lightning whenever the program uses Lightning, without importing it from here.

``import fp8_lightning`` calls :func:`install`. For each Lightning package (``lightning``, the standalone
``pytorch_lightning`` and ``lightning_fabric``) that is already imported, the precision strings and strategies are
registered at once; for the others a finder on ``sys.meta_path`` wraps the package's loader and registers right
after the package's top-level module has run (it imports its ``pytorch`` and ``fabric`` parts). So
``Trainer(precision="fp8-hybrid")``, ``Fabric(precision=...)`` and ``strategy="fp8_fsdp"`` work whether Lightning
was imported before or after ``fp8_lightning``, while the core (``fp8_lightning.formats``, ``.recipes``, ...) never
imports Lightning.

This module uses the standard library only: the adapters (and with them Lightning) are imported when a Lightning
package is, not before. Registration is idempotent. When Lightning's private names moved, registration warns with
the ``plugins=[FP8Precision(...)]`` route, which needs none of this, instead of breaking the user's import.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import warnings
from typing import Any, Callable, Iterator

PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric")
CLI_MODULES = ("lightning.pytorch.cli", "pytorch_lightning.cli")  # their parsers report FP8 errors first


def lazy_names(namespace: dict[str, Any], table: dict[str, str]) -> tuple[Callable, Callable]:
    """``__getattr__`` and ``__dir__`` for a package whose names in ``table`` (name -> module) are imported on
    first use, so that importing the package does not import Lightning."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        value = namespace[name] = getattr(importlib.import_module(module), name)
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__


def install() -> None:
    """Register with the Lightning packages imported so far; register with the others when they are imported."""
    for package in PACKAGES + CLI_MODULES:
        if _imported(package):
            register(package)
        else:
            LightningImportHook.watch(package)


_queue: list[str] = []
_state = {"busy": False, "adapters_loading": 0}
ADAPTERS = "fp8_lightning.lightning."


def register(package: str) -> None:
    """Register the precision strings (and, for ``lightning``, the strategies) with one Lightning package.

    The registration imports the adapters. When the Lightning package was imported *by* an adapter module (say
    ``from fp8_lightning import FP8DDPStrategy`` came first), that module is half imported, so the registration
    waits in a queue until the outermost adapter import is done; likewise while another registration runs
    (registering ``pytorch_lightning`` imports ``lightning``).
    """
    _queue.append(package)
    _flush()


def _flush() -> None:
    if _state["busy"] or _state["adapters_loading"]:
        return
    _state["busy"] = True
    try:
        while _queue:
            _register_now(_queue.pop(0))
    finally:
        _state["busy"] = False


def _register_now(package: str) -> None:
    if package in CLI_MODULES:
        from fp8_lightning.lightning.cli import report_fp8_errors_first

        report_fp8_errors_first(sys.modules[package])
        return
    from fp8_lightning.lightning.registration import RegistrationError, register_package

    try:
        register_package(package)
    except RegistrationError as err:  # the plugins=[FP8Precision(...)] route still works: say so, do not break it
        warnings.warn(str(err), RuntimeWarning, stacklevel=2)
    if package == "lightning":
        from fp8_lightning.lightning.ddp import register_ddp_strategy
        from fp8_lightning.lightning.fsdp import register_fsdp_strategy

        register_fsdp_strategy()  # Trainer(strategy="fp8_fsdp")
        register_ddp_strategy()  # Trainer(strategy="fp8_ddp"): DDP with FP8 gradient communication


def _imported(package: str) -> bool:
    return package in sys.modules


class LightningImportHook(importlib.abc.MetaPathFinder):
    """Wraps the loader of a watched Lightning package so that :func:`register` runs after the package loads."""

    watched: set[str] = set()

    @classmethod
    def watch(cls, package: str) -> None:
        cls.watched.add(package)
        if not any(isinstance(finder, cls) for finder in sys.meta_path):
            sys.meta_path.insert(0, cls())

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        adapter = name.startswith(ADAPTERS) and name != __name__
        if name not in self.watched and not adapter:
            return None
        spec = next((s for s in _other_specs(self, name, path, target) if s is not None), None)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_lightning(module: Any) -> None:
            execute(module)
            if name in self.watched:
                self.watched.discard(name)
                register(name)

        def exec_adapter(module: Any) -> None:
            _state["adapters_loading"] += 1
            try:
                execute(module)
            finally:
                _state["adapters_loading"] -= 1
            _flush()

        spec.loader.exec_module = exec_adapter if adapter else exec_lightning
        return spec


def _other_specs(me: Any, name: str, path: Any, target: Any) -> Iterator[Any]:
    for finder in sys.meta_path:
        if finder is not me and hasattr(finder, "find_spec"):
            yield finder.find_spec(name, path, target)
