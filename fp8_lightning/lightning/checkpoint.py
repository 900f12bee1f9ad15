"""Checking a Lightning checkpoint file before it is loaded, so that a damaged file gives one clear message.

``torch.load`` of a truncated file fails with whatever its reader meets first: ``EOFError: Ran out of input``,
``OSError: [Errno 22] Invalid argument`` or "PytorchStreamReader failed reading zip archive: failed finding central
directory"; a file with flipped bytes may even load, and train into NaN. Checkpoints written by ``torch.save``
(every Lightning checkpoint) are zip archives with a CRC-32 per record, so :func:`check_checkpoint_file` can tell
these cases apart by reading the archive's directory and, by default, every record's CRC (one sequential read of
the file, a fraction of what loading it costs)::

    from fp8_lightning.lightning.checkpoint import check_checkpoint_file
    check_checkpoint_file(ckpt_path)              # before trainer.fit(model, ckpt_path=ckpt_path)

``fp8-train`` runs it for ``ckpt_path=...``, and every ``Trainer`` or ``Fabric`` with an FP8 precision plugin runs
it before its strategy loads a checkpoint file (:func:`check_before_loading`, installed by the registration):
``trainer.fit(model, ckpt_path=...)``, ``fabric.load(path, state)``. The FP8 plugin's own entry in the checkpoint
carries a checksum of its own and is checked when it is loaded (:mod:`fp8_lightning.lightning.plugin_base`).
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any

_VERIFIED: dict[str, tuple[int, int]] = {}  # path -> (size, mtime_ns) of the last file that passed the full check


class CheckpointFileError(ValueError):
    """A checkpoint file that cannot be loaded; the message names the file, what is wrong and what to do."""


def check_checkpoint_file(path: str | os.PathLike, verify_contents: bool = True) -> None:
    """Raise :class:`CheckpointFileError` when ``path`` is missing, empty, truncated or corrupted.

    ``verify_contents`` also checks every record's CRC-32 (reads the whole file); without it only the archive's
    directory is read, which catches truncation. Directories (sharded checkpoints) are not checked.
    """
    path = Path(path)
    if path.is_dir():
        return
    if verify_contents and path.is_file() and _VERIFIED.get(str(path)) == _signature(path):
        return  # checked already (fp8-train checks before Trainer.fit loads it): one read of the file is enough
    if not path.exists():
        raise CheckpointFileError(
            f"Checkpoint {path} does not exist. Check the path (ckpt_path), or start without one to train from "
            "scratch."
        )
    size = path.stat().st_size
    others = _others(path)
    fix = (
        "It was probably cut short (a crash or a full disk while saving, or an incomplete copy). Resume from "
        f"another checkpoint{others} or start without ckpt_path."
    )
    if size == 0:
        raise CheckpointFileError(f"Checkpoint {path} is empty (0 bytes). {fix}")
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip() if verify_contents else None
    except zipfile.BadZipFile as err:
        raise CheckpointFileError(
            f"Checkpoint {path} ({size} bytes) is truncated or is not a checkpoint written by torch.save: its "
            f"archive directory cannot be read ({err}). {fix}"
        ) from err
    except (OSError, EOFError, ValueError) as err:
        raise CheckpointFileError(f"Checkpoint {path} ({size} bytes) cannot be read: {err}. {fix}") from err
    if bad is not None:
        raise CheckpointFileError(
            f"Checkpoint {path} is corrupted: record {bad!r} fails its CRC-32 check (bytes changed after it was "
            f"written). Resume from another checkpoint{others} or start without ckpt_path."
        )
    if verify_contents:
        _VERIFIED[str(path)] = _signature(path)


def _signature(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


class _CheckedLoad:
    """``strategy.load_checkpoint`` that runs :func:`check_checkpoint_file` on a local checkpoint file first.

    A class rather than a closure so that the strategy still pickles (``ddp_spawn`` sends the Trainer to its
    processes); it calls the class's own ``load_checkpoint``, whatever the instance attribute says."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Trainer strategies name the argument checkpoint_path, Fabric strategies path
        path = args[0] if args else kwargs.get("checkpoint_path", kwargs.get("path"))
        if isinstance(path, (str, os.PathLike)) and "://" not in str(path) and Path(path).is_file():
            check_checkpoint_file(path)  # a missing file or a remote URL stays the strategy's business
        return type(self.strategy).load_checkpoint(self.strategy, *args, **kwargs)


def check_before_loading(strategy: Any) -> None:
    """Make ``strategy`` check a checkpoint file with :func:`check_checkpoint_file` before it loads it, so that a
    truncated, empty or byte-flipped file gives one :class:`CheckpointFileError` naming it (not ``EOFError``, a
    miniz error, or a resume that trains into NaN). Idempotent; folders (sharded checkpoints), missing files and
    remote URLs are left to the strategy.

    Args:
        strategy: a ``lightning.pytorch`` or ``lightning.fabric`` strategy.
    """
    if strategy is None or isinstance(strategy.__dict__.get("load_checkpoint"), _CheckedLoad):
        return
    strategy.load_checkpoint = _CheckedLoad(strategy)


def _others(path: Path) -> str:
    """`` (for example a, b in <folder>)`` naming up to three other checkpoints next to ``path``, else ''."""
    try:
        siblings = sorted(p.name for p in path.parent.glob("*.ckpt") if p != path)
    except OSError:
        return ""
    return f" (for example {', '.join(siblings[-3:])} in {path.parent})" if siblings else ""
