"""``torch.compile(model, fullgraph=True)`` with every recipe: one graph, never recompiled, the eager numbers.

The FP8 layers trace into the model's graph (:mod:`fp8_lightning.traced`): their scaling state is tensors that the
cast ops update in place. The counters prove one frame is compiled for the whole training forward, with no graph
break and no recompilation over ``STEPS`` optimizer steps while scales and histories move, and the losses and the
scaling state equal an eager run bit for bit under ``aot_eager`` (same ops, no fusion). Inductor fuses the code
around the FP8 layers (norms, GELU, attention) differently from eager, which FP8 rounding amplifies a little, so
there the comparison has a tolerance.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from fp8_lightning import (
    BlockwiseScaling,
    DelayedScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    RowwiseScaling,
    TensorwiseScaling,
    convert_to_fp8,
    fp8_autocast,
    sync_scales,
)
from fp8_lightning.saved_state import fp8_state_dict
from fp8_lightning.models import GPT

RECIPES = [
    DelayedScaling(), TensorwiseScaling(), MXFP8BlockScaling(), RowwiseScaling(),
    RowwiseScaling(high_precision_wgrad=True), BlockwiseScaling(), NVFP4BlockScaling(),
]
STEPS = 10


def _id(recipe) -> str:
    return recipe.name + ("_hp_wgrad" if getattr(recipe, "high_precision_wgrad", False) else "")


def _state(model) -> list[torch.Tensor]:
    """Every scaling-state tensor of the model, in order."""
    out = []
    for layer in fp8_state_dict(model).values():
        for entry in layer["scalings"]:
            for operand in entry["operands"].values():
                out += [v for v in operand.values() if torch.is_tensor(v)]
    return out


def _train(recipe, backend: str | None, steps: int = STEPS, micro_batches: int = 1, sync: bool = True):
    """Losses of ``steps`` SGD steps of a tiny GPT, compiled frames after each step, graph breaks, final state."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = GPT(optimizer=functools.partial(torch.optim.SGD, lr=0.1), n_layer=1, n_embd=32, n_head=2, block_size=16)
    convert_to_fp8(model, recipe)
    optimizer = model.configure_optimizers()
    counter = CompileCounterWithBackend(backend) if backend else None
    forward = torch.compile(model, backend=counter, fullgraph=True) if counter else model
    tokens = torch.randint(0, 256, (2 * micro_batches, 17))
    losses, frames = [], []
    for _ in range(steps):
        for batch in tokens.chunk(micro_batches):
            with fp8_autocast():
                logits = forward(batch[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()) / micro_batches
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
        if sync:
            sync_scales(model)
        frames.append(counter.frame_count if counter else 0)
    return losses, frames, sum(counters["graph_break"].values()), _state(model)


@pytest.fixture(scope="module")
def eager_runs():
    return {recipe: _train(recipe, backend=None) for recipe in RECIPES}


@pytest.mark.parametrize("recipe", RECIPES, ids=_id)
def test_fullgraph_compiles_one_graph_once_and_matches_eager_bit_for_bit(recipe, eager_runs):
    losses, frames, breaks, state = _train(recipe, backend="aot_eager")
    eager_losses, _, _, eager_state = eager_runs[recipe]
    assert frames == [1] * STEPS, f"compiled frames after each step: {frames}"
    assert breaks == 0
    assert losses == eager_losses
    assert len(state) == len(eager_state) and all(torch.equal(a, b) for a, b in zip(state, eager_state))
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("recipe", RECIPES[:3] + [BlockwiseScaling()], ids=_id)  # rowwise runs the same custom ops
def test_inductor_compiles_once_and_stays_close_to_eager(recipe, eager_runs):
    losses, frames, breaks, _ = _train(recipe, backend="inductor", steps=4)
    assert frames == [1] * 4 and breaks == 0, (frames, breaks)
    assert losses == pytest.approx(eager_runs[recipe][0][:4], rel=1e-3)


@pytest.mark.parametrize("recipe", [DelayedScaling(), MXFP8BlockScaling()], ids=lambda r: r.name)
def test_gradient_accumulation_compiles_once_and_matches_eager(recipe):
    """Two micro-batches per optimizer step: the delayed pending amax is the max over both, as in eager mode."""
    eager_losses, _, _, eager_state = _train(recipe, backend=None, steps=4, micro_batches=2)
    losses, frames, breaks, state = _train(recipe, backend="aot_eager", steps=4, micro_batches=2)
    assert frames == [1] * 4 and breaks == 0
    assert losses == eager_losses
    assert all(torch.equal(a, b) for a, b in zip(state, eager_state))


def test_compiled_delayed_state_moves_between_steps():
    """The traced casts really update the scaling state: histories fill, scales change, flags are reset by sync."""
    _, _, _, state = _train(DelayedScaling(amax_history_len=4), backend="aot_eager", steps=3)
    _, _, _, first = _train(DelayedScaling(amax_history_len=4), backend="aot_eager", steps=1)
    histories = [t for t in state if t.shape == (4,)]
    assert histories and all((h[:3] > 0).all() and h[3] == 0 for h in histories)  # three steps booked, one empty
    assert any(not torch.equal(a, b) for a, b in zip(state, first))


def test_an_observed_layer_runs_as_an_eager_island():
    """The stats monitor watches each cast in Python: compiled without fullgraph, the layer is a graph break and
    its numbers are the eager ones."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 32)
    convert_to_fp8(layer, TensorwiseScaling())
    seen = []
    layer.fp8_observer = lambda module, role, x, q: seen.append(role)
    x = torch.randn(4, 32)
    with fp8_autocast():
        eager = layer(x)
        compiled = torch.compile(layer, backend="aot_eager")(x)
    assert torch.equal(eager, compiled)
    assert seen == ["input", "weight"] * 2
