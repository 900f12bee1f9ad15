"""``fp8_autocast``: the switch that makes converted layers compute in FP8, usable without Lightning.

Like TransformerEngine's context, converted layers (see :func:`~fp8_lightning.convert.convert_to_fp8`) run
their GEMMs in FP8 inside the context and in ordinary high precision outside it; the choice is made at forward
time, so the backward of an FP8 forward is FP8 too, wherever ``loss.backward()`` is called::

    convert_to_fp8(model)
    with fp8_autocast(recipe=DelayedScaling(margin=1)):
        loss = model(x).sum()
    loss.backward()
    optimizer.step()

``recipe=None`` lets each layer use the recipe it was converted with; a recipe given here overrides it for the
layers called inside (each layer keeps separate scaling state per recipe). Contexts nest; the state is
per-thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Iterator

from fp8_lightning.recipes import Recipe, RecipeLike, recipe_from


@dataclasses.dataclass(frozen=True)
class AutocastState:
    enabled: bool = False
    recipe: Recipe | None = None
    recompute: bool = False  # set by an activation-checkpoint recompute that carries its forward's setting


_local = threading.local()
_OUTSIDE = AutocastState()  # made once: a frozen dataclass costs a microsecond to build, and layers ask every call


def autocast_state() -> AutocastState:
    """The innermost active ``fp8_autocast`` setting (disabled when none is active)."""
    return getattr(_local, "state", _OUTSIDE)


def is_fp8_enabled() -> bool:
    """Whether converted layers run in FP8 here (inside :func:`fp8_autocast`, and not disabled by a nested one).

    Returns:
        True inside ``fp8_autocast()`` (enabled), else False.
    """
    return autocast_state().enabled


def swap_autocast_state(state: AutocastState) -> AutocastState:
    """Put ``state`` in force on this thread and return the one it replaces (for contexts that restore it)."""
    previous = autocast_state()
    _local.state = state
    return previous


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, recipe: RecipeLike = None) -> Iterator[AutocastState]:
    """Run converted layers in FP8 (``enabled=True``) or in high precision (``enabled=False``) inside the block.

    Args:
        enabled: True for FP8, False for high precision (nested blocks restore the outer setting on exit).
        recipe: a recipe (object, name or dict) every converted layer uses inside, instead of its own.

    Returns:
        A context manager yielding the state in force.

    Raises:
        TypeError: ``enabled`` is not a bool.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"fp8_autocast(enabled={enabled!r}): expected True or False.")
    previous = autocast_state()  # a recompute's mark carries into nested blocks (fp8_lightning.recompute)
    new = AutocastState(enabled, recipe_from(recipe) if recipe is not None else None, previous.recompute)
    _local.state = new
    try:
        yield new
    finally:
        _local.state = previous
