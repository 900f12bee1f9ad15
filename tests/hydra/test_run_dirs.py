"""Every fp8-train run gets its own output folder, even when two start in the same second."""

import json
import os
import subprocess
import sys

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from .helpers import CONF, REPO

_PRINT_RUN_DIR = f"""
import json
from hydra import compose, initialize_config_dir
with initialize_config_dir(version_base="1.3", config_dir={str(CONF)!r}):
    cfg = compose("train", return_hydra_config=True)
print(json.dumps([cfg.hydra.run.dir, cfg.hydra.sweep.dir]))
"""


def _run_dir() -> str:
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
            cfg = compose("train", return_hydra_config=True)
            return OmegaConf.to_container(cfg.hydra.run, resolve=True)["dir"]
    finally:
        GlobalHydra.instance().clear()


def test_two_compositions_in_the_same_second_get_different_run_folders():
    """Guards against two runs started in the same second sharing one Hydra folder (mixed checkpoints and
    summaries): the folder name carries the time to the microsecond and the process id."""
    first, second = _run_dir(), _run_dir()
    assert first != second
    assert first.endswith(f"_{os.getpid()}") and second.endswith(f"_{os.getpid()}")


def test_two_processes_started_together_get_different_run_folders():
    """Guards the same for two processes (what two fp8-train commands are), run and sweep folders alike."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", _PRINT_RUN_DIR], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    (run_a, sweep_a), (run_b, sweep_b) = outs
    assert run_a != run_b and sweep_a != sweep_b
    assert {run_a.rsplit("_", 1)[1], run_b.rsplit("_", 1)[1]} == {str(p.pid) for p in procs}


def test_ranks_started_by_torchrun_without_a_run_folder_are_warned(monkeypatch):
    """Guards the other side of unique folders: under torchrun every rank composes its own, so without
    hydra.run.dir each rank writes a folder of its own; rank 0 warns once and names the fix."""
    import warnings

    import pytest

    from fp8_lightning.train import check_run_folder

    default = OmegaConf.create({"paths": {"output_dir": f"outputs/train/2026-11-27_10-00-00.123456_{os.getpid()}"}})
    chosen = OmegaConf.create({"paths": {"output_dir": "outputs/torchrun/job42"}})
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.warns(UserWarning, match=r"one of 2 processes .* hydra.run.dir=outputs/<name>"):
        check_run_folder(default)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_run_folder(chosen)  # one folder named for all ranks
        monkeypatch.setenv("RANK", "1")
        check_run_folder(default)  # rank 0 speaks for all
        monkeypatch.delenv("WORLD_SIZE")
        monkeypatch.setenv("RANK", "0")
        check_run_folder(default)  # one process
