"""The fused AdamW kernel converts its FP8 moments with the per-tensor casts' helper, which keeps NaN.

A gradient NaN must reach the stored first moment as NaN, as it does in the torch step (``saturating_cast``): a
clamp built from min/max alone (IEEE minNum/maxNum, what the GPU and the interpreter do) would turn it into
-448, a finite value that hides the fault from the optimizer's non-finite checks.
"""

from __future__ import annotations

import copy

import torch

from fp8_lightning.optim import FP8Optimizer
from fp8_lightning.optim.state_formats import decode

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
    torch_m = decode(opt.state[param]["exp_avg"], opt.state[param]["exp_avg_scale"], fmt, (NUMEL,))
    fused_m = decode(fused_state["exp_avg"], fused_state["exp_avg_scale"], fmt, (NUMEL,))
    assert torch.isnan(torch_m[3]), "the torch step keeps a NaN moment (the reference)"
    assert torch.isnan(fused_m[3]), f"the fused step stored {fused_m[3].item()} for a NaN moment"
    assert torch.isfinite(fused_m[16:]).all() and torch.isfinite(torch_m[16:]).all()
