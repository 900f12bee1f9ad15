"""The documentation: the site builds in strict mode (a broken link or reference fails), the runnable examples
run, the generated tables match their sources, the README stays short and links only to pages that exist, and module
docstrings stay short and undated."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fp8_lightning import capability_table, settings

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RUNNABLE = re.compile(r"<!-- runnable -->\n```python\n(.*?)```", re.S)
DATED = re.compile(r"\b20\d\d-\d\d-\d\d\b|\bmeasured (on|in) (20|january|february|march|april|may|june|july|"
                   r"august|september|october|november|december)", re.I)


def between(text: str, marker: str) -> str:
    found = re.search(rf"<!-- {marker}:start -->\n(.*?)\n<!-- {marker}:end -->", text, re.S)
    assert found, f"no block between the {marker} markers"
    return found.group(1).strip()


def test_the_site_builds_in_strict_mode(tmp_path):
    pytest.importorskip("mkdocs")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "index.html").exists() and (tmp_path / "reference" / "api" / "index.html").exists()


def runnable_blocks() -> list[tuple[str, int, str]]:
    blocks = []
    for page in sorted(DOCS.rglob("*.md")):
        for i, code in enumerate(RUNNABLE.findall(page.read_text())):
            blocks.append((str(page.relative_to(ROOT)), i, code))
    return blocks


def test_there_are_runnable_examples():
    assert len(runnable_blocks()) >= 2


@pytest.mark.parametrize("page,index,code", runnable_blocks(), ids=lambda v: str(v)[:40])
def test_runnable_example_runs_on_cpu(page, index, code, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, f"{page} example {index} failed:\n{done.stdout}\n{done.stderr}"


def test_environment_table_is_generated_from_settings():
    page = (DOCS / "reference" / "environment.md").read_text()
    assert between(page, "environment") == settings.environment_table().strip()
    listed = {name for name, _, _ in settings.VARIABLES}
    read = set(re.findall(r'_flag\(environ, "(\w+)"\)|PREFIX \+ "(\w+)"', Path(settings.__file__).read_text()))
    names = {settings.PREFIX + a for a, b in read if a} | {settings.PREFIX + b for a, b in read if b}
    assert names - {settings.PREFIX + "CACHE_DIR"} <= listed, names - listed


@pytest.mark.parametrize("page", ["README.md", "docs/guides/recipes.md"])
def test_support_matrix_copies_are_the_capability_tables(page):
    assert between((ROOT / page).read_text(), "support-matrix") == capability_table.support_matrix().strip(), (
        f"{page}'s support matrix differs from the capability table: paste the output of "
        "`python -m fp8_lightning.capability_table --matrix` between the markers"
    )


def test_readme_is_short_and_links_to_pages_that_exist():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) < 15_000
    links = re.findall(r"\]\(((?:docs/)[^)#]+)(?:#[^)]*)?\)", readme)
    assert links, "the README links into the docs"
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, missing


def module_docstrings() -> list[tuple[str, str]]:
    out = []
    for path in sorted((ROOT / "fp8_lightning").rglob("*.py")) + sorted((ROOT / "kernels").rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        if doc:
            out.append((str(path.relative_to(ROOT)), doc))
    return out


def test_module_docstrings_are_short_and_undated():
    long = [(p, d.count("\n") + 1) for p, d in module_docstrings() if d.count("\n") + 1 > 25]
    dated = [p for p, d in module_docstrings() if DATED.search(d)]
    assert not long, f"module docstrings over 25 lines (move the why to docs/design/notes.md): {long}"
    assert not dated, f"module docstrings with a dated measurement (it belongs in benchmarks/results): {dated}"


def test_the_docstring_check_can_fail():
    assert DATED.search("measured 2026-11-22 on the CI host")
    assert not DATED.search("the 2-core CI host")


def test_public_functions_document_their_arguments_and_results():
    import inspect

    import fp8_lightning

    checked = ["capabilities", "convert_to_fp8", "fp8_autocast", "sync_scales", "fp8_state_dict", "load_fp8_state_dict",
               "recipe_from", "fp8_gemm_support", "fp8_modules", "is_fp8_enabled", "fp8_grouped_mm"]
    missing = []
    for name in checked:
        obj = getattr(fp8_lightning, name)
        doc = inspect.getdoc(obj) or ""
        takes_args = bool(inspect.signature(obj).parameters)
        if (takes_args and "Args:" not in doc) or "Returns:" not in doc:
            missing.append(name)
    assert not missing, f"public functions without Args:/Returns: sections: {missing}"
    from fp8_lightning.capability_table import built_in_recipes

    undocumented = [name for name, cls in built_in_recipes().items() if "Args:" not in (inspect.getdoc(cls) or "")]
    assert not undocumented, f"recipe classes without an Args: section: {undocumented}"
