"""The divergence guard's decision: streaks, patience, the overflow magnitude rule, NaN origin, persistence."""

import pytest

from fp8_lightning.guard import DivergenceGuard, GuardState, decide, nonfinite_origin
from fp8_lightning.stats import OperandStats


def st(layer, role="input", overflow=0.0, underflow=0.0, nonfinite=False, amax=1.0, scale=448.0, order=0):
    return OperandStats(layer, role, amax, scale, overflow, underflow, nonfinite, 448.0, order)


def step_stats(*items):
    return {(s.layer, s.role): s for s in items}


def test_from_arg():
    assert DivergenceGuard.from_arg(None) is None and DivergenceGuard.from_arg(False) is None
    assert DivergenceGuard.from_arg(True) == DivergenceGuard()
    assert DivergenceGuard.from_arg({"patience": 5}).patience == 5
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['patients'\]"):
        DivergenceGuard.from_arg({"patients": 5})
    with pytest.raises(ValueError, match="overflow_threshold=2 is invalid; allowed: a fraction in"):
        DivergenceGuard(overflow_threshold=2)
    with pytest.raises(ValueError, match="patience=0 is invalid"):
        DivergenceGuard(patience=0)
    with pytest.raises(TypeError, match="pass True, False/None"):
        DivergenceGuard.from_arg("yes")


def test_patience_counts_consecutive_steps_only():
    guard = DivergenceGuard(underflow_threshold=0.5, patience=3)
    state = GuardState(guard)
    bad, good = step_stats(st("a", underflow=0.9)), step_stats(st("a", underflow=0.1))
    assert state.step(0, bad) == [] and state.step(1, bad) == []
    assert state.step(2, good) == []  # streak broken
    assert state.step(3, bad) == [] and state.step(4, bad) == []
    (event,) = state.step(5, bad)
    assert (event.layer, event.kind, event.step) == ("a", "underflow", 5)
    assert "underflow fraction above 0.5 for 3 consecutive steps (last 0.9)" in event.reason
    assert state.step(6, bad) == []  # already disabled
    assert state.disabled_layers == {"a"}


def test_overflow_needs_a_large_enough_excess():
    guard = DivergenceGuard(overflow_threshold=0.01, patience=1, min_overflow_ratio=2.0)
    drift = step_stats(st("w", overflow=0.02, amax=1.03))  # amax*scale = 1.03 * max: benign drift
    spike = step_stats(st("w", overflow=0.02, amax=5.0))
    assert decide(0, drift, {}, guard)[1] == []
    assert [e.kind for e in decide(0, spike, {}, guard)[1]] == ["overflow"]


def test_nonfinite_blames_only_the_first_operand_that_held_it():
    stats = step_stats(
        st("l0", "input", order=0),
        st("l1", "input", order=2),
        st("l1", "grad_output", nonfinite=True, order=4),  # backward reaches l1 first
        st("l0", "grad_output", nonfinite=True, order=5),  # ... then flows on to l0
    )
    assert nonfinite_origin(stats) == ("l1", "grad_output")
    streaks, events = decide(7, stats, {}, DivergenceGuard())
    assert [(e.layer, e.kind, e.step) for e in events] == [("l1", "nonfinite", 7)]
    assert nonfinite_origin(stats, disabled={"l1"}) == ("l0", "grad_output")


def test_state_dict_round_trip():
    state = GuardState(DivergenceGuard(patience=2))
    state.step(0, step_stats(st("a", underflow=0.9), st("b", nonfinite=True)))
    copy = GuardState(DivergenceGuard(patience=2))
    copy.load_state_dict(state.state_dict())
    assert copy.streaks == state.streaks and copy.events == state.events
    (event,) = copy.step(1, step_stats(st("a", underflow=0.9)))
    assert event.layer == "a"
    assert "b: non-finite amax in input at step 0" in copy.summary()
