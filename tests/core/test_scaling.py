"""Scale math and scaling state, with expected values derived from the formulas in DESIGN.md section 3."""

import math

import pytest
import torch

from fp8_lightning import DelayedScaling, TensorwiseScaling
from fp8_lightning.ops import dispatch
from fp8_lightning.formats import fp8_max
from fp8_lightning.quantize import FLOAT32_MAX
from fp8_lightning.scaling import OperandScaling, delayed_scale, roll_history, update_scales

from tests.core.fp8_reference import round_saturate

E4M3 = torch.float8_e4m3fn


def _scale(history, prev=1.0, margin=0, algo="max", p2=False):
    return delayed_scale(torch.tensor(history), torch.tensor(prev), 448.0, margin, algo, p2).item()


def test_delayed_scale_formula_max_and_most_recent():
    assert _scale([2.0, 8.0, 4.0]) == pytest.approx(448.0 / 8.0)
    assert _scale([2.0, 8.0, 4.0], algo="most_recent") == pytest.approx(448.0 / 2.0)


def test_margin_divides_by_a_power_of_two():
    assert _scale([7.0], margin=3) == pytest.approx(448.0 / 7.0 / 8.0)


@pytest.mark.parametrize("bad", [0.0, math.inf, math.nan])
def test_zero_inf_nan_amax_keep_the_previous_scale(bad):
    assert _scale([bad], prev=3.25) == 3.25
    assert _scale([bad, 1.0], prev=3.25, algo="most_recent") == 3.25


def test_infinite_scale_becomes_float32_max():
    tiny = float(torch.finfo(torch.float32).smallest_normal) * 2**-20  # 448 / tiny overflows float32
    assert _scale([tiny]) == FLOAT32_MAX


def test_power_of_two_scales_round_down():
    assert _scale([3.0], p2=True) == 128.0  # 448/3 = 149.3 -> 128
    assert _scale([3.5], p2=True) == 128.0  # 448/3.5 = 128 exactly


def test_history_rolls_with_the_newest_first():
    h = roll_history(torch.tensor([3.0, 2.0, 1.0]), torch.tensor(9.0))
    assert h.tolist() == [9.0, 3.0, 2.0]


def test_first_use_is_scaled_just_in_time_then_history_drives_the_scale():
    state = OperandScaling(DelayedScaling(amax_history_len=3), E4M3)
    q = state.quantize(torch.tensor([1.0, -4.0]))
    assert state.scale.item() == pytest.approx(448 / 4)  # not 1.0: just-in-time on first use
    assert q.data.float().abs().max().item() == 448.0
    state.quantize(torch.tensor([2.0]))  # same step (micro-batch): pending is the max
    assert state.scale.item() == pytest.approx(448 / 4)
    state.update()
    assert state.amax_history.tolist() == [4.0, 0.0, 0.0]
    state.quantize(torch.tensor([16.0]))  # delayed: this cast still uses the old scale, and saturates
    assert state.scale.item() == pytest.approx(448 / 4)
    state.update()
    assert state.amax_history.tolist() == [16.0, 4.0, 0.0]
    assert state.scale.item() == pytest.approx(448 / 16)


def test_non_finite_amax_is_counted_and_never_poisons_the_history():
    state = OperandScaling(DelayedScaling(amax_history_len=2), E4M3)
    state.quantize(torch.tensor([2.0]))
    state.update()
    state.quantize(torch.tensor([1.0, float("nan")]))
    state.quantize(torch.tensor([float("inf")]))
    state.update()
    assert state.nonfinite_count.item() == 2
    assert torch.isfinite(state.amax_history).all()
    assert state.scale.item() == pytest.approx(448 / 2)


def test_a_step_with_no_cast_leaves_history_and_scale_alone():
    state = OperandScaling(DelayedScaling(amax_history_len=2), E4M3)
    state.quantize(torch.tensor([2.0]))
    state.update()
    before = (state.amax_history.clone(), state.scale.clone())
    state.update()
    assert torch.equal(state.amax_history, before[0]) and torch.equal(state.scale, before[1])


def test_tensorwise_scale_follows_each_tensor_and_keeps_the_last_good_one():
    state = OperandScaling(TensorwiseScaling(), E4M3)
    state.quantize(torch.tensor([0.5]))
    assert state.scale.item() == pytest.approx(896.0)
    state.quantize(torch.tensor([float("nan")]))
    assert state.scale.item() == pytest.approx(896.0) and state.nonfinite_count.item() == 1
    state.quantize(torch.zeros(3))
    assert state.scale.item() == pytest.approx(896.0)


@pytest.mark.parametrize("dtype", [E4M3, torch.float8_e5m2])
@pytest.mark.parametrize("recipe", [TensorwiseScaling(), DelayedScaling(amax_history_len=2)])
def test_casts_equal_saturate_then_round_of_x_times_scale(recipe, dtype):
    """The CPU shortcuts (amax read on the host, the clamp skipped when no value can reach it) change no byte:
    tensors in range, at the top of the range, overflowing a delayed scale (saturation), with NaN, all zero."""
    state = OperandScaling(recipe, dtype)
    gen = torch.Generator().manual_seed(0)
    cases = [torch.randn(64, 48, generator=gen) * 3, torch.full((5,), 2.5), torch.randn(64, 48, generator=gen) * 40]
    cases += [torch.tensor([1.0, float("nan"), -3.0]), torch.zeros(4), torch.tensor([0.5, -fp8_max(dtype), 7.0])]
    cases += [torch.randn(8, 32, generator=gen).bfloat16() * 5, torch.randn(8, 32, generator=gen, dtype=torch.float64)]
    saturated = 0
    for x in cases:
        q = state.quantize(x)
        wide = x.double() if x.dtype == torch.float64 else x.float()  # what the cast multiplies: float32 or float64
        product = (wide * q.scale.to(wide.dtype)).double().flatten().tolist()  # the product the cast rounds
        saturated += sum(abs(v) > 1.01 * fp8_max(dtype) for v in product)
        want = ["nan" if math.isnan(v) else round_saturate(v, dtype) for v in product]
        got = ["nan" if math.isnan(v) else v for v in q.data.double().flatten().tolist()]
        assert got == want
        torch.testing.assert_close(dispatch.operand_f32(q), q.data.float(), rtol=0, atol=0, equal_nan=True)
        state.update()
    assert saturated > 0 if state.delayed else saturated == 0  # the delayed runs do exercise the clamp


def test_state_dict_round_trip_is_exact():
    a = OperandScaling(DelayedScaling(amax_history_len=4), E4M3)
    for v in (1.0, 3.0, 2.0):
        a.quantize(torch.tensor([v]))
        a.update()
    b = OperandScaling(DelayedScaling(amax_history_len=4), E4M3)
    b.load_state_dict(a.state_dict())
    for name in OperandScaling._TENSORS:
        assert torch.equal(getattr(a, name), getattr(b, name))
    with pytest.raises(ValueError, match="amax_history_len"):
        OperandScaling(DelayedScaling(amax_history_len=2), E4M3).load_state_dict(a.state_dict())


def test_single_process_update_needs_no_collective():
    states = [OperandScaling(DelayedScaling(), E4M3) for _ in range(3)]
    for s in states:
        s.quantize(torch.randn(4))
    assert update_scales(states) == 0


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_one_batched_update_equals_updating_each_state_alone(algo):
    """update_scales advances E4M3 and E5M2 operands of many layers in one batch; each must end exactly where its
    own update() would have taken it, and where the formula says."""
    recipe = DelayedScaling(amax_history_len=3, amax_compute_algo=algo, margin=1)
    dtypes = [E4M3, torch.float8_e5m2, E4M3, torch.float8_e5m2, E4M3]
    batched = [OperandScaling(recipe, d) for d in dtypes]
    alone = [OperandScaling(recipe, d) for d in dtypes]
    gen = torch.Generator().manual_seed(5)
    for step in range(4):
        for i, (b, a) in enumerate(zip(batched, alone)):
            if step == 2 and i == 3:
                continue  # a layer that did not run this step keeps its history and scale
            x = torch.randn(16, generator=gen) * (i + 1) * 10 ** (step - 1)
            b.quantize(x)
            a.quantize(x)
        update_scales(batched)
        for a in alone:
            a.update()
        for b, a in zip(batched, alone):
            assert torch.equal(b.amax_history, a.amax_history) and torch.equal(b.scale, a.scale)
    for b in batched:
        amax = b.amax_history.max() if algo == "max" else b.amax_history[0]
        assert b.scale.item() == pytest.approx(fp8_max(b.dtype) / amax.item() / 2, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_every_scale_is_the_correctly_rounded_quotient(dtype):
    """``fp8_max / amax`` rounded once to float32, as torchao (float64 division) and TransformerEngine (IEEE
    float32 division) compute it, checked against exact rational arithmetic for the four places a scale is made:
    tensorwise (tensor and host formulas), delayed (with a margin) and the FP8 optimizer's block scales. About a
    quarter of these amaxes get a scale one unit in the last place off from ``reciprocal(amax) * fp8_max``."""
    from fractions import Fraction

    from fp8_lightning.optim.state_formats import state_block_scales
    from fp8_lightning.quantize import tensorwise_scale, tensorwise_scale_value
    from tests.core.fp8_reference import nearest_float32

    gen = torch.Generator().manual_seed(5)
    amaxes = torch.cat([torch.logspace(-40, 38, 160, dtype=torch.float64).float(),  # every binade, subnormals too
                        torch.rand(240, generator=gen) * 1000 + 1e-3])
    top = fp8_max(dtype)
    want = torch.tensor([nearest_float32(Fraction(top) / Fraction(a)) for a in amaxes.tolist()])
    want = torch.clamp(want, max=FLOAT32_MAX)  # an infinite quotient is capped
    assert (amaxes.reciprocal() * top != want).sum() > 50  # the double rounding this test would catch
    assert torch.equal(torch.stack([tensorwise_scale(a, dtype, eps=0.0) for a in amaxes]), want)
    assert [tensorwise_scale_value(a, dtype, eps=0.0) for a in amaxes.tolist()] == want.tolist()
    history = amaxes.unsqueeze(-1)  # one history of one amax per row
    assert torch.equal(delayed_scale(history, torch.ones(len(amaxes)), top), want)
    margin_want = [min(nearest_float32(Fraction(top) / Fraction(a) / 4), FLOAT32_MAX) for a in amaxes.tolist()]
    assert delayed_scale(history, torch.ones(len(amaxes)), top, margin=2).tolist() == margin_want
    blocks = amaxes.unsqueeze(-1) * torch.tensor([1.0, -0.5])  # the block amax is the first entry
    assert torch.equal(state_block_scales(blocks, dtype), want)


def test_agreed_amaxes_carry_inf_as_inf_and_nan_as_inf():
    """The MAX all-reduce of agreed amaxes sends NaN as inf (MAX drops NaN) and keeps inf infinite, so that every
    rank sees a non-finite amax and keeps its previous scale (nan_to_num alone would turn inf into 3.4e38: a finite
    amax that would enter the history and crush the scale)."""
    from fp8_lightning.scaling import agreed_amax, max_across

    out, reduced = max_across(torch.tensor([float("inf"), float("nan"), 2.0]))
    assert out.tolist() == [math.inf, math.inf, 2.0] and not reduced  # no process group: no collective
    assert agreed_amax(torch.tensor([1.0, float("-inf")]), None).item() == math.inf
