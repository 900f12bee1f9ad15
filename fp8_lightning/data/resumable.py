"""A ``DataLoader`` that Lightning resumes mid-epoch, so a run restarted from any checkpoint sees the batches the
uninterrupted run would have seen.

Lightning saves a training dataloader's state in the checkpoint (and hands it back before the next ``iter()``)
when the loader has ``state_dict`` / ``load_state_dict``; otherwise a resumed run replays its epoch from the
first batch ("your dataloader is not resumable"). The state kept here is one number: how many batches the
current pass has yielded. Restoring it makes the next pass skip that many batches, after which passes start at
the beginning again.

Why counting is enough: Lightning asks for the state while the training loop holds the batch it has just taken
(a sized loader is not prefetched by Lightning's fetcher), so "yielded" equals "consumed"; and the datasets of
this package give every index the same sample whoever reads it (windows drawn from a generator seeded by the
index), so a pass that starts at batch ``k`` is the uninterrupted pass from ``k`` on. Skipped batches are read
and dropped (workers and samplers stay exactly as torch builds them, DDP's sampler included); reading a window
costs microseconds, not a training step.
"""

from __future__ import annotations

from typing import Any, Iterator

from torch.utils.data import DataLoader


class ResumableDataLoader(DataLoader):
    """``torch.utils.data.DataLoader`` (same arguments) with Lightning's ``state_dict`` / ``load_state_dict``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._yielded = 0  # batches of the current pass handed out
        self._resume_at = 0  # batches the next pass skips (set by load_state_dict)

    def __iter__(self) -> Iterator[Any]:
        skip, self._resume_at = self._resume_at, 0
        self._yielded = 0
        for index, batch in enumerate(super().__iter__()):
            if index < skip:
                continue
            self._yielded = index + 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"batches_yielded": self._yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if "batches_yielded" not in state:
            raise KeyError(f"ResumableDataLoader state needs 'batches_yielded'; got keys {sorted(state)}.")
        done = int(state["batches_yielded"])
        try:
            finished = done >= len(self)
        except TypeError:  # an iterable dataset without a length
            finished = False
        self._resume_at = 0 if finished else done  # a finished pass resumes at a new one
