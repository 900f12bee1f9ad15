"""Data modules for ``fp8-train``: byte-level text (default: the standard library's sources) and synthetic tokens."""

from fp8_lightning.data.synthetic import SyntheticDataModule, markov_stream
from fp8_lightning.data.text import ByteTextDataModule, list_source_files, split_files, stdlib_dir

__all__ = [
    "ByteTextDataModule",
    "SyntheticDataModule",
    "list_source_files",
    "markov_stream",
    "split_files",
    "stdlib_dir",
]
