"""FP8OptimizerStates: an unchanged LightningModule gets FP8 optimizer states (single device, resume, DDP)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from fp8_lightning.lightning.optimizer_callback import FP8OptimizerStates
from fp8_lightning.optim import FP8Optimizer
from fp8_lightning.testing import free_port
from tests.optim.lightning_app import UserLM, loader, trainer

REPO = Path(__file__).resolve().parents[2]


def callback():
    return FP8OptimizerStates("default", min_quantize_numel=1024)


def test_callback_wraps_the_modules_adamw_and_keeps_its_scheduler():
    pl.seed_everything(0, verbose=False)
    model = UserLM()
    t = trainer(max_steps=8, callbacks=[callback()])
    t.fit(model, loader(batches=8))
    opt = t.optimizers[0]
    assert isinstance(opt, FP8Optimizer) and isinstance(opt.optimizer, torch.optim.AdamW)
    assert opt.state[model.body[0].weight]["exp_avg"].dtype == torch.float8_e4m3fn
    assert opt.state[model.head.bias]["exp_avg"].dtype == torch.float32  # 64 elements: full precision
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.9**8)  # StepLR on the inner optimizer, every step
    assert sum(model.losses[-2:]) < sum(model.losses[:2])


def test_callback_leaves_unsupported_optimizers_alone_with_a_warning():
    class RMSpropLM(UserLM):
        def configure_optimizers(self):
            return torch.optim.RMSprop(self.parameters(), lr=1e-3)

    t = trainer(max_steps=1, callbacks=[callback()])
    with pytest.warns(UserWarning, match="Adam, AdamW, SGD"):
        t.fit(RMSpropLM(), loader(batches=1))
    assert isinstance(t.optimizers[0], torch.optim.RMSprop)
    with pytest.raises(TypeError, match="Adam, AdamW, SGD"):
        trainer(max_steps=1, callbacks=[FP8OptimizerStates(strict=True)]).fit(RMSpropLM(), loader(batches=1))


def test_resumed_fit_reproduces_the_uninterrupted_losses(tmp_path):
    """2 epochs of 4 steps in one go == 1 epoch, checkpoint, resume for the 2nd (FP8 states saved exactly)."""
    pl.seed_everything(0, verbose=False)
    straight = UserLM()
    trainer(max_epochs=2, callbacks=[callback()]).fit(straight, loader())

    pl.seed_everything(0, verbose=False)
    first = UserLM()
    t1 = trainer(max_epochs=1, callbacks=[callback()])
    t1.fit(first, loader())
    ckpt = tmp_path / "epoch1.ckpt"
    t1.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)["optimizer_states"][0]
    assert "fp8_optimizer" in saved  # the FP8 states, not float32 ones

    pl.seed_everything(1, verbose=False)
    resumed = UserLM()  # other initial weights: everything must come from the checkpoint
    trainer(max_epochs=2, callbacks=[callback()]).fit(resumed, loader(), ckpt_path=ckpt)
    assert first.losses + resumed.losses == straight.losses
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_two_gloo_processes(tmp_path):
    # Lightning would draw its rendezvous port from the ephemeral range, where a gloo test running beside this one
    # can take it first; the rendezvous then waits on the other test's store until the timeout
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    result = subprocess.run([sys.executable, "tests/optim/lightning_app.py", str(tmp_path)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert rank["optimizer"] == "FP8Optimizer" and rank["exp_avg_dtype"] == "torch.float8_e4m3fn"
        assert rank["lr"] == pytest.approx(1e-2 * 0.9**6)
    # gradients are all-reduced, the FP8 state update is deterministic: replicas stay identical
    assert ranks[0]["checksum"] == ranks[1]["checksum"]
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]


def test_release_gradients_trains_identically_and_refuses_clipping():
    pl.seed_everything(0, verbose=False)
    regular = UserLM()
    trainer(max_steps=4, callbacks=[callback()]).fit(regular, loader())
    pl.seed_everything(0, verbose=False)
    released = UserLM()
    released_cb = FP8OptimizerStates("default", min_quantize_numel=1024, release_gradients=True)
    trainer(max_steps=4, callbacks=[released_cb]).fit(released, loader())
    assert released.losses == regular.losses
    assert all(p.grad is None for p in released.parameters())
    with pytest.raises(ValueError, match="gradient_clip_val"):
        trainer(max_steps=1, gradient_clip_val=1.0, callbacks=[released_cb]).fit(UserLM(), loader())
