"""Train an existing LightningModule in FP8 by changing one line.

The module below was written with no knowledge of fp8_lightning: plain ``nn.Linear`` layers, a plain
``training_step``. FP8 needs one changed line, the Trainer's ``precision`` (plus the import that registers the
``fp8-*`` strings with Lightning):

    trainer = Trainer(precision="32-true", ...)      # before
    trainer = Trainer(precision="fp8-hybrid", ...)   # after (or plugins=[fp8_lightning.FP8Precision(recipe=...)])

Run it (CPU, about a minute; --precision 32-true for the reference):

    python examples/plug_into_existing.py --precision fp8-hybrid
    python examples/plug_into_existing.py --precision fp8-mxfp8 --steps 300
"""

import argparse

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import fp8_lightning  # noqa: F401  (registers precision="fp8-hybrid", "fp8-e4m3", "fp8-tensorwise", "fp8-mxfp8")


# ---- an ordinary LightningModule: nothing below knows about FP8 ------------------------------------------
class Classifier(pl.LightningModule):
    def __init__(self, in_features: int = 64, hidden: int = 256, classes: int = 32, lr: float = 2e-3):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(in_features, hidden), nn.GELU(), nn.LayerNorm(hidden),
            nn.Linear(hidden, hidden), nn.GELU(), nn.LayerNorm(hidden),
            nn.Linear(hidden, classes),
        )

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def make_data(n: int, seed: int, in_features: int = 64, classes: int = 32) -> TensorDataset:
    """Gaussian clusters in 64 dimensions: a task a small MLP learns in a few hundred steps."""
    g = torch.Generator().manual_seed(0)  # the same cluster centres for train and validation
    centres = torch.randn(classes, in_features, generator=g) * 0.4  # overlapping: not solved in 10 steps
    g.manual_seed(seed)
    y = torch.randint(classes, (n,), generator=g)
    x = centres[y] + torch.randn(n, in_features, generator=g)
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--precision", default="fp8-hybrid", help="32-true, bf16-mixed, fp8-hybrid, fp8-mxfp8, ...")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()

    pl.seed_everything(0)
    model = Classifier()
    train = DataLoader(make_data(16_384, seed=1), batch_size=64, shuffle=True)
    val = DataLoader(make_data(2_048, seed=2), batch_size=256)
    trainer = pl.Trainer(
        precision=args.precision,  # <- the one line that changes
        accelerator="cpu", max_steps=args.steps, val_check_interval=args.steps, logger=False,
        enable_checkpointing=False, enable_model_summary=False,
    )
    trainer.fit(model, train, val)
    converted = [name for name, _ in fp8_lightning.fp8_modules(model)]
    print(f"precision={args.precision}: val_loss={trainer.callback_metrics['val_loss']:.4f} "
          f"val_acc={trainer.callback_metrics['val_acc']:.3f}; FP8 layers: {converted or 'none'}")


if __name__ == "__main__":
    main()
