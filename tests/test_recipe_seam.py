"""The recipe seam holds: outside ``fp8_lightning/recipes/`` no code asks which recipe or which operand kind it
holds; it calls the recipe's protocol and the kind's behaviour instead. The scan reads the source (AST), so it
catches a branch in code no test runs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
KIND_NAMES = {"tensor", "row", "block", "mx", "hp"}
KIND_CONSTANTS = {"TENSOR", "ROW", "BLOCK", "MX", "HIGH_PRECISION"}
RECIPE_FLAGS = {"per_tensor", "high_precision_wgrad", "block_size", "scale_rounding"}  # type-specific fields


def _library_files() -> list[Path]:
    files = sorted((ROOT / "fp8_lightning").rglob("*.py")) + sorted((ROOT / "kernels").rglob("*.py"))
    return [f for f in files if "recipes" not in f.relative_to(ROOT).parts[:2]]


def _is_kind_operand(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and node.value in KIND_NAMES:
        return True
    return isinstance(node, ast.Name) and node.id in KIND_CONSTANTS


def _mentions_kind(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "kind") or (isinstance(node, ast.Name) and node.id == "kind")


def recipe_branches(source: str) -> list[tuple[int, str]]:
    """(line, what) for each branch on a recipe type or an operand kind in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "isinstance" and len(node.args) == 2:
                names = [n.id if isinstance(n, ast.Name) else getattr(n, "attr", "") for n in ast.walk(node.args[1])]
                if any(n.endswith("Scaling") or n.endswith("Recipe") for n in names):
                    found.append((node.lineno, "isinstance on a recipe class"))
            if node.func.id == "getattr" and node.args and ast.unparse(node.args[0]).endswith("recipe"):
                found.append((node.lineno, "getattr on a recipe"))
            if node.func.id == "is_fine_grained":
                found.append((node.lineno, "is_fine_grained"))
        if isinstance(node, ast.Attribute) and node.attr in RECIPE_FLAGS and "recipe" in ast.unparse(node.value):
            found.append((node.lineno, f"recipe.{node.attr}"))
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_mentions_kind(s) for s in sides) and any(
                _is_kind_operand(s) or (isinstance(s, (ast.Tuple, ast.List, ast.Set)) and any(map(_is_kind_operand, s.elts)))
                for s in sides
            ):
                found.append((node.lineno, "comparison of an operand kind"))
    return found


def test_the_scan_finds_each_form_of_branch():
    source = (
        "if isinstance(recipe, DelayedScaling): pass\n"
        "if module.fp8_recipe.per_tensor: pass\n"
        "if is_fine_grained(recipe): pass\n"
        "x = getattr(recipe, 'eps', 0.0)\n"
        "if q.kind == 'mx': pass\n"
        "if a.kind in ('row', 'block'): pass\n"
        "if kind is TENSOR: pass\n"
        "n = recipe.block_size\n"
    )
    assert [line for line, _ in recipe_branches(source)] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert recipe_branches("y = recipe.cast('input', x)\nz = q.kind.gemm(q, q, dtype)\n") == []


@pytest.mark.parametrize("path", _library_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_recipe_or_kind_branch_outside_recipes(path):
    branches = recipe_branches(path.read_text())
    assert not branches, f"{path.relative_to(ROOT)} branches on a recipe or kind (move it into a recipe): {branches}"


def test_operand_kinds_are_declared_once_and_found_by_name():
    from fp8_lightning.quantize import MX, OperandKind, Quantized

    assert OperandKind.named("mx") is MX and Quantized(torch.zeros(1), torch.ones(1), "mx").kind is MX
    with pytest.raises(ValueError, match="declared already"):
        OperandKind("mx")
    with pytest.raises(ValueError, match="'mxfp4' is unknown"):
        OperandKind.named("mxfp4")
    lonely = OperandKind("test_unimplemented_kind")
    with pytest.raises(NotImplementedError, match="must call OperandKind.implement"):
        lonely.gemm(None, None, torch.float32)
