"""Byte-level language-modelling data: real text that needs no download.

Why this corpus: an FP8 training run should be reproducible on any machine, offline, in CI. Every Python
installation carries a few thousand ``.py`` files of its standard library (about 30 MB for CPython 3.11): real,
varied text with structure a small GPT can learn in minutes. Bytes are the tokens (vocabulary 256), so there is
no tokenizer to download or train either.

How it is split: by *file*, never inside a file, so validation text is never seen in training. The list of
files is sorted and shuffled with a fixed seed, so every machine with the same interpreter version gets the same
split. ``site-packages`` (third-party code that differs between machines) and byte-compiled caches are excluded.

How it is sampled: training draws ``block_size + 1``-byte windows at offsets chosen by a generator seeded with
``(seed, index)``, so a run is reproducible whatever the number of workers; validation uses fixed,
non-overlapping windows over the held-out files (capped by ``max_val_windows``).
"""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path
from typing import Sequence

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from fp8_lightning.data.resumable import ResumableDataLoader

EXCLUDED_DIRS = ("site-packages", "dist-packages", "__pycache__")


def check_counts(owner: str, **values: object) -> None:
    """Refuse sizes and counts that are not positive integers (``block_size=0`` divided by zero deep in the model,
    ``batch_size=0`` failed inside the DataLoader), naming the argument and the ``data.`` override that sets it."""
    for name, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(
                f"{owner}: {name}={value!r} is invalid; allowed: a positive integer. Set it to 1 or more (in "
                f"fp8-train: data.{name}=...)."
            )


def stdlib_dir() -> Path:
    """Directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_source_files(root: Path, pattern: str = "*.py") -> list[Path]:
    """Sorted files under ``root`` matching ``pattern``, without third-party or cache folders."""
    files = [p for p in root.rglob(pattern) if p.is_file() and not set(p.relative_to(root).parts) & set(EXCLUDED_DIRS)]
    return sorted(files)


def split_files(files: Sequence[Path], val_fraction: float, seed: int) -> tuple[list[Path], list[Path]]:
    """Deterministic train/validation split by file: at least one file on each side."""
    if len(files) < 2:
        raise ValueError(f"need at least 2 files to split into train and validation; found {len(files)}.")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 1).")
    order = list(files)
    random.Random(seed).shuffle(order)
    n_val = min(len(order) - 1, max(1, round(val_fraction * len(order))))
    return order[n_val:], order[:n_val]


def read_bytes(files: Sequence[Path], separator: bytes = b"\n\n") -> torch.Tensor:
    """Concatenated contents of ``files`` as a 1-D ``uint8`` tensor."""
    data = separator.join(Path(f).read_bytes() for f in files)
    if not data:  # torch.frombuffer refuses an empty buffer
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class RandomWindows(Dataset):
    """``num_samples`` random ``(x, y)`` windows of ``block_size`` bytes, reproducible per index."""

    def __init__(self, data: torch.Tensor, block_size: int, num_samples: int, seed: int):
        if data.numel() <= block_size + 1:
            raise ValueError(f"text of {data.numel()} bytes is too short for block_size={block_size}.")
        self.data, self.block_size, self.num_samples, self.seed = data, block_size, num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(self.data.numel() - self.block_size - 1, (1,), generator=g))
        return window(self.data, start, self.block_size)


class FixedWindows(Dataset):
    """Non-overlapping ``(x, y)`` windows from the start of ``data``, at most ``max_windows`` of them."""

    def __init__(self, data: torch.Tensor, block_size: int, max_windows: int | None = None):
        count = (data.numel() - 1) // block_size
        if count < 1:
            raise ValueError(f"text of {data.numel()} bytes is too short for block_size={block_size}.")
        self.data, self.block_size = data, block_size
        self.count = count if max_windows is None else min(count, max_windows)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return window(self.data, index * self.block_size, self.block_size)


def window(data: torch.Tensor, start: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    chunk = data[start : start + block_size + 1].long()
    return chunk[:-1], chunk[1:]


class ByteTextDataModule(pl.LightningDataModule):
    """Byte-level text from a folder of files; by default the running interpreter's standard library.

    Args:
        root: folder to read; ``None`` means the standard library (:func:`stdlib_dir`).
        pattern: glob of the files to read under ``root``.
        max_files: read at most this many files (after the deterministic shuffle); ``None`` reads all.
        train_samples: windows drawn per training epoch.
        max_val_windows: cap on validation windows (keeps validation fast on a CPU).
    """

    vocab_size = 256

    def __init__(
        self,
        root: str | None = None,
        pattern: str = "*.py",
        block_size: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.05,
        max_files: int | None = None,
        train_samples: int = 100_000,
        max_val_windows: int | None = 512,
        seed: int = 1234,
        num_workers: int = 0,
    ):
        super().__init__()
        check_counts(type(self).__name__, block_size=block_size, batch_size=batch_size, max_files=max_files,
                     train_samples=train_samples, max_val_windows=max_val_windows)
        self.save_hyperparameters(logger=False)
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.stats: dict[str, int] = {}

    def corpus_root(self) -> Path:
        root = Path(self.hparams.root).expanduser() if self.hparams.root else stdlib_dir()
        if not root.is_dir():
            raise FileNotFoundError(f"data.root={str(root)!r} is not a folder; give a folder of text files.")
        return root

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        root = self.corpus_root()
        files = list_source_files(root, hp.pattern)
        if hp.max_files is not None:
            files = sorted(random.Random(hp.seed).sample(files, min(hp.max_files, len(files))))
        if len(files) < 2:
            raise ValueError(
                f"data.root={str(root)!r} holds {len(files)} file(s) matching data.pattern={hp.pattern!r} (max_files="
                f"{hp.max_files}); at least 2 are needed, one for validation. Point data.root at a folder of text "
                "files, change data.pattern (e.g. data.pattern='*.txt'), or use data.root=null for the standard "
                "library."
            )
        train_files, val_files = split_files(files, hp.val_fraction, hp.seed)
        train_data, val_data = read_bytes(train_files), read_bytes(val_files)
        splits = (("training", train_data, len(train_files)), ("validation", val_data, len(val_files)))
        for split, data, count in splits:
            if data.numel() <= hp.block_size + 1:
                raise ValueError(
                    f"the {split} text under data.root={str(root)!r} is {data.numel()} bytes ({count} file(s) matching "
                    f"{hp.pattern!r}), too short for data.block_size={hp.block_size}: each sample needs "
                    f"block_size + 1 = {hp.block_size + 1} bytes and more. Add text (empty files count as nothing), "
                    "or lower data.block_size (and model.block_size with it)."
                )
        self.stats = {
            "train_files": len(train_files),
            "val_files": len(val_files),
            "train_bytes": train_data.numel(),
            "val_bytes": val_data.numel(),
        }
        self.train_set = RandomWindows(train_data, hp.block_size, hp.train_samples, hp.seed)
        self.val_set = FixedWindows(val_data, hp.block_size, hp.max_val_windows)

    def train_dataloader(self) -> DataLoader:
        return ResumableDataLoader(
            self.train_set,
            batch_size=self.hparams.batch_size,
            shuffle=False,  # windows are already random; no shuffle keeps the order reproducible
            num_workers=self.hparams.num_workers,
            drop_last=True,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, num_workers=self.hparams.num_workers)
