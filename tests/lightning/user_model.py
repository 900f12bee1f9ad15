"""A LightningModule written the way a user writes one (nn.Linear / nn.LayerNorm transformer, its own
configure_optimizers), the small language-modelling task of ``fp8_lightning.testing``, and helpers that train it
with the Trainer or with Fabric. Shared by the Lightning integration tests."""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F

from fp8_lightning.lightning.testing import CausalLM  # noqa: F401 - re-exported
from fp8_lightning.testing import SEQ, VOCAB, loader, markov_tokens, trainer_kwargs  # noqa: F401 - re-exported


class Block(nn.Module):
    def __init__(self, d: int, heads: int, ff: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, ff), nn.Linear(ff, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(att)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyTransformerLM(L.LightningModule):
    def __init__(self, d: int = 64, layers: int = 2, heads: int = 4, ff: int = 128, lr: float = 3e-3):
        super().__init__()
        self.lr = lr
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.randn(SEQ, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads, ff) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB)
        self.losses: list[float] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, batch) -> torch.Tensor:
        (seq,) = batch
        logits = self(seq[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), seq[:, 1:].reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)


def fit_trainer(max_steps: int = 60, seed: int = 0, **trainer_overrides) -> TinyTransformerLM:
    """Train a fresh model from ``seed`` with ``L.Trainer(**trainer_overrides)``; returns the model."""
    L.seed_everything(seed, verbose=False)
    model = TinyTransformerLM()
    trainer = L.Trainer(max_steps=max_steps, **trainer_kwargs(**trainer_overrides))
    trainer.fit(model, loader())
    model.trainer_ref = trainer
    return model


def fit_fabric(max_steps: int = 60, seed: int = 0, **fabric_kwargs) -> tuple[TinyTransformerLM, list[float], L.Fabric]:
    """The same training loop written with Fabric."""
    L.seed_everything(seed, verbose=False)
    fabric = L.Fabric(accelerator="cpu", devices=1, **fabric_kwargs)
    model = TinyTransformerLM()
    optimizer = model.configure_optimizers()
    model, optimizer = fabric.setup(model, optimizer)
    losses, data = [], fabric.setup_dataloaders(loader())
    while len(losses) < max_steps:
        for batch in data:
            (seq,) = batch
            logits = model(seq[:, :-1])  # through the Fabric wrapper: its forward applies the precision
            loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), seq[:, 1:].reshape(-1))
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            losses.append(loss.item())
            if len(losses) == max_steps:
                break
    return model, losses, fabric


def final_loss(losses: list[float], last: int = 5) -> float:
    tail = losses[-last:]
    assert all(math.isfinite(x) for x in tail), tail
    return sum(tail) / len(tail)


def fit_causal_lm(factory, precision: str, steps: int, **kwargs) -> tuple[CausalLM, L.Trainer]:
    """``steps`` steps of ``CausalLM(factory)`` from seed 0 under ``precision``, 16 sequences per step."""
    L.seed_everything(0, verbose=False)
    module = CausalLM(factory)
    trainer = L.Trainer(max_steps=steps, precision=precision, **trainer_kwargs(**kwargs))
    trainer.fit(module, loader(n=steps * 16, batch_size=16))
    return module, trainer
