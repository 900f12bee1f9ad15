"""Activation checkpointing of FP8 layers and experts: the recompute replays the FP8 forward of the original call.

For every recipe and both ``torch.utils.checkpoint`` modes, a checkpointed FP8 model must give the gradients of the
same model without checkpointing bit for bit, book each amax once (the scaling state after two optimizer steps,
amax histories and NVFP4 stochastic-rounding counters included, equals the unchecked run's), count each GEMM once,
and show each operand to an observer once. The unchecked FP8 run is the reference; each test also checks that it
differs from the high-precision gradients, so a recompute in high precision cannot pass.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import fp8_lightning.linear as linear_module
from fp8_lightning import (
    FP8RecomputeError,
    GroupedExperts,
    convert_to_fp8,
    fp8_autocast,
    fp8_checkpoint_context,
    fp8_state_dict,
    sync_scales,
)
from fp8_lightning.recipes import RECIPES
from tests.conftest import requires_cuda_fp8

MODES = {"reentrant": True, "non_reentrant": False}


class Stack(nn.Module):
    """Two checkpointable blocks of FP8 linears (the second block reuses nothing of the first)."""

    def __init__(self, ckpt: bool | None):
        super().__init__()
        self.ckpt = ckpt  # None: no checkpointing; else use_reentrant
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x) if self.ckpt is None else checkpoint(block, x, use_reentrant=self.ckpt)
        return x


class MoE(nn.Module):
    """A fixed routing (tokens sorted by expert) into FP8 GroupedExperts, then an FP8 linear head."""

    def __init__(self, ckpt: bool | None):
        super().__init__()
        self.ckpt = ckpt
        self.experts = GroupedExperts(64, 128, 4)
        self.head = nn.Linear(64, 64)
        self.register_buffer("offs", torch.tensor([10, 10, 40, 64], dtype=torch.int32))

    def block(self, x):
        return self.head(self.experts(x, self.offs))

    def forward(self, x):
        return self.block(x) if self.ckpt is None else checkpoint(self.block, x, use_reentrant=self.ckpt)


def _train(cls, recipe, ckpt, steps=2, fp8=True, observe=None, device="cpu"):
    """Grads of the last step, the FP8 state after ``steps`` SGD steps with a scale update each, the model."""
    torch.manual_seed(0)
    model = cls(ckpt).to(device)
    convert_to_fp8(model, recipe)
    if observe is not None:
        for m in model.modules():
            if hasattr(m, "fp8_recipe"):
                m.fp8_observer = observe
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        torch.manual_seed(100 + step)
        x = torch.randn(64, 64).to(device).requires_grad_()
        opt.zero_grad()
        with fp8_autocast(enabled=fp8):
            loss = model(x).square().mean()
        loss.backward()
        grads = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
        opt.step()
        sync_scales(model)
    return grads, fp8_state_dict(model), model


def _assert_state_equal(a, b, path=""):
    assert type(a) is type(b), path
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_state_equal(a[k], b[k], f"{path}/{k}")
    elif torch.is_tensor(a):
        assert torch.equal(a, b), path
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (u, v) in enumerate(zip(a, b)):
            _assert_state_equal(u, v, f"{path}[{i}]")
    else:
        assert a == b, path


def _check_same_as_unchecked(cls, recipe, mode):
    plain_grads, plain_state, plain = _train(cls, recipe, None)
    grads, state, model = _train(cls, recipe, MODES[mode])
    for i, (g, ref) in enumerate(zip(grads, plain_grads)):
        assert torch.equal(g, ref), f"gradient {i} differs from the unchecked FP8 run"
    _assert_state_equal(state, plain_state)  # amax histories, scales, counters, NVFP4 stochastic-rounding counts
    high_grads = _train(cls, recipe, None, steps=1, fp8=False)[0]
    first_grads = _train(cls, recipe, MODES[mode], steps=1)[0]
    assert not all(torch.equal(g, h) for g, h in zip(first_grads, high_grads))  # the FP8 path really ran
    return plain, model


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_linear_stack_gradients_and_state_match_the_unchecked_run(recipe, mode):
    plain, model = _check_same_as_unchecked(Stack, recipe, mode)
    for a, b in zip(plain.modules(), model.modules()):
        if hasattr(a, "fp8_weight_casts"):
            assert a.fp8_weight_casts == b.fp8_weight_casts  # the recompute took the step's cached FP8 weight


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_grouped_experts_gradients_state_and_gemm_counts_match(recipe, mode):
    plain, model = _check_same_as_unchecked(MoE, recipe, mode)
    assert model.experts.fp8_gemm_counts == plain.experts.fp8_gemm_counts == {"fprop": 6, "dgrad": 6, "wgrad": 6}


def test_delayed_history_advances_once_per_step():
    """Independent of the unchecked run: after 3 steps each operand's history holds exactly 3 amaxes, and the
    input's newest one is the amax of the last step's input as float64 computes it."""
    _, state, model = _train(Stack, "delayed", True, steps=3)
    first = model.blocks[0][0]
    history = first.fp8_scaling().operands["input"].amax_history
    assert int((history > 0).sum()) == 3
    torch.manual_seed(102)
    assert history[0].item() == torch.randn(64, 64).double().abs().max().item()


@pytest.mark.parametrize("mode", list(MODES))
def test_linear_gemms_run_in_fp8_and_observers_see_each_operand_once(monkeypatch, mode):
    calls = {"gemm": 0, "observed": 0}
    real = linear_module.fp8_mm

    def counting_mm(*args, **kwargs):
        calls["gemm"] += 1
        return real(*args, **kwargs)

    def observe(module, role, x, q):
        calls["observed"] += 1

    monkeypatch.setattr(linear_module, "fp8_mm", counting_mm)
    _train(Stack, "tensorwise", None, steps=1, observe=observe)
    plain = dict(calls)
    calls.update(gemm=0, observed=0)
    _train(Stack, "tensorwise", MODES[mode], steps=1, observe=observe)
    assert plain == {"gemm": 4 * 3, "observed": 4 * 3}  # 4 layers: fprop, dgrad, wgrad; input, weight, grad_output
    assert calls == {"gemm": plain["gemm"] + 4, "observed": plain["observed"]}  # + each recomputed fprop, in FP8


def test_recompute_on_another_thread():
    """On a GPU autograd runs backward on its own thread, where the forward's fp8_autocast is not in force."""
    plain_grads = _train(Stack, "tensorwise", None, steps=1)[0]
    torch.manual_seed(0)
    model = Stack(False)
    convert_to_fp8(model, "tensorwise")
    torch.manual_seed(100)
    x = torch.randn(64, 64, requires_grad=True)
    with fp8_autocast():
        loss = model(x).square().mean()
    worker = threading.Thread(target=loss.backward)
    worker.start()
    worker.join()
    assert all(torch.equal(g, r) for g, r in zip([x.grad] + [p.grad for p in model.parameters()], plain_grads))


def _shared_layer_run(context_fn=None):
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(64, 64))
    convert_to_fp8(layer, "tensorwise")
    torch.manual_seed(1)
    x = torch.randn(32, 64, requires_grad=True)

    def region(t):
        t = F.gelu(layer(t))
        with fp8_autocast(enabled=False):  # the same layer once more, in high precision
            return layer(t)

    with fp8_autocast():
        if context_fn is None:
            y = region(x)
        else:
            y = checkpoint(region, x, use_reentrant=False, context_fn=context_fn)
    y.square().mean().backward()
    return [x.grad, layer[0].weight.grad, layer[0].bias.grad]


def test_two_settings_in_one_region_refuse_and_the_context_fn_fixes_it():
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(64, 64))
    convert_to_fp8(layer, "tensorwise")
    x = torch.randn(32, 64, requires_grad=True)

    def region(t):
        t = F.gelu(layer(t))
        with fp8_autocast(enabled=False):
            return layer(t)

    with fp8_autocast():
        y = checkpoint(region, x, use_reentrant=False)
    with pytest.raises(FP8RecomputeError, match="two FP8 settings.*context_fn=fp8_lightning.fp8_checkpoint_context"):
        y.sum().backward()
    # The explicit form carries the setting of the call; the recompute replays both calls as they ran.
    # (The same layer's two calls inside one region still run as recorded: FP8, then high precision.)
    reference = _shared_layer_run()
    checked = _shared_layer_run(fp8_checkpoint_context)
    assert all(torch.equal(a, b) for a, b in zip(checked, reference))


def test_evaluation_and_no_grad_forwards_keep_no_log():
    model = nn.Sequential(nn.Linear(64, 64))
    convert_to_fp8(model, "tensorwise")
    model.eval()
    with torch.no_grad(), fp8_autocast():
        model(torch.randn(4, 64))
    assert "_fp8_forward_log" not in model[0].__dict__


def test_backward_keeps_no_fp8_operand_outside_the_saved_tensors():
    """What backward needs travels through save_for_backward only, which checkpointing drops and recomputes: the
    step object the Function keeps holds no FP8 copy of the input (it would outlive the checkpoint)."""
    model = nn.Sequential(nn.Linear(64, 64))
    convert_to_fp8(model, "tensorwise")
    with fp8_autocast():
        y = model(torch.randn(32, 64, requires_grad=True))
    assert type(y.grad_fn).__name__ == "FP8LinearFunctionBackward"
    assert y.grad_fn.step.operands is None


@pytest.mark.gpu
@requires_cuda_fp8
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_on_cuda_checkpointed_runs_match_the_unchecked_run(recipe, mode):
    """On CUDA autograd runs backward on its device thread: the recompute never sees the forward's fp8_autocast."""
    for cls in (Stack, MoE):
        plain_grads, plain_state, _ = _train(cls, recipe, None, device="cuda")
        grads, state, _ = _train(cls, recipe, MODES[mode], device="cuda")
        for i, (g, ref) in enumerate(zip(grads, plain_grads)):
            assert torch.equal(g, ref), f"{cls.__name__}: gradient {i} differs from the unchecked FP8 run"
        _assert_state_equal(state, plain_state)


@pytest.mark.parametrize("context_fn", [None, fp8_checkpoint_context], ids=["logged", "context_fn"])
def test_two_backwards_through_one_checkpoint_recompute_twice_alike(context_fn):
    """``retain_graph=True``: each backward recomputes the region; both replay the forward (the context re-enters)."""
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
        convert_to_fp8(model, "delayed")
        x = torch.randn(32, 64, requires_grad=True)
        with fp8_autocast():
            kwargs = {} if context_fn is None else {"context_fn": context_fn}
            y = checkpoint(model, x, use_reentrant=False, **kwargs) if ckpt else model(x)
        loss = y.square().mean()
        loss.backward(retain_graph=True)
        loss.backward()
        grads.append([x.grad, *(p.grad for p in model.parameters())])
        grads[-1].append(fp8_state_dict(model))
    for a, b in zip(*grads):
        _assert_state_equal(a, b)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_frozen_layer_replays_step_after_step(mode):
    """A frozen weight never changes version; each step's new fp8_autocast block still replays cleanly."""
    grads = {}
    for ckpt in (None, MODES[mode]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
        convert_to_fp8(model, "tensorwise")
        model[0].requires_grad_(False)
        grads[ckpt] = []
        for step in range(3):
            x = torch.randn(32, 64, requires_grad=True)
            with fp8_autocast() as state:
                y = model(x) if ckpt is None else checkpoint(model, x, use_reentrant=ckpt)
            y.square().mean().backward()
            grads[ckpt].append(x.grad)
            logs = [model[0].__dict__.get(a) for a in ("_fp8_forward_log", "_fp8_no_grad_forward_log")]
            assert any(log is not None and log.state is state for log in logs)  # the hot path's identity check holds
    assert all(torch.equal(a, b) for a, b in zip(grads[None], grads[MODES[mode]]))


def test_a_no_grad_rollout_before_a_checkpointed_step_does_not_blur_its_setting():
    """A training-mode forward under torch.no_grad() outside fp8_autocast (a rollout, a teacher pass), then a
    non-reentrant checkpointed FP8 step: the recompute replays the step's forward, as without the rollout."""
    grads = []
    for rollout in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
        convert_to_fp8(model, "tensorwise")
        x = torch.randn(32, 64, requires_grad=True)
        if rollout:
            with torch.no_grad():
                model(x)
        with fp8_autocast():
            y = checkpoint(model, x, use_reentrant=False)
        y.square().mean().backward()
        grads.append([x.grad, *(p.grad for p in model.parameters())])
    for ours, reference in zip(*grads):
        assert torch.equal(ours, reference)



@pytest.mark.parametrize("mode", list(MODES))
def test_an_experts_recompute_takes_the_forward_s_weight_cast(mode, monkeypatch):
    """The experts' recompute reuses the step's cached FP8 weights (it cast every expert again, with the same bits)."""
    from fp8_lightning import TensorwiseScaling

    calls = []
    own = TensorwiseScaling.grouped_weight_operands

    def spy(self, weight, dtype, states, record):
        calls.append(record)
        return own(self, weight, dtype, states, record)

    monkeypatch.setattr(TensorwiseScaling, "grouped_weight_operands", spy)
    _train(MoE, "tensorwise", MODES[mode], steps=1)
    assert calls and all(calls), f"the recompute cast the expert weights again: {calls}"
