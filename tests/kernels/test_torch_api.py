"""The CUDA branch calls only torch names recorded as present in torch 2.11 (the GPU machines' torch, and
pyproject's lower bound), while CI tests torch 2.13: a name new to the code fails here until someone checks that
torch 2.11 has it and records it in ``torch_2_11_api.txt``.

Names are read from the source (``ast``): ``torch.a.b`` attribute chains, ``import torch.x as y`` and
``from torch.x import y`` (then ``y.z``), in the package, the kernels and the benchmarks the GPU session runs.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECORD = Path(__file__).with_name("torch_2_11_api.txt")
GPU_SESSION_SCRIPTS = (
    "gpu_check", "kernels_gpu", "fsdp_gpu_check", "bench_linear", "bench_gpt", "bench_common",
)
OWN_NAMESPACES = ("torch.ops.fp8_lightning",)  # the project's own custom ops


def cuda_branch_files() -> list[Path]:
    return sorted([*(REPO / "fp8_lightning").rglob("*.py"), *(REPO / "kernels").glob("*.py"),
                   *(REPO / "benchmarks" / f"{name}.py" for name in GPU_SESSION_SCRIPTS)])  # fmt: skip


def torch_names(source: str) -> set[str]:
    """Every dotted torch name ``source`` reaches, longest chains only (``torch.nn.functional.pad``, not
    ``torch.nn``)."""
    tree = ast.parse(source)
    alias, names = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for item in node.names:
                if item.name.split(".")[0] == "torch":
                    alias[item.asname or "torch"] = item.name if item.asname else "torch"
                    names.add(item.name)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            for item in node.names:
                alias[item.asname or item.name] = f"{node.module}.{item.name}"
                names.add(f"{node.module}.{item.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts, base = [], node
            while isinstance(base, ast.Attribute):
                parts.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in alias:
                names.add(".".join([alias[base.id], *reversed(parts)]))
    return {n for n in names if not any(other.startswith(n + ".") for other in names)}


def recorded() -> dict[str, str]:
    """name -> note, from the record file."""
    entries = {}
    for line in RECORD.read_text().splitlines():
        name, _, note = line.partition("#")
        if name.strip():
            entries[name.strip()] = note.strip()
    return entries


def resolve(name: str):
    """The object a dotted name denotes in the installed torch (modules imported as needed)."""
    parts = name.split(".")
    obj = importlib.import_module(parts[0])
    for index, part in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[: index + 1]))
    return obj


def test_the_name_reader_sees_chains_aliases_and_from_imports():
    source = (
        "import torch\nimport torch.distributed as dist\nfrom torch.distributed.fsdp import fully_shard\n"
        "from torch import nn\nx = torch.nn.functional.pad(y)\ndist.all_reduce(t)\nnn.Linear\nfully_shard(m)\n"
    )
    assert torch_names(source) == {
        "torch.nn.functional.pad", "torch.distributed.all_reduce", "torch.distributed.fsdp.fully_shard",
        "torch.nn.Linear",
    }  # fmt: skip


def test_every_torch_name_the_cuda_branch_uses_is_recorded_for_torch_2_11():
    record = recorded()
    missing = {}
    for path in cuda_branch_files():
        for name in torch_names(path.read_text()):
            if name not in record and not name.startswith(OWN_NAMESPACES):
                missing.setdefault(name, path.relative_to(REPO).as_posix())
    assert not missing, (
        "torch names not recorded as present in torch 2.11 (check each there, then add it to "
        f"{RECORD.relative_to(REPO)}): " + ", ".join(f"{n} ({p})" for n, p in sorted(missing.items()))
    )


def test_recorded_names_exist_in_the_installed_torch():
    unresolved = []
    for name, note in recorded().items():
        try:
            resolve(name)
        except (AttributeError, ImportError):
            if not note.startswith("optional"):  # looked up with a default where it is used
                unresolved.append(name)
    assert not unresolved, f"recorded names this torch lacks (a typo, or removed since 2.11?): {unresolved}"


def test_pyproject_lower_bound_is_the_recorded_version():
    pyproject = (REPO / "pyproject.toml").read_text()
    lower = re.search(r'"torch>=([0-9.]+)', pyproject)
    assert lower is not None and lower.group(1) == "2.11", "the record lists torch 2.11's names; keep them in step"
