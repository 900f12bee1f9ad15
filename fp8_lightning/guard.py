"""The divergence guard: move a layer that is in numerical trouble back to high precision, for good.

FP8 runs usually diverge in a few layers first: an activation outlier saturates a stale delayed scale, or a
spike pushes the amax history so high that the scale flushes most of a tensor to zero. Each optimizer step the
guard reads the step's :class:`~fp8_lightning.stats.OperandStats` of every converted layer and decides:

* a **non-finite amax** (NaN/inf in an input, weight or output gradient) disables the layer at once. A NaN
  spreads: forward to every later layer's input, backward to every earlier layer's output gradient. Only its
  origin, the operand that held it *first* in the step (``OperandStats.order``), is blamed;
* an **overflow** (saturated) or **underflow** (flushed to zero) fraction above its threshold for ``patience``
  consecutive steps disables the layer. Saturation counts only when the largest value exceeded the FP8 max by
  at least ``min_overflow_ratio`` (2x by default): early in training Adam moves every weight of a
  uniformly initialised layer a little past last step's amax each step, which clamps a percent or two of the
  weights by a few percent, a harmless and expected effect of delayed scaling.

A disabled layer runs ``F.linear`` in high precision for the rest of the run (``layer.fp8_disabled_reason``
holds the reason, which :func:`~fp8_lightning.saved_state.fp8_state_dict` saves in checkpoints). Each decision is a
:class:`GuardEvent`. The streak counters and events are part of :meth:`GuardState.state_dict`, so a resumed
run keeps counting where it stopped.

:class:`DivergenceGuard` is the configuration (frozen, hashable, YAML-friendly); :class:`GuardState` is the
mutable part. The decision itself is a pure function of the previous streaks and the step's statistics.
This module never imports Lightning.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from fp8_lightning.stats import OperandStats


@dataclasses.dataclass(frozen=True)
class DivergenceGuard:
    """When to give up FP8 for a layer.

    Args:
        overflow_threshold: fraction of an operand's elements saturated in one step above which the step counts
            as an overflow step (0.01: 1% of the values clamped).
        underflow_threshold: fraction of an operand's non-zero elements flushed to zero above which the step
            counts as an underflow step.
        patience: consecutive offending steps before the layer falls back (non-finite amaxes act at once).
        min_overflow_ratio: an overflow step also needs ``amax * scale >= min_overflow_ratio * fp8_max``.
        skip_nonfinite_step: drop the gradients of a step whose FP8 operands held NaN/inf, so that one bad batch
            does not poison the weights (the optimizer skips parameters without gradients).
    """

    overflow_threshold: float = 0.01
    underflow_threshold: float = 0.5
    patience: int = 3
    min_overflow_ratio: float = 2.0
    skip_nonfinite_step: bool = True

    def __post_init__(self) -> None:
        for name in ("overflow_threshold", "underflow_threshold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ValueError(f"DivergenceGuard.{name}={value!r} is invalid; allowed: a fraction in [0, 1].")
        if isinstance(self.patience, bool) or not isinstance(self.patience, int) or self.patience < 1:
            raise ValueError(f"DivergenceGuard.patience={self.patience!r} is invalid; allowed: an integer >= 1.")
        if isinstance(self.min_overflow_ratio, bool) or not isinstance(self.min_overflow_ratio, (int, float)) or (
            self.min_overflow_ratio < 1
        ):
            raise ValueError(
                f"DivergenceGuard.min_overflow_ratio={self.min_overflow_ratio!r} is invalid; allowed: a number >= 1."
            )
        if not isinstance(self.skip_nonfinite_step, bool):
            raise ValueError(
                f"DivergenceGuard.skip_nonfinite_step={self.skip_nonfinite_step!r} is invalid; allowed: True or False."
            )

    @classmethod
    def from_arg(cls, value: "DivergenceGuard | bool | Mapping[str, Any] | None") -> "DivergenceGuard | None":
        """``None``/``False``: no guard; ``True``: defaults; a dict (YAML): its fields; a guard: itself."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - known - {"_target_"})
            if unknown:
                raise ValueError(f"DivergenceGuard got unknown field(s) {unknown}; allowed: {sorted(known)}.")
            return cls(**{k: v for k, v in value.items() if k in known})
        raise TypeError(
            f"divergence_guard={value!r} ({type(value).__name__}) is invalid; pass True, False/None, a "
            "DivergenceGuard or a dict of its fields."
        )


@dataclasses.dataclass(frozen=True)
class GuardEvent:
    """One fallback decision: at optimizer step ``step`` layer ``layer`` left FP8 because of ``reason``."""

    step: int
    layer: str
    role: str
    kind: str  # "nonfinite", "overflow" or "underflow"
    reason: str


# --------------------------------------------------------------------------------------------------------
# The decision (pure)
# --------------------------------------------------------------------------------------------------------


def offending_kinds(stats: OperandStats, config: DivergenceGuard) -> list[str]:
    """Which limits one operand's step statistics break."""
    kinds = []
    if stats.nonfinite:
        kinds.append("nonfinite")
    far_out = stats.amax * stats.scale >= config.min_overflow_ratio * stats.fp8_max
    if stats.overflow > config.overflow_threshold and far_out:
        kinds.append("overflow")
    if stats.underflow > config.underflow_threshold:
        kinds.append("underflow")
    return kinds


def nonfinite_origin(stats: Mapping[tuple[str, str], OperandStats], disabled: set[str] = frozenset()):
    """The (layer, role) whose operand was the first non-finite one of the step, or None."""
    bad = [(s.order, key) for key, s in stats.items() if s.nonfinite and key[0] not in disabled]
    return min(bad)[1] if bad else None


def decide(
    step: int,
    stats: Mapping[tuple[str, str], OperandStats],
    streaks: Mapping[str, int],
    config: DivergenceGuard,
    disabled: set[str] = frozenset(),
) -> tuple[dict[str, int], list[GuardEvent]]:
    """New streak counters (key ``"layer|role|kind"``) and the fallback events of this step.

    A streak grows by one for every step in which the operand breaks the limit and restarts at 0 otherwise;
    layers already in ``disabled`` are ignored. At most one event per layer per step.
    """
    new_streaks: dict[str, int] = {}
    events: dict[str, GuardEvent] = {}
    origin = nonfinite_origin(stats, disabled)
    for (layer, role), s in stats.items():
        if layer in disabled:
            continue
        for kind in offending_kinds(s, config):
            if kind == "nonfinite" and (layer, role) != origin:
                continue  # carried here from the origin; not this layer's fault
            key = f"{layer}|{role}|{kind}"
            count = streaks.get(key, 0) + 1
            new_streaks[key] = count
            if layer in events:
                continue
            if kind == "nonfinite":
                reason = f"non-finite amax in {role} at step {step}"
            elif count >= config.patience:
                value = s.overflow if kind == "overflow" else s.underflow
                limit = config.overflow_threshold if kind == "overflow" else config.underflow_threshold
                reason = (
                    f"{role} {kind} fraction above {limit:g} for {count} consecutive steps "
                    f"(last {value:.3g}) at step {step}"
                )
            else:
                continue
            events[layer] = GuardEvent(step, layer, role, kind, reason)
    return new_streaks, list(events.values())


# --------------------------------------------------------------------------------------------------------
# Mutable state
# --------------------------------------------------------------------------------------------------------


class GuardState:
    """Streak counters and the history of fallback events of one run."""

    def __init__(self, config: DivergenceGuard):
        self.config = config
        self.streaks: dict[str, int] = {}
        self.events: list[GuardEvent] = []

    @property
    def disabled_layers(self) -> set[str]:
        return {e.layer for e in self.events}

    def step(self, step: int, stats: Mapping[tuple[str, str], OperandStats]) -> list[GuardEvent]:
        """Feed one optimizer step's statistics; returns the new fallback events (already recorded)."""
        self.streaks, new = decide(step, stats, self.streaks, self.config, self.disabled_layers)
        self.events.extend(new)
        return new

    def state_dict(self) -> dict:
        return {"streaks": dict(self.streaks), "events": [dataclasses.asdict(e) for e in self.events]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.streaks = dict(state.get("streaks", {}))
        self.events = [GuardEvent(**e) for e in state.get("events", [])]

    def summary(self) -> str:
        if not self.events:
            return "FP8 divergence guard: no layer fell back to high precision."
        lines = [f"FP8 divergence guard: {len(self.events)} layer(s) fell back to high precision"]
        lines += [f"  {e.layer}: {e.reason}" for e in self.events]
        return "\n".join(lines)
