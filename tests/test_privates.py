"""Every private name listed in ``fp8_lightning.privates`` is still where the package expects it.

A name of a package that is not installed (the standalone Lightning packages, Triton, Gluon) is skipped with the
reason; a name newer than the installed torch is skipped by its ``since``.
"""

import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch

from fp8_lightning.privates import PRIVATES, Private

PACKAGE = Path(__file__).resolve().parents[1]


def _resolve(path: str):
    module_name, _, qualname = path.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as err:
        if module_name.split(".")[0] in ("triton",):
            pytest.skip(f"{module_name} is not importable here: {err}")
        raise AssertionError(f"{module_name} no longer imports: {err}") from err
    for part in filter(None, qualname.split(".")):
        assert hasattr(obj, part), f"{path}: {part!r} is gone from {obj!r}"
        obj = getattr(obj, part)
    return obj


def _torch_older_than(version: str) -> bool:
    have = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    return have < tuple(int(x) for x in version.split(".")[:2])


@pytest.mark.parametrize("private", PRIVATES, ids=lambda p: p.name)
def test_the_private_name_is_still_there(private: Private):
    if private.since is not None and _torch_older_than(private.since):
        pytest.skip(f"{private.name} arrived in torch {private.since}; torch {torch.__version__} is installed")
    obj = _resolve(private.path)
    if private.attribute is None:
        return
    if hasattr(obj, private.attribute):
        return
    # An instance attribute: the class's own module (or, for one set from outside, the module that defines the
    # class) must still set or read it.
    module = importlib.import_module(private.source) if private.source else inspect.getmodule(obj)
    assert re.search(rf"\.{re.escape(private.attribute)}\b", inspect.getsource(module)), (
        f"{private.name}: {module.__name__} no longer mentions .{private.attribute}"
    )


@pytest.mark.parametrize("private", PRIVATES, ids=lambda p: p.name)
def test_the_table_names_real_users(private: Private):
    """Each ``used_in`` file exists and mentions the private name (so the table stays true as code moves)."""
    leaf = private.attribute or re.split(r"[:.]", private.path)[-1]
    for where in private.used_in:
        path = PACKAGE / where if where.startswith("kernels/") else PACKAGE / "fp8_lightning" / where
        assert path.exists(), f"{private.name}: {where} does not exist"
        text = path.read_text()
        assert leaf in text or "fp8_lightning.privates" in text or "from fp8_lightning.privates" in text, (
            f"{private.name}: {where} does not use {leaf}"
        )


def test_the_privates_module_imports_no_lightning():
    import ast

    tree = ast.parse((PACKAGE / "fp8_lightning" / "privates.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    assert not {m for m in imported if m and m.split(".")[0] in ("lightning", "pytorch_lightning", "triton")}
