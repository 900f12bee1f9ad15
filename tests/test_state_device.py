"""A layer's FP8 scaling states follow its weight: converted on the CPU and moved with ``.to()`` / ``.cuda()``,
the compiled layer step finds them on the device of the tensors it casts."""

from __future__ import annotations

import pytest
import torch

from fp8_lightning import FP8Linear, fp8_autocast
from fp8_lightning.recipes import DelayedScaling, TensorwiseScaling
from tests.conftest import requires_cuda_fp8


def state_tensors(layer: FP8Linear) -> list[torch.Tensor]:
    return [getattr(state, name) for _, scaling in layer.fp8_scalings() for state in scaling.operands.values()
            for name in ("scale", "amax_history", "pending_amax", "last_amax", "nonfinite_count", "flags")]


def test_a_dtype_move_leaves_the_states_in_float32_and_training_on():
    layer = FP8Linear.from_linear(torch.nn.Linear(32, 16), DelayedScaling())
    with fp8_autocast():
        layer(torch.randn(4, 32)).sum().backward()
    before = [t.dtype for t in state_tensors(layer)]
    layer.double()
    assert layer.weight.dtype == torch.float64
    assert [t.dtype for t in state_tensors(layer)] == before  # the states keep their own dtypes
    with fp8_autocast():
        out = layer(torch.randn(4, 32, dtype=torch.float64))
    assert out.dtype == torch.float64 and torch.isfinite(out).all()


def test_a_meta_move_leaves_the_states_where_their_values_are():
    layer = FP8Linear.from_linear(torch.nn.Linear(32, 16), TensorwiseScaling())
    layer.to("meta")
    assert layer.weight.is_meta
    assert all(t.device.type == "cpu" for t in state_tensors(layer))  # a meta tensor holds no values to keep


@pytest.mark.gpu
@requires_cuda_fp8
@pytest.mark.parametrize("recipe", [DelayedScaling(), TensorwiseScaling()], ids=lambda r: r.name)
def test_compiled_step_after_cuda_move_updates_the_states_on_the_gpu(recipe):
    torch.manual_seed(0)
    eager = FP8Linear.from_linear(torch.nn.Linear(256, 128), recipe)  # converted on the CPU
    compiled = FP8Linear.from_linear(torch.nn.Linear(256, 128), recipe)
    compiled.load_state_dict(eager.state_dict())
    eager.cuda(), compiled.cuda()
    assert all(t.is_cuda for t in state_tensors(compiled))
    step = torch.compile(compiled, fullgraph=True)
    x = torch.randn(64, 256, device="cuda")
    for layer in (eager, step):
        for _ in range(2):
            with fp8_autocast():
                layer(x).square().mean().backward()
    torch.testing.assert_close(compiled.weight.grad, eager.weight.grad, rtol=2.0**-10, atol=0)
    assert all(t.is_cuda for t in state_tensors(compiled))
    for (_, ours), (_, theirs) in zip(compiled.fp8_scalings(), eager.fp8_scalings()):
        for role, state in ours.operands.items():
            other = theirs.operands[role]
            for name in ("scale", "amax_history", "pending_amax", "last_amax", "nonfinite_count", "observed"):
                torch.testing.assert_close(getattr(state, name), getattr(other, name), msg=f"{role} {name}")
            assert state.initialized == other.initialized


def test_every_module_move_sends_the_states_to_the_weights_device(monkeypatch):
    from fp8_lightning.scaling import OperandScaling

    layer = FP8Linear.from_linear(torch.nn.Linear(32, 16), DelayedScaling())
    moves = []
    monkeypatch.setattr(OperandScaling, "move_to", lambda self, device: moves.append(device))
    layer.to(torch.float64)
    layer.float()
    assert moves == [layer.weight.device] * (2 * len(layer.fp8_scaling().operands))
