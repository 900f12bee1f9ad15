"""One NaN or infinite gradient element costs the FP8 optimizer that one parameter, as it costs torch.optim.AdamW.

The states are stored in blocks of 128 elements that share one scale. The scale must come from the block's
finite values: an infinite amax would make it 0 (the whole block decodes as 0/0) and a NaN amax would make it 1
(small moments flush to zero), so one bad element would take 127 neighbours with it. The reference is
``torch.optim.AdamW`` on float64 copies; the other elements of the bad block must follow it as closely as the
elements of an untouched block do: within the rounding of the state format.
"""

from __future__ import annotations

import pytest
import torch

from fp8_lightning.optim import FP8Optimizer
from fp8_lightning.optim.state_formats import decode_state

BLOCK = 128
NUMEL = 2 * BLOCK  # the bad element in the first block; the second block is the untouched control
BAD = 5
LR = 1e-2
E4M3_MAX = 448.0
E4M3_HALF_STEP = 2.0**-4  # half the spacing of E4M3 normals, relative to the value (3 mantissa bits)
E4M3_HALF_SUBNORMAL = 2.0**-10  # half the spacing of E4M3 subnormals (2**-9), in scaled units

BAD_VALUES = [pytest.param(float("inf"), id="inf"), pytest.param(float("nan"), id="nan")]


def gradients(bad_value: float, steps: int, bad_step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(NUMEL, generator=gen) * 1e-3 for _ in range(steps)]  # moments far below 1: scales matter
    grads[bad_step][BAD] = bad_value
    return grads


def run_both(grads: list[torch.Tensor]):
    """The FP8 optimizer (torch path, default E4M3 states) and float64 torch AdamW over the same gradients."""
    start = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1))
    param = torch.nn.Parameter(start.clone())
    opt = FP8Optimizer(torch.optim.AdamW([param], lr=LR), "default", min_quantize_numel=0, use_triton=False)
    ref_param = torch.nn.Parameter(start.double())
    ref = torch.optim.AdamW([ref_param], lr=LR)
    history = []
    for grad in grads:
        param.grad, ref_param.grad = grad.clone(), grad.double()
        opt.step()
        ref.step()
        history.append((param.detach().double().clone(), ref_param.detach().clone()))
    return opt, param, ref, ref_param, history


def others(x: torch.Tensor) -> torch.Tensor:
    """Every element of the bad element's block except the bad one."""
    block = x[:BLOCK]
    return torch.cat([block[:BAD], block[BAD + 1:]])


def half_step_bound(ref: torch.Tensor) -> torch.Tensor:
    """The largest error of rounding ``ref`` (one block, all finite) to E4M3 under the block scale
    ``448 / amax``: half a step, relative for normals, absolute (scaled back) for subnormals."""
    amax = ref.abs().max()
    return torch.maximum(ref.abs() * E4M3_HALF_STEP, amax / E4M3_MAX * E4M3_HALF_SUBNORMAL)


@pytest.mark.parametrize("bad_value", BAD_VALUES)
def test_stored_moments_of_the_other_127_elements_match_adamw(bad_value):
    grads = gradients(bad_value, steps=1, bad_step=0)  # the states before are exact zeros: one rounding to check
    opt, param, ref, ref_param, _ = run_both(grads)
    state, ref_state = opt.state[param], ref.state[ref_param]
    formats = opt.state_formats(param)
    exp_avg = decode_state(state["exp_avg"], state["exp_avg_scale"], formats["exp_avg"], param.shape).double()
    exp_avg_sq = decode_state(state["exp_avg_sq"], state["exp_avg_sq_scale"], formats["exp_avg_sq"], param.shape).double()
    assert formats["exp_avg"].dtype == "float8_e4m3fn" and formats["exp_avg_sq"].transform == "sqrt"

    want_m = others(ref_state["exp_avg"])
    got_m = others(exp_avg)
    assert torch.isfinite(got_m).all(), f"{int((~torch.isfinite(got_m)).sum())} of 127 first moments lost"
    slack = 1e-6 * want_m.abs()  # float32 arithmetic of the step itself
    assert ((got_m - want_m).abs() <= half_step_bound(want_m) + slack).all(), (
        f"first moments off by up to {(got_m - want_m).abs().max().item():.3g}, "
        f"allowed {half_step_bound(want_m).max().item():.3g}"
    )
    want_sqrt_v = others(ref_state["exp_avg_sq"]).sqrt()  # the stored quantity is sqrt(v)
    got_sqrt_v = others(exp_avg_sq).sqrt()
    assert ((got_sqrt_v - want_sqrt_v).abs() <= half_step_bound(want_sqrt_v) + 1e-6 * want_sqrt_v).all(), (
        f"sqrt of second moments off by up to {(got_sqrt_v - want_sqrt_v).abs().max().item():.3g}"
    )
    # the bad element itself: NaN stays NaN; an infinity saturates to the largest value of the block's scale
    if bad_value != bad_value:
        assert torch.isnan(exp_avg[BAD]) and torch.isnan(exp_avg_sq[BAD])
    else:
        assert exp_avg[BAD] == pytest.approx(want_m.abs().max().item(), rel=2.0**-3)
    assert torch.isnan(param[BAD]) and torch.isnan(ref_param[BAD]), "AdamW's parameter becomes NaN (inf/inf)"


@pytest.mark.parametrize("bad_value", BAD_VALUES)
def test_the_other_127_parameters_follow_adamw_through_a_bad_step(bad_value):
    """Steps: clean, bad, clean, clean. Each step that reads a stored state adds at most about one eighth of
    ``lr`` of error (E4M3 rounds ``m`` and ``sqrt(v)`` to 2**-4 each; an Adam update is about ``lr``)."""
    grads = gradients(bad_value, steps=4, bad_step=1)
    *_, history = run_both(grads)
    for step, (got, want) in enumerate(history, start=1):
        allowed = (step - 1) * LR / 8 + 1e-6
        control = (got[BLOCK:] - want[BLOCK:]).abs().max().item()
        assert control <= allowed, f"step {step}: the untouched block is off by {control:.3g} > {allowed:.3g}"
        error = (others(got) - others(want)).abs()
        assert torch.isfinite(error).all(), f"step {step}: {int((~torch.isfinite(error)).sum())} of 127 lost"
        assert error.max().item() <= allowed, (
            f"step {step}: the bad element's neighbours are off by {error.max().item():.3g} > {allowed:.3g} "
            f"(untouched block: {control:.3g})"
        )
