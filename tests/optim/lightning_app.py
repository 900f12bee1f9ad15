"""A user's LightningModule (its own AdamW + scheduler, no FP8 code) and a runnable DDP script for the tests.

``python tests/optim/lightning_app.py OUT_DIR`` trains it with ``strategy="ddp"`` on 2 CPU processes (gloo) with
the ``FP8OptimizerStates`` callback and writes one JSON file per rank (losses, parameter checksum, state dtypes).
Lightning's launcher re-runs this file for rank 1, which is why it is a script and not a pytest body.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

VOCAB, SEQ, WIDTH = 64, 16, 64


class UserLM(pl.LightningModule):
    """Token-level MLP language model; ``configure_optimizers`` returns plain AdamW with a StepLR."""

    def __init__(self, lr: float = 1e-2):
        super().__init__()
        self.lr = lr
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.body = nn.Sequential(nn.Linear(WIDTH, 128), nn.GELU(), nn.Linear(128, WIDTH), nn.LayerNorm(WIDTH))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.losses: list[float] = []

    def forward(self, tokens):
        return self.head(self.body(self.embed(tokens)))

    def training_step(self, batch, batch_idx):
        (seq,) = batch
        loss = F.cross_entropy(self(seq[:, :-1]).reshape(-1, VOCAB), seq[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def markov_tokens(n: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(VOCAB, VOCAB, generator=g) * 3.0, dim=-1)
    seq = torch.empty(n, SEQ + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(SEQ):
        seq[:, t + 1] = torch.multinomial(probs[seq[:, t]], 1, generator=g).squeeze(1)
    return seq


def loader(batches: int = 4, batch_size: int = 8) -> DataLoader:
    return DataLoader(TensorDataset(markov_tokens(batches * batch_size)), batch_size=batch_size, shuffle=False)


def trainer(**kwargs) -> pl.Trainer:
    defaults = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    return pl.Trainer(**{**defaults, **kwargs})


def run_ddp(out_dir: str) -> None:
    from fp8_lightning.lightning.optimizer_callback import FP8OptimizerStates

    pl.seed_everything(0, verbose=False)
    torch.set_num_threads(1)
    model = UserLM()
    t = trainer(devices=2, strategy="ddp", max_steps=6, callbacks=[FP8OptimizerStates("default",
                                                                                      min_quantize_numel=1024)])
    t.fit(model, loader(batches=12))
    opt = t.optimizers[0]
    weight = model.body[0].weight
    result = {
        "rank": t.global_rank,
        "optimizer": type(opt).__name__,
        "losses": model.losses,
        "checksum": sum(p.double().sum().item() for p in model.parameters()),
        "exp_avg_dtype": str(opt.state[weight]["exp_avg"].dtype),
        "lr": opt.param_groups[0]["lr"],
    }
    Path(out_dir, f"rank{t.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    run_ddp(sys.argv[1])
