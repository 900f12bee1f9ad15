"""A checkpoint recompute replays the setting of the forward it repeats, not that of an earlier step's forward.

Each converted module logs the FP8 setting of its forwards (:mod:`fp8_lightning.recompute`): forwards with grad
(what non-reentrant checkpointing recomputes) apart from training forwards without grad (reentrant checkpointing's).
A step without checkpointing logs a forward with grad; a reentrant step after it logs one without grad, and its
recompute must take that one. The log of the first step used to be started afresh only when the weight changed in
place, which a frozen module's weight never does, and a recompute looked at the grad log first: the reentrant
recompute then replayed the earlier step's setting (silently other gradients), and a non-reentrant step raised
``FP8RecomputeError`` for "two settings". A backward that reaches the module now closes its logs.

Reference: the same steps with the same settings, none checkpointed; gradients and scaling state must be equal bit
for bit. Each case also checks that the earlier step's setting gives other gradients, so a stale replay fails it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from fp8_lightning import convert_to_fp8, fp8_autocast, fp8_state_dict, sync_scales
from tests.conftest import requires_cuda_fp8

MODES = {"reentrant": True, "non_reentrant": False}
SETTINGS = {  # fp8_autocast arguments
    "fp8": {},
    "high_precision": {"enabled": False},
    "rowwise": {"recipe": "rowwise"},  # another recipe than the layers' own (delayed)
}


def _model(frozen: bool, device: str = "cpu") -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)).to(device)
    convert_to_fp8(model, "delayed")
    if frozen:
        model[0].requires_grad_(False)
    return model


def _run(frozen: bool, steps: list[tuple[bool | None, str]], device: str = "cpu"):
    """Per step (use_reentrant or None for no checkpointing, setting name): the grads of the last step (input and
    trainable parameters) and the FP8 state after all steps (SGD and a scale update after each)."""
    model = _model(frozen, device)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    for step, (ckpt, setting) in enumerate(steps):
        torch.manual_seed(10 + step)
        x = torch.randn(32, 64).to(device).requires_grad_()
        opt.zero_grad()
        with fp8_autocast(**SETTINGS[setting]):
            y = model(x) if ckpt is None else checkpoint(model, x, use_reentrant=ckpt)
        y.square().mean().backward()
        grads = [x.grad.clone()] + [p.grad.clone() for p in model.parameters() if p.requires_grad]
        opt.step()
        sync_scales(model)
    return grads, fp8_state_dict(model)


def _assert_same(a, b, path=""):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (u, v) in enumerate(zip(a, b)):
            _assert_same(u, v, f"{path}[{i}]")
    elif torch.is_tensor(a):
        assert torch.equal(a, b), path
    else:
        assert a == b, path


@pytest.mark.parametrize("second", ["high_precision", "rowwise"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "trainable"])
def test_a_checkpointed_step_after_an_unchecked_one_replays_its_own_setting(frozen, mode, second):
    steps = [(None, "fp8"), (MODES[mode], second)]
    grads, state = _run(frozen, steps)
    ref_grads, ref_state = _run(frozen, [(None, "fp8"), (None, second)])
    _assert_same(grads, ref_grads)
    _assert_same(state, ref_state)  # amax histories and scales: the recompute booked nothing
    stale_grads, _ = _run(frozen, [(None, "fp8"), (None, "fp8")])  # what replaying step 1's setting computes
    assert not all(torch.equal(g, s) for g, s in zip(ref_grads, stale_grads))


@pytest.mark.parametrize("first", ["high_precision", "rowwise"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "trainable"])
def test_a_checkpointed_fp8_step_after_another_setting_replays_its_own(frozen, mode, first):
    """The other order: an unchecked step in high precision (whose backward runs no FP8 GEMM, so only a hook on its
    output can close the log) or under another recipe, then a checkpointed FP8 step."""
    grads, state = _run(frozen, [(None, first), (MODES[mode], "fp8")])
    ref_grads, ref_state = _run(frozen, [(None, first), (None, "fp8")])
    _assert_same(grads, ref_grads)
    _assert_same(state, ref_state)
    stale_grads, _ = _run(frozen, [(None, first), (None, first)])  # what replaying step 1's setting computes
    assert not all(torch.equal(g, s) for g, s in zip(ref_grads, stale_grads))


@pytest.mark.gpu
@requires_cuda_fp8
@pytest.mark.parametrize("mode", list(MODES))
def test_on_cuda_a_frozen_layer_replays_its_own_step(mode):
    """On a GPU the recompute runs on autograd's device thread; the logs are the module's, so the same holds."""
    steps = [(None, "fp8"), (MODES[mode], "high_precision")]
    grads, state = _run(True, steps, "cuda")
    ref_grads, ref_state = _run(True, [(None, "fp8"), (None, "high_precision")], "cuda")
    _assert_same(grads, ref_grads)
    _assert_same(state, ref_state)


@pytest.mark.parametrize("mode", list(MODES))
def test_the_other_order_and_a_third_step(mode):
    """Checkpointed first, then unchecked, then checkpointed again under a third setting (frozen first layer)."""
    steps = [(MODES[mode], "high_precision"), (None, "rowwise"), (MODES[mode], "fp8")]
    grads, state = _run(True, steps)
    ref_grads, ref_state = _run(True, [(None, s) for _, s in steps])
    _assert_same(grads, ref_grads)
    _assert_same(state, ref_state)


def test_a_no_grad_forward_after_a_backward_starts_the_grad_log_afresh():
    """How the log is keyed: a backward that reaches the module closes both logs; the next forward (here without
    grad, as reentrant checkpointing runs it) drops the closed grad log, so the recompute cannot find it."""
    model = _model(frozen=True)
    x = torch.randn(8, 64, requires_grad=True)
    with fp8_autocast() as first:
        model(x).sum().backward()
    log = model[0].__dict__["_fp8_forward_log"]
    assert log.state is first and log.closed  # the weight's version is unchanged: only the backward tells
    with torch.no_grad(), fp8_autocast(enabled=False):
        model(x)
    assert log.state is None
    assert not model[0].__dict__["_fp8_no_grad_forward_log"].closed


class _FrozenExperts(nn.Module):
    """Fixed routing into frozen FP8 GroupedExperts, then a trainable FP8 head."""

    def __init__(self):
        super().__init__()
        from fp8_lightning import GroupedExperts

        self.experts = GroupedExperts(64, 128, 4)
        self.head = nn.Linear(64, 64)
        self.register_buffer("offs", torch.tensor([10, 10, 40, 64], dtype=torch.int32))

    def forward(self, x):
        return self.head(self.experts(x, self.offs))


def _experts_grads(steps):
    torch.manual_seed(0)
    model = _FrozenExperts()
    convert_to_fp8(model, "tensorwise")
    model.experts.requires_grad_(False)
    for step, (ckpt, setting) in enumerate(steps):
        torch.manual_seed(10 + step)
        x = torch.randn(64, 64, requires_grad=True)
        with fp8_autocast(**SETTINGS[setting]):
            y = model(x) if ckpt is None else checkpoint(model, x, use_reentrant=ckpt)
        y.square().mean().backward()
    return x.grad


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("first, second", [("fp8", "high_precision"), ("high_precision", "fp8"), ("fp8", "rowwise")])
def test_frozen_experts_replay_their_own_step(mode, first, second):
    """The same for frozen FP8 experts: their outputs close the log when the backward reaches them (FP8 or not)."""
    grads = _experts_grads([(None, first), (MODES[mode], second)])
    reference = _experts_grads([(None, first), (None, second)])
    assert torch.equal(grads, reference)
    assert not torch.equal(reference, _experts_grads([(None, first), (None, first)]))  # a stale replay would fail
