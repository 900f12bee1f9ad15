"""LightningCLI reports a bad FP8 setting in its first lines: what is wrong and how to fix it.

LightningCLI (jsonargparse) checks ``--trainer.precision`` against Lightning's lists of strings and builds the
classes named by ``--trainer.plugins`` or ``--trainer.strategy`` by trying every type the annotation allows. A
mistake there ends in the parser's usage (some 45 lines) and one error per type tried, with the FP8 message
somewhere among them, or in a traceback. :func:`report_fp8_errors_first` wraps the CLI's parser class so that such
a report starts with the FP8 message: a precision string that neither Lightning nor fp8_lightning knows (with the
nearest FP8 string), an argument of an fp8_lightning class that fails the parser's type check (or the class named
without its module), or the error an fp8_lightning class named in the configuration raises when built with the
arguments given. The parser's own report follows unchanged; every other error is reported as before.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import re
import sys
from typing import Any, Callable

from fp8_lightning.lightning.strings import ACCEPTED_PRECISION_STRINGS, is_fp8_precision

_WRAPPED = "_fp8_reports_first"


def report_fp8_errors_first(cli_module: Any) -> None:
    """Wrap ``cli_module.LightningArgumentParser`` (``error`` and ``instantiate_classes``) once.

    Args:
        cli_module: ``lightning.pytorch.cli`` or ``pytorch_lightning.cli``.
    """
    parser = cli_module.LightningArgumentParser
    if getattr(parser, _WRAPPED, False):
        return
    parser.error = _wrap_error(parser.error)
    parser.instantiate_classes = _wrap_instantiate(parser.instantiate_classes)
    setattr(parser, _WRAPPED, True)


def precision_hint(message: str) -> str | None:
    """The FP8 lines for a parser error about ``trainer.precision`` (or a Fabric ``precision``), else None.

    Args:
        message: the parser's error message.

    Returns:
        What is wrong and how to fix it, or None when the message is about something else.
    """
    key = re.search(r'Parser key "([\w.]*precision)"', message)
    given = re.search(r"Given value: (.*)", message)
    if key is None or given is None:
        return None
    value = given.group(1).strip()
    strings = list(ACCEPTED_PRECISION_STRINGS)
    near = difflib.get_close_matches(value, strings, n=1, cutoff=0.6)
    if not near and not is_fp8_precision(value):
        return None
    fix = f"did you mean '{near[0]}'?" if near else "use one of them."
    return (f"error: --{key.group(1)}={value!r} is not a precision string Lightning or fp8_lightning knows; the FP8 "
            f"strings are {', '.join(strings)}: {fix}")


_PUBLIC_CLASSES = ("FP8Precision", "FP8FabricPrecision", "FP8DDPStrategy", "FP8FSDPStrategy", "FP8StatsMonitor",
                   "FP8OptimizerStates", "DivergenceGuard")


def class_argument_hint(message: str) -> str | None:
    """The FP8 line for a parser error about an fp8_lightning class named in the configuration, else None: an
    argument of the wrong type (``--trainer.strategy.fp8_gradients maybe``), or the class named without its module
    (``--trainer.plugins FP8Precision``, which the parser cannot import).

    Args:
        message: the parser's error message.

    Returns:
        What is wrong and how to fix it, or None when the message is about something else.
    """
    outer = re.search(r'Parser key "([\w.]+)"', message)
    option = f"--{outer.group(1)}" if outer else "the option"
    lines = message.splitlines()
    for i, line in enumerate(lines):
        found = re.search(r"Problem with given class_path '(fp8_lightning\.[\w.]+)'", line)
        if found is None:
            continue
        depth = len(line) - len(line.lstrip())
        detail = []
        for inner in lines[i + 1:]:
            if inner.strip() and len(inner) - len(inner.lstrip()) <= depth:
                break
            detail.append(inner.strip())
        key = re.match(r'Parser key "([\w.]+)":', detail[0]) if detail else None
        what = " ".join(detail[1:] if key else detail).strip() or "its arguments do not validate"
        argument = f"{option}.{key.group(1)}" if key else option
        return f"error: {argument} is invalid for {found.group(1)}: {what}"
    given = re.search(r"^\s*Given value: (\w+)\s*$", message, re.MULTILINE)
    if given and given.group(1) in _PUBLIC_CLASSES:
        name = given.group(1)
        return (f"error: {option} {name}: the parser cannot import a class by its bare name here; give its path: "
                f"{option} fp8_lightning.{name}")
    return None


def fp8_class_error(config: Any) -> str | None:
    """Build each fp8_lightning class named in ``config`` with its arguments and return the first one's error.

    Args:
        config: the parsed configuration (a jsonargparse namespace or a dict).

    Returns:
        ``"error: <Class>(<arguments>): <its message>"``, or None when every such class builds.
    """
    for class_path, init_args in _fp8_class_paths(_as_dict(config)):
        try:
            _build(class_path, init_args)
        except Exception as err:  # the class's own message is the point here
            arguments = ", ".join(f"{k}={v!r}" for k, v in init_args.items() if v is not None)
            return f"error: {class_path}({arguments}): {err}"
    return None


def _wrap_error(original: Callable) -> Callable:
    @functools.wraps(original)
    def error(self: Any, message: str, *args: Any, **kwargs: Any) -> Any:
        hint = precision_hint(str(message)) or class_argument_hint(str(message))
        if hint is not None:
            print(hint, "\n(LightningCLI's own report follows.)", file=sys.stderr)
        return original(self, message, *args, **kwargs)

    return error


def _wrap_instantiate(original: Callable) -> Callable:
    @functools.wraps(original)
    def instantiate_classes(self: Any, config: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, config, *args, **kwargs)
        except Exception as err:
            hint = fp8_class_error(config)
            if hint is None:
                raise
            print(hint, "\n(LightningCLI's own report follows.)", file=sys.stderr)
            self.error(str(err))

    return instantiate_classes


def _as_dict(config: Any) -> Any:
    return config.as_dict() if hasattr(config, "as_dict") else config


def _fp8_class_paths(node: Any):
    """(class_path, init_args) of every fp8_lightning class in a nested configuration, innermost first."""
    if isinstance(node, dict):
        for value in node.values():
            yield from _fp8_class_paths(value)
        path = node.get("class_path")
        if isinstance(path, str) and path.startswith("fp8_lightning."):
            yield path, dict(node.get("init_args") or {})
    elif isinstance(node, list):
        for value in node:
            yield from _fp8_class_paths(value)


def _build(class_path: str, init_args: dict) -> Any:
    module, _, name = class_path.rpartition(".")
    args = {k: _build(v["class_path"], dict(v.get("init_args") or {})) if _is_class(v) else v
            for k, v in init_args.items()}
    return getattr(importlib.import_module(module), name)(**args)


def _is_class(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("class_path"), str)
