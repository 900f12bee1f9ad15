"""``fp8-train`` killed with SIGKILL mid-epoch and resumed from its last checkpoint ends bit for bit where the
uninterrupted run ends: same final weights, same FP8 scaling state, same losses after the resume point. The data
module's training loader restores its position (without it, the resumed run replays the epoch's first batches)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
RUN = [
    "data.max_files=40", "data.max_val_windows=16", "trainer.max_steps=12", "trainer.val_check_interval=4",
    "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "logger=none",
    "~callbacks.lr_monitor", "~callbacks.fp8_stats", "model.n_layer=1", "data.block_size=64",
]  # fmt: skip
KILL_AT = 10  # after the step-8 checkpoint, before the step-12 one


def _start(out: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-m", "fp8_lightning.train", *RUN, f"paths.output_dir={out}", *extra]
    return subprocess.Popen(args, cwd=out.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    output, _ = proc.communicate(timeout=300)
    return proc.returncode, output


def test_sigkilled_run_resumes_bit_for_bit(tmp_path):
    full, crashed, resumed = tmp_path / "full", tmp_path / "crashed", tmp_path / "resumed"
    runs = [_start(full), _start(crashed, "+callbacks.kill._target_=tests.data.kill_switch.KillAtStep",
                                  f"+callbacks.kill.step={KILL_AT}")]  # fmt: skip
    (full_rc, full_log), (crash_rc, _) = (_finish(p) for p in runs)
    assert full_rc == 0, full_log[-3000:]
    assert crash_rc == -9  # SIGKILL: no teardown, no checkpoint at the end
    last = crashed / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 8
    rc, log = _finish(_start(resumed, f"ckpt_path={last}"))
    assert rc == 0, log[-3000:]
    assert "not resumable" not in log

    want, got = (json.loads((d / "summary.json").read_text()) for d in (full, resumed))
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
