"""A LightningCLI program as most Lightning projects write one; the only FP8-specific line is the import."""

import fp8_lightning  # noqa: F401  (registers the precision strings)
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel


class Model(BoringModel):
    def __init__(self):
        super().__init__()
        self.layer = __import__("torch").nn.Linear(32, 32)  # FP8 needs dimensions divisible by 32 for MXFP8

    def on_train_end(self):
        plugin = self.trainer.precision_plugin
        print(f"precision={self.trainer.precision} plugin={type(plugin).__name__} "
              f"converted={plugin.conversion_report.converted} steps={plugin.optimizer_steps}")  # fmt: skip


if __name__ == "__main__":
    LightningCLI(Model, BoringDataModule)
