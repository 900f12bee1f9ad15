"""The benchmarks' front door and the line between tests and benchmarks.

``python -m benchmarks --list`` names every suite, and each resolves to a module under ``benchmarks/``. Read from
the source (nothing is imported): no benchmark edits ``sys.path`` or imports ``tests``, and no test imports
``benchmarks``; what both need is in ``fp8_lightning.testing``.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _listed_suites() -> dict[str, str]:
    """{suite: module} from ``python -m benchmarks --list`` and the table it prints from (read, not imported)."""
    done = subprocess.run([sys.executable, "-m", "benchmarks", "--list"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    listed = [line.split()[0] for line in done.stdout.splitlines() if line.startswith("  ")]
    table = ast.parse((REPO / "benchmarks" / "__init__.py").read_text())
    modules = {}
    for node in ast.walk(table):
        if isinstance(node, ast.Dict) and node.keys and all(isinstance(k, ast.Constant) for k in node.keys):
            for key, value in zip(node.keys, node.values):
                if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "Suite":
                    modules[key.value] = value.args[0].value
    assert listed == list(modules), (listed, list(modules))
    return modules


def test_every_listed_suite_resolves_to_a_benchmark_module():
    suites = _listed_suites()
    assert {"linear", "gpt", "memory", "host-time", "launch-count", "grad-comm", "aot", "gpu-check"} <= set(suites)
    for suite, module in suites.items():
        spec = importlib.util.find_spec(f"benchmarks.{module}")
        assert spec is not None and spec.origin == str(REPO / "benchmarks" / f"{module}.py"), (suite, module)


def test_an_unknown_suite_is_refused_with_the_names_allowed():
    done = subprocess.run([sys.executable, "-m", "benchmarks", "no-such-suite"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2
    assert "unknown suite 'no-such-suite'" in done.stderr and "linear" in done.stderr and "gpu-check" in done.stderr


def imported_roots(source: str) -> set[str]:
    """The top-level package of every absolute import in ``source`` (function-level imports included)."""
    roots = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def edits_sys_path(source: str) -> bool:
    """Whether ``source`` changes ``sys.path`` (``sys.path.insert/append/extend/...``, or assigns to it)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys":
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "sys" and any(a.name == "path" for a in node.names):
            return True
    return False


def test_the_scans_see_what_they_look_for():
    assert imported_roots("import tests.processes\n") == {"tests"}
    assert imported_roots("def f():\n    from benchmarks.bench_common import header\n") == {"benchmarks"}
    assert imported_roots("from . import helpers\nfrom fp8_lightning import testing\n") == {"fp8_lightning"}
    assert edits_sys_path("import sys\nsys.path.insert(0, '.')\n")
    assert edits_sys_path("from sys import path\npath.append('.')\n")
    assert not edits_sys_path("import sys\nsys.exit(0)\n")


def test_benchmarks_do_not_edit_sys_path_or_import_tests():
    files = sorted((REPO / "benchmarks").rglob("*.py"))
    assert files
    offenders = [f"{p.relative_to(REPO)}: edits sys.path" for p in files if edits_sys_path(p.read_text())]
    offenders += [f"{p.relative_to(REPO)}: imports tests" for p in files if "tests" in imported_roots(p.read_text())]
    assert not offenders, offenders


def test_tests_do_not_import_benchmarks():
    files = sorted((REPO / "tests").rglob("*.py"))
    offenders = [str(p.relative_to(REPO)) for p in files if "benchmarks" in imported_roots(p.read_text())]
    assert not offenders, f"tests importing benchmarks (run them with tests.helpers.front_door instead): {offenders}"
