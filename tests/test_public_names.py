"""Each public name is defined in one module: the package's top-level functions, classes and constants.

Two definitions of one name (a dispatching ``amax`` next to the reference ``amax``) make a reader guess which one a
call reaches. A re-export (``from x import y``) is not a definition. Scans ``fp8_lightning/`` and ``kernels/`` (the
package ``fp8_lightning.kernels``) with ``ast``, without importing anything.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"fp8_lightning": ROOT / "fp8_lightning", "fp8_lightning.kernels": ROOT / "kernels"}
# Entry points: ``python -m fp8_lightning.train`` and ``fp8_lightning.compare`` each need a ``main``.
ENTRY_POINT_NAMES = frozenset({"main"})


def defined_names(source: str) -> set[str]:
    """Public names a module's top level defines: functions, classes and assigned constants (not imports)."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if not n.startswith("_") and n != "__all__"}


def duplicates(sources: dict[str, str]) -> dict[str, list[str]]:
    """Each public name that more than one module (``sources``: module -> source) defines, with those modules."""
    where: dict[str, set[str]] = defaultdict(set)
    for module, source in sources.items():
        for name in defined_names(source) - ENTRY_POINT_NAMES:
            where[name].add(module)
    return {name: sorted(modules) for name, modules in sorted(where.items()) if len(modules) > 1}


def package_sources() -> dict[str, str]:
    sources = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            module = ".".join((package, *parts)).removesuffix(".__init__")
            sources[module] = path.read_text()
    return sources


def test_the_scan_finds_a_name_defined_twice():
    sources = {
        "a": "import torch\nfrom b import shared as alias\nLIMIT = 1\ndef amax(x):\n    return x\nclass Plan: ...\n",
        "b": "from a import amax\nLIMIT: int = 2\ndef shared(): ...\n_private = 3\ndef main(): ...\n",
        "c": "def amax(x):\n    return x\nclass Plan: ...\ndef main(): ...\n",
    }
    assert duplicates(sources) == {"LIMIT": ["a", "b"], "Plan": ["a", "c"], "amax": ["a", "c"]}
    assert duplicates({"a": sources["a"], "b": sources["b"]}) == {"LIMIT": ["a", "b"]}  # imports are not definitions


def test_the_scan_sees_the_whole_package():
    sources = package_sources()
    assert {"fp8_lightning.quantize", "fp8_lightning.ops.registry", "fp8_lightning.kernels.per_tensor"} <= set(sources)
    assert "amax" in defined_names(sources["fp8_lightning.quantize"])


def test_no_public_name_is_defined_twice():
    found = duplicates(package_sources())
    assert not found, "public names defined in more than one module (rename one, or import it from the other):\n" + (
        "\n".join(f"  {name}: {', '.join(modules)}" for name, modules in found.items())
    )
