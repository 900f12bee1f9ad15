"""The built wheel works outside the checkout: ``fp8-train`` finds its packaged configs, and another Hydra app
finds them through the search-path plugin.

The wheel is built from a copy of the sources (the checkout gets no ``build/`` folder), installed with
``pip install --target`` (dependencies come from this environment), and run from an unrelated folder with
``PYTHONPATH`` pointing at the installed copy, so ``fp8_lightning`` is imported from the wheel, not the checkout.
"""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.hydra.helpers import REPO

SOURCES = ("pyproject.toml", "README.md", "fp8_lightning", "kernels", "conf", "hydra_plugins")

USER_APP_CONFIG = """\
defaults:
  - precision: fp8_hybrid   # not in this folder: found through the fp8-lightning search-path plugin
  - _self_
note: my own app
"""

USER_APP = """\
import hydra
import fp8_lightning
from fp8_lightning.train import build_precision

@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def app(cfg):
    _, (plugin,) = build_precision(cfg)
    print("FROM", fp8_lightning.__file__)
    print("RECIPE", plugin.recipe)

app()
"""


def sh(cmd: list[str], cwd: Path, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(path, src / name)
    env = {**os.environ, "PIP_NO_INDEX": "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "2"}
    sh([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(root / "dist"),
        str(src)], cwd=root, env=env)
    (wheel,) = (root / "dist").glob("fp8_lightning-*.whl")
    site = root / "site"
    sh([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)], cwd=root, env=env)
    outside = root / "elsewhere"
    outside.mkdir()
    return wheel, site, outside, {**env, "PYTHONPATH": str(site)}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_wheel_contains_configs_and_plugin(installed):
    wheel, *_ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"fp8_lightning/conf/train.yaml", "fp8_lightning/conf/precision/fp8_mxfp8.yaml",
            "fp8_lightning/conf/experiment/smoke.yaml", "fp8_lightning/kernels/__init__.py",
            "hydra_plugins/fp8_lightning_searchpath/fp8_lightning_searchpath.py"} <= names
    assert "hydra_plugins/__init__.py" not in names  # a namespace package shared with other Hydra plugins


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_entry_point_runs_from_the_wheel(installed):
    _, site, outside, env = installed
    script = site / "bin" / "fp8-train"
    proc = sh([sys.executable, str(script), "experiment=smoke", "precision=fp8_hybrid", "trainer.max_steps=3",
               "precision.recipe.amax_history_len=4", "hydra.run.dir=run"], cwd=outside, env=env)
    assert "==== fp8-train summary (fp8-hybrid, 3 steps) ====" in proc.stdout
    sources = OmegaConf.load(outside / "run" / ".hydra" / "hydra.yaml").hydra.runtime.config_sources
    main_source = next(s for s in sources if s.provider == "main")
    assert (main_source.schema, main_source.path) == ("pkg", "fp8_lightning.conf")  # the packaged configs
    assert "amax_history_len: 4" in (outside / "run" / ".hydra" / "config.yaml").read_text()
    assert (outside / "run" / "summary.json").is_file()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_another_hydra_app_finds_the_precision_configs(installed):
    _, site, outside, env = installed
    app_dir = outside / "user_app"
    (app_dir / "conf").mkdir(parents=True)
    (app_dir / "conf" / "config.yaml").write_text(USER_APP_CONFIG)
    (app_dir / "app.py").write_text(USER_APP)
    proc = sh([sys.executable, "app.py", "precision.recipe.amax_history_len=32", "hydra.run.dir=out"],
              cwd=app_dir, env=env)
    assert f"FROM {site}" in proc.stdout
    assert "amax_history_len=32" in proc.stdout and "DelayedScaling" in proc.stdout
