"""A callback that ends its process with SIGKILL (no cleanup, no final checkpoint) when training reaches a step:
the crash the resume test recovers from."""

import os
import signal

import lightning.pytorch as pl


class KillAtStep(pl.Callback):
    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
