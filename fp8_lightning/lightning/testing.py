"""LightningModules shared by the test suite and the benchmarks (neither imports the other; both import this)."""

from __future__ import annotations

import lightning as L
import torch


class CausalLM(L.LightningModule):
    """A Hugging Face causal LM (built by ``factory``) trained on its own next-token loss of the batch's tokens,
    AdamW at 3e-3; each step's loss is kept in ``losses``.

    Args:
        factory: makes the model (e.g. ``lambda: transformers.LlamaForCausalLM(config)``).
    """

    def __init__(self, factory):
        super().__init__()
        self.model = factory()
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        (seq,) = batch
        loss = self.model(input_ids=seq, labels=seq).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.0)
