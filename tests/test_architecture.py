"""The import structure of the package: no import cycle (counting imports inside functions), the layering stated
as import-linter contracts in ``pyproject.toml``, and ruff's checks.

The module graph is read from the source with ``ast``, so that an import inside a function (run late, but an
import all the same) counts; imports under ``if TYPE_CHECKING:`` are never run and do not count. ``kernels/`` is
the package ``fp8_lightning.kernels`` (``[tool.setuptools.package-dir]``).
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"fp8_lightning": ROOT / "fp8_lightning", "fp8_lightning.kernels": ROOT / "kernels"}

def _modules() -> dict[str, Path]:
    modules = {}
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_modules(tree: ast.AST, module: str, is_package: bool, modules: set[str]) -> list[tuple[str, int]]:
    """The package's modules that ``tree`` imports (at any depth, outside ``if TYPE_CHECKING:``), with line
    numbers. ``from a import b`` imports the module ``a.b`` when there is one, else the name ``b`` of ``a``;
    relative imports are resolved against ``module``. Parent packages run on import too, but are not edges (as in
    import-linter): else every submodule would form a cycle with a package ``__init__`` that imports it."""
    found: list[tuple[str, int]] = []

    def nearest(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((nearest(alias.name), node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.append((submodule if submodule in modules else nearest(base), node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return [(name, line) for name, line in found if name is not None and name != module]


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported module of the package: line of the first such import}."""
    modules = _modules()
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges: dict[str, int] = {}
        tree = ast.parse(path.read_text())
        for name, line in _imported_modules(tree, module, path.name == "__init__.py", set(modules)):
            edges.setdefault(name, line)
        graph[module] = edges
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), as a closed module path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_in(graph, set(component)) for component in components]


def _cycle_in(graph: dict[str, dict[str, int]], component: set[str]) -> list[str]:
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth-first: the shortest way back to start inside the component
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    return paths[v] + [start]
                if w in component and w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return sorted(component)


def _describe(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    steps = [f"{a} imports {b} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
    return "  " + "; ".join(steps)


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph()
    assert "fp8_lightning.kernels.availability" in graph["fp8_lightning.kernels.block_gemm"]  # inside mx_gemm
    assert "fp8_lightning.formats" in graph["fp8_lightning.kernels.availability"]  # a module-level import


def test_no_import_cycle():
    graph = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(_describe(graph, c) for c in cycles)


def _tool(name: str) -> str:
    """The console script ``name`` installed beside this interpreter (the dev extra installs it)."""
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[dev]')")
    return found


def test_import_linter_contracts_are_kept(tmp_path):
    """``lint-imports`` on a copy of the tree laid out as installed (kernels/ at fp8_lightning/kernels), so that
    the contracts about ``fp8_lightning.kernels`` see it."""
    pytest.importorskip("importlinter")
    lint_imports = _tool("lint-imports")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.c")
    shutil.copytree(SOURCES["fp8_lightning"], tmp_path / "fp8_lightning", ignore=ignore)
    shutil.copytree(SOURCES["fp8_lightning.kernels"], tmp_path / "fp8_lightning" / "kernels", ignore=ignore)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run(
        [lint_imports, "--no-cache", "--no-logo", str(ROOT / "pyproject.toml")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fp8_lightning.kernels" not in result.stderr


def test_ruff_finds_nothing():
    pytest.importorskip("ruff")
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
