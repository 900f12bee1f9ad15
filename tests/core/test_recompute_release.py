"""An output kept alive keeps no converted module alive.

A high-precision forward of a converted module hooks its output so that a backward reaching it closes the module's
recompute logs (:func:`fp8_lightning.recompute.close_on_backward`). The hook holds the module weakly: a graph kept
for later (a logged loss, an output stored for a metric) must not keep a deleted model, and what it refers to,
alive. The hook must still close the logs while the module lives.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn as nn

from fp8_lightning import GroupedExperts, convert_to_fp8, fp8_autocast
from fp8_lightning.recompute import ForwardLog

OFFS = torch.tensor([3, 3, 9, 16], dtype=torch.int32)


def _linear() -> tuple[nn.Module, callable]:
    model = nn.Sequential(nn.Linear(32, 32))
    convert_to_fp8(model, "delayed")
    return model[0], lambda: model(torch.randn(16, 32, requires_grad=True))


def _experts() -> tuple[nn.Module, callable]:
    model = nn.ModuleDict({"moe": GroupedExperts(32, 32, 4)})
    convert_to_fp8(model, "delayed")
    return model["moe"], lambda: model["moe"](torch.randn(16, 32, requires_grad=True), OFFS)


def _observed_experts() -> tuple[nn.Module, callable]:
    experts, run = _experts()
    experts.fp8_observer = lambda module, role, t, q: None  # as the stats monitor sets one: each cast is shown
    return experts, run


BUILDERS = {"linear": _linear, "experts": _experts, "observed_experts": _observed_experts}


def _logs(module: nn.Module) -> list[ForwardLog]:
    return [value for value in vars(module).values() if isinstance(value, ForwardLog)]


@pytest.mark.parametrize("kind", BUILDERS)
@pytest.mark.parametrize("fp8", [False, True], ids=["high_precision", "fp8"])
def test_an_output_kept_alive_does_not_keep_the_module(kind, fp8):
    torch.manual_seed(0)
    module, run = BUILDERS[kind]()
    with fp8_autocast():
        run()  # the first FP8 forward starts the logs: later high-precision outputs are hooked
    with fp8_autocast(enabled=fp8):
        out = run()
    assert out.requires_grad and _logs(module)
    ref = weakref.ref(module)
    del module, run
    gc.collect()
    assert ref() is None, "the output's graph keeps the converted module alive"
    out.sum().backward()  # the module is gone: the hook must not fail


@pytest.mark.parametrize("kind", BUILDERS)
def test_the_hook_still_closes_the_logs_of_a_live_module(kind):
    torch.manual_seed(0)
    module, run = BUILDERS[kind]()
    with fp8_autocast():
        run()
    with fp8_autocast(enabled=False):
        out = run()
    assert not any(log.closed for log in _logs(module))
    out.sum().backward()
    assert _logs(module) and all(log.closed for log in _logs(module))
