"""``fp8-train`` killed with SIGKILL mid-epoch and resumed from its last checkpoint ends bit for bit where the
uninterrupted run ends: same final weights, same FP8 scaling state, same losses after the resume point. The data
module's training loader restores its position (without it, the resumed run replays the epoch's first batches)."""

import os
import subprocess
import sys
from pathlib import Path

import torch

from fp8_lightning import train
from tests.hydra.helpers import compose_config

REPO = Path(__file__).resolve().parents[2]
RUN = [
    "data.max_files=40", "data.max_val_windows=16", "trainer.max_steps=12", "trainer.val_check_interval=4",
    "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "logger=none",
    "~callbacks.lr_monitor", "~callbacks.fp8_stats", "model.n_layer=1", "data.block_size=64",
]  # fmt: skip
KILL_AT = 10  # after the step-8 checkpoint, before the step-12 one


def _start_killed(out: Path) -> subprocess.Popen:
    """``fp8-train`` in a fresh interpreter that kills itself at step ``KILL_AT``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-m", "fp8_lightning.train", *RUN, f"paths.output_dir={out}",
            "+callbacks.kill._target_=tests.data.kill_switch.KillAtStep", f"+callbacks.kill.step={KILL_AT}"]  # fmt: skip
    return subprocess.Popen(args, cwd=out.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _run_here(out: Path, *extra: str) -> dict:
    """``fp8-train`` in this process (no interpreter start): the run's summary."""
    torch.set_num_threads(1)
    return train.run(compose_config(out, *RUN, *extra))


def test_sigkilled_run_resumes_bit_for_bit(tmp_path, recwarn):
    full, crashed, resumed = tmp_path / "full", tmp_path / "crashed", tmp_path / "resumed"
    killed = _start_killed(crashed)  # runs while the uninterrupted run trains here
    want = _run_here(full)
    output, _ = killed.communicate(timeout=300)
    assert killed.returncode == -9, output[-3000:]  # SIGKILL: no teardown, no checkpoint at the end
    last = crashed / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 8
    got = _run_here(resumed, f"ckpt_path={last}")
    assert not [w for w in recwarn if "not resumable" in str(w.message)]

    assert got["steps"] == want["steps"] == 12
    assert got["val_loss"] == want["val_loss"]
    assert [p for p in got["train_loss_curve"] if p[0] > 8] == [p for p in want["train_loss_curve"] if p[0] > 8]
    a, b = (torch.load(d / "checkpoints" / "last.ckpt", weights_only=False) for d in (full, resumed))
    assert a["global_step"] == b["global_step"] == 12
    for name, tensor in a["state_dict"].items():
        assert torch.equal(tensor, b["state_dict"][name]), name
    _assert_equal(a["FP8Precision"], b["FP8Precision"])  # amax histories, scales, step counters


def _assert_equal(a, b, where: str = "") -> None:
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_equal(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}/{i}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where
