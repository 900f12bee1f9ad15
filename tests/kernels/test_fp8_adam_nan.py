"""The fused AdamW kernel keeps a NaN or infinite gradient element to itself, as the torch step does.

Its FP8 moments are converted with the per-tensor casts' helper, which keeps NaN, and each block's scale comes
from the block's finite values, so the other elements of the block keep AdamW's moments.

A gradient NaN must reach the stored first moment as NaN, as it does in the torch step (``saturating_cast``): a
clamp built from min/max alone (IEEE minNum/maxNum, what the GPU and the interpreter do) would turn it into
-448, a finite value that hides the fault from the optimizer's non-finite checks.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fp8_lightning.optim import FP8Optimizer
from fp8_lightning.optim.state_formats import decode_state

NUMEL = 40  # blocks of 16: the NaN in the first block, the others stay finite


def test_nan_gradient_stays_nan_in_the_fused_first_moment():
    from fp8_lightning.kernels.fp8_adam import fused_adam_step

    gen = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(NUMEL, generator=gen))
    opt = FP8Optimizer(torch.optim.AdamW([param], lr=1e-2), "default", min_quantize_numel=0, use_triton=False,
                       block_size=16)  # fmt: skip
    param.grad = torch.randn(NUMEL, generator=gen)
    opt.step()  # initialises the FP8 state
    formats = opt.state_formats(param)
    fused_param, fused_state = param.detach().clone(), copy.deepcopy(opt.state[param])
    grad = torch.randn(NUMEL, generator=gen)
    grad[3] = float("nan")
    group = opt.param_groups[0]
    fused_adam_step(
        fused_param, grad, fused_state, formats["exp_avg"], formats["exp_avg_sq"], opt.master_kind(param), step=2,
        lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
        weight_decay=group["weight_decay"], decoupled_weight_decay=True,
    )
    param.grad = grad
    opt.step()
    fmt = formats["exp_avg"]
    torch_m = decode_state(opt.state[param]["exp_avg"], opt.state[param]["exp_avg_scale"], fmt, (NUMEL,))
    fused_m = decode_state(fused_state["exp_avg"], fused_state["exp_avg_scale"], fmt, (NUMEL,))
    assert torch.isnan(torch_m[3]), "the torch step keeps a NaN moment (the reference)"
    assert torch.isnan(fused_m[3]), f"the fused step stored {fused_m[3].item()} for a NaN moment"
    assert torch.isfinite(fused_m[16:]).all() and torch.isfinite(torch_m[16:]).all()


def _fused_first_step(grad: torch.Tensor, block: int):
    """One fused AdamW step from zero states (default preset: E4M3 ``m``, E4M3 ``sqrt(v)``), float32 param."""
    from fp8_lightning.kernels.fp8_adam import fused_adam_step
    from fp8_lightning.optim.config import config_from
    from fp8_lightning.optim.state_formats import encode_state

    config = config_from("default", block_size=block)
    param = torch.randn(grad.numel(), generator=torch.Generator().manual_seed(1))
    state = {}
    for name, fmt in (("exp_avg", config.exp_avg), ("exp_avg_sq", config.exp_avg_sq)):
        state[name], state[f"{name}_scale"] = encode_state(torch.zeros_like(param), fmt)
    start = param.clone()
    fused_adam_step(
        param, grad, state, config.exp_avg, config.exp_avg_sq, "none", step=1, lr=1e-2, beta1=0.9, beta2=0.999,
        eps=1e-8, weight_decay=0.01, decoupled_weight_decay=True,
    )
    m = decode_state(state["exp_avg"], state["exp_avg_scale"], config.exp_avg, param.shape).double()
    v = decode_state(state["exp_avg_sq"], state["exp_avg_sq_scale"], config.exp_avg_sq, param.shape).double()
    return start, param, m, v


@pytest.mark.parametrize("bad_value", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_one_nonfinite_gradient_element_leaves_its_block_neighbours_to_adamw(bad_value):
    """The fused kernel's block scale comes from the finite values, as the torch step's does: the other
    elements of the bad element's block keep AdamW's moments (float64 torch.optim.AdamW as reference) within
    one E4M3 step (half a step of rounding, plus the boundary cases of the interpreter's contracted arithmetic)."""
    block, bad = 64, 3
    grad = torch.randn(2 * block, generator=torch.Generator().manual_seed(0)) * 1e-3
    grad[bad] = bad_value
    start, param, m, v = _fused_first_step(grad, block)
    ref_param = torch.nn.Parameter(start.double())
    ref = torch.optim.AdamW([ref_param], lr=1e-2, weight_decay=0.01)
    ref_param.grad = grad.double()
    ref.step()
    keep = torch.ones(2 * block, dtype=torch.bool)
    keep[bad] = False
    keep[block:] = False  # the bad element's block, without it
    for name, got, want in (
        ("first moment", m[keep], ref.state[ref_param]["exp_avg"][keep]),
        ("sqrt of the second moment", v[keep].sqrt(), ref.state[ref_param]["exp_avg_sq"][keep].sqrt()),
    ):
        assert torch.isfinite(got).all(), f"{int((~torch.isfinite(got)).sum())} of {block - 1} {name}s lost"
        step = torch.maximum(want.abs() * 2.0**-3, want.abs().max() / 448 * 2.0**-9)  # one E4M3 step
        assert ((got - want).abs() <= step).all(), f"{name}s off by up to {(got - want).abs().max().item():.3g}"
    got_p, want_p = param.double()[keep], ref_param.detach()[keep]
    assert torch.allclose(got_p, want_p, rtol=1e-6, atol=0), "the first step reads no stored state: exact update"
    assert torch.isnan(param[bad]) and torch.isnan(ref_param[bad])
    assert torch.isnan(m[bad]) == (bad_value != bad_value), "a NaN moment stays NaN; an inf one saturates"
