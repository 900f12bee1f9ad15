"""Synthetic token data for tests and smoke runs: instant, deterministic, learnable.

A stream of tokens is drawn from a random first-order Markov chain in which every token has only ``branching``
possible successors. The entropy of the next token is therefore at most ``log(branching)`` nats, far below the
``log(vocab_size)`` of a uniform guess, so a few optimizer steps visibly lower the loss: a smoke test can check
that training *learns* without reading any file. Everything derives from ``seed``.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from fp8_lightning.data.resumable import ResumableDataLoader
from fp8_lightning.data.text import FixedWindows, RandomWindows, check_counts


def markov_stream(length: int, vocab_size: int, branching: int, seed: int) -> torch.Tensor:
    """``length`` tokens from a random chain where each token has ``branching`` equally likely successors."""
    if not 1 <= branching <= vocab_size:
        raise ValueError(f"branching={branching} must be in [1, vocab_size={vocab_size}].")
    g = torch.Generator().manual_seed(seed)
    successors = torch.stack([torch.randperm(vocab_size, generator=g)[:branching] for _ in range(vocab_size)])
    choices = torch.randint(branching, (length,), generator=g).tolist()
    table = successors.tolist()
    token = int(torch.randint(vocab_size, (1,), generator=g))
    out = []
    for choice in choices:  # plain python lists: ~1e5 steps take a few milliseconds
        token = table[token][choice]
        out.append(token)
    return torch.tensor(out, dtype=torch.long)


class SyntheticDataModule(pl.LightningDataModule):
    """Markov-chain token windows; ``entropy_floor`` is the best achievable loss (nats per token)."""

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 64,
        batch_size: int = 8,
        branching: int = 4,
        train_tokens: int = 65_536,
        val_tokens: int = 8_192,
        train_samples: int = 4_096,
        seed: int = 1234,
    ):
        super().__init__()
        check_counts(type(self).__name__, vocab_size=vocab_size, block_size=block_size, batch_size=batch_size,
                     branching=branching, train_tokens=train_tokens, val_tokens=val_tokens, train_samples=train_samples)
        self.save_hyperparameters(logger=False)
        self.vocab_size = vocab_size
        self.entropy_floor = math.log(branching)
        self.train_set = self.val_set = None
        self.stats: dict[str, int] = {}

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        stream = markov_stream(hp.train_tokens + hp.val_tokens, hp.vocab_size, hp.branching, hp.seed)
        train, val = stream[: hp.train_tokens], stream[hp.train_tokens :]
        self.stats = {"train_tokens": train.numel(), "val_tokens": val.numel()}
        self.train_set = RandomWindows(train, hp.block_size, hp.train_samples, hp.seed)
        self.val_set = FixedWindows(val, hp.block_size)

    def train_dataloader(self) -> DataLoader:
        return ResumableDataLoader(self.train_set, batch_size=self.hparams.batch_size, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)
