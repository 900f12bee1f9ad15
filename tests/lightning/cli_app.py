"""A LightningCLI program as most Lightning projects write one; the only FP8-specific line is the import."""

import torch
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

import fp8_lightning  # noqa: F401  (registers the precision strings)


class Model(BoringModel):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(32, 32)  # BoringModel's Linear(32, 2) is too narrow for FP8 GEMM layouts

    def on_train_end(self):
        plugin = self.trainer.precision_plugin
        print(f"precision={self.trainer.precision} plugin={type(plugin).__name__} "
              f"converted={plugin.conversion_report.converted} steps={plugin.optimizer_steps}")  # fmt: skip


if __name__ == "__main__":
    LightningCLI(Model, BoringDataModule)
