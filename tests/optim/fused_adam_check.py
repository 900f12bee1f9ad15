"""Compare the fused Triton AdamW step (kernels/fp8_adam.py) with FP8Optimizer's pure-torch step.

Run on CPU under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is imported, so the tests start
this in a subprocess) or on a CUDA GPU: ``python -m tests.optim.fused_adam_check cuda``.

Each case starts both paths from the *same* state at every step (the torch path's), takes one step with each,
and compares: parameters/master to float32 rounding, block scales to float32 rounding, and decoded states to
within one step of their storage format (a value on a rounding boundary may round either way after a
contracted multiply-add). The fraction of stored bytes that differ at all must stay small.
"""

from __future__ import annotations

import copy
import sys

import torch

CASES = [
    # (name, param dtype, preset, overrides, optimizer kwargs)
    ("default_bf16_int8_remainder", torch.bfloat16, "default", {}, {"weight_decay": 0.1}),
    ("bf16_exact_remainder_fp16_v", torch.bfloat16, "default",
     {"master_weights": "bf16_remainder", "exp_avg_sq": "fp16:128"}, {"weight_decay": 0.1}),
    ("default_fp32_param", torch.float32, "default", {}, {"weight_decay": 0.0}),
    ("max_savings_sqrt_v", torch.float32, "max_savings", {}, {"weight_decay": 0.05}),
    ("fp16_param_fp32_master", torch.float16, "default", {"master_weights": "fp32"}, {"weight_decay": 0.1}),
    ("adam_l2_block64", torch.float32, "default", {"block_size": 64}, {"weight_decay": 0.01, "adam": True}),
]
STEPS = 3
NUMEL = (37, 29)  # 1073 elements: a partial last block


def _decode(state, name, fmt, shape):
    from fp8_lightning.optim.state_formats import decode_state

    return decode_state(state[name], state[f"{name}_scale"], fmt, shape)


def run_case(device: str, name, dtype, preset, overrides, kwargs) -> list[str]:
    from fp8_lightning.kernels.fp8_adam import fused_adam_step, fused_adam_supported
    from fp8_lightning.optim import FP8Optimizer
    from fp8_lightning.optim import master_weights as mw

    kwargs = dict(kwargs)
    cls = torch.optim.Adam if kwargs.pop("adam", False) else torch.optim.AdamW
    gen = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter((torch.randn(NUMEL, generator=gen) * 0.05).to(device=device, dtype=dtype))
    opt = FP8Optimizer(cls([param], lr=1e-2, **kwargs), preset, min_quantize_numel=0, use_triton=False,
                       **overrides)
    group = opt.param_groups[0]
    formats, kind = opt.state_formats(param), opt.master_kind(param)
    ok, reason = fused_adam_supported(param.detach(), formats["exp_avg"], formats["exp_avg_sq"], kind)
    if not ok:
        return [f"{name}: not supported by the kernel: {reason}"]
    problems = []
    for step in range(1, STEPS + 1):
        grad = (torch.randn(NUMEL, generator=gen) * 10.0 ** torch.randint(-4, 0, NUMEL, generator=gen)).to(
            device=device, dtype=dtype)
        if step > 1:
            fused_param = param.detach().clone()
            fused_state = copy.deepcopy(opt.state[param])
            fused_state["step"] += 1
            fused_adam_step(
                fused_param, grad, fused_state, formats["exp_avg"], formats["exp_avg_sq"], kind, step=step,
                lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
                weight_decay=group["weight_decay"], decoupled_weight_decay=cls is torch.optim.AdamW,
            )
        param.grad = grad
        opt.step()
        if step == 1:
            continue  # the first step initialises the torch state; compare from the second on
        state = opt.state[param]
        want = mw.load_master(param.detach(), state, kind).double()
        got = mw.load_master(fused_param, fused_state, kind).double()
        # a few float32 ulps of |p| ~ 0.1; a 16-bit master can land one 16-bit step (2**-16 relative) away when
        # the float32 values straddle a rounding boundary
        rtol = 2 * 2.0**-16 if kind == "bf16_int8_remainder" else 2e-6
        # On a GPU, Triton's division and square root are not correctly rounded and multiply-adds contract, so an
        # element's update can move by a few float32 ulps of the update (about lr), and a 16-bit master one step:
        # there the bound is relative to the largest master value, not to each element.
        scale = want.abs() if device == "cpu" else want.abs().max()
        if not bool(((got - want).abs() <= 2e-8 + rtol * scale).all()):
            problems.append(f"{name} step {step}: master differs by {(got - want).abs().max().item():.3g}")
        if not torch.allclose(fused_param.double(), param.detach().double(), rtol=2 * 2.0**-8, atol=0):
            problems.append(f"{name} step {step}: parameter differs beyond one rounding of its dtype")
        for key in ("exp_avg", "exp_avg_sq"):
            fmt = formats[key]
            ulp = 2.0 ** -{"float8_e4m3fn": 3, "float8_e5m2": 2, "float16": 10}[fmt.dtype]
            ulp *= 2 if fmt.transform == "sqrt" else 1
            torch_scale, fused_scale = state[f"{key}_scale"], fused_state[f"{key}_scale"]
            if not torch.allclose(fused_scale, torch_scale, rtol=1e-5, atol=0):
                ratio = (fused_scale / torch_scale).double()
                problems.append(f"{name} step {step}: {key} scales differ (fused / torch from "
                                f"{ratio.min().item():.6g} to {ratio.max().item():.6g})")
            want_v = _decode(state, key, fmt, NUMEL).double()
            got_v = _decode(fused_state, key, fmt, NUMEL).double()
            block_max = want_v.abs().max().item()
            bound = ulp * want_v.abs() + block_max * 2.0**-16
            if ((got_v - want_v).abs() > bound).any():
                worst = ((got_v - want_v).abs() - bound).max().item()
                problems.append(f"{name} step {step}: {key} differs by more than one step (excess {worst:.3g})")
            differing = (state[key].view(torch.uint8) != fused_state[key].view(torch.uint8)).float().mean().item()
            if differing > 0.02:
                problems.append(f"{name} step {step}: {differing:.1%} of the {key} bytes differ")
    return problems


def main(device: str = "cpu") -> int:
    problems = []
    for case in CASES:
        problems += run_case(device, *case)
    for line in problems:
        print("FAIL", line)
    print(f"checked {len(CASES)} cases x {STEPS - 1} steps on {device}: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cuda"))
