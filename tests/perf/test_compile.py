"""``torch.compile`` with every recipe: compiles once, never recompiles across optimizer steps, same numbers.

The scaling state changes every step (amax histories roll, scales move, the FP8 weight cache is refilled after
each optimizer step). Were it traced, it would become guards that fail every step; the counters below prove
that after the first step no frame is compiled again, with ``sync_scales`` between steps and without it.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from fp8_lightning import DelayedScaling, MXFP8BlockScaling, TensorwiseScaling, convert_to_fp8, fp8_autocast, sync_scales
from fp8_lightning.models import GPT

RECIPES = [DelayedScaling(), TensorwiseScaling(), MXFP8BlockScaling()]
STEPS = 4


def _train(recipe, backend: str | None, sync: bool = True) -> tuple[list[float], list[int]]:
    """Losses of ``STEPS`` SGD steps of a tiny GPT, and the compiled-frame count after each step."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(optimizer=functools.partial(torch.optim.SGD, lr=0.1), n_layer=1, n_embd=32, n_head=2, block_size=16)
    convert_to_fp8(model, recipe)
    optimizer = model.configure_optimizers()
    counter = CompileCounterWithBackend(backend) if backend else None
    forward = torch.compile(model, backend=counter) if counter else model
    tokens = torch.randint(0, 256, (2, 17))
    losses, frames = [], []
    for _ in range(STEPS):
        with fp8_autocast():
            logits = forward(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if sync:
            sync_scales(model)
        losses.append(loss.item())
        frames.append(counter.frame_count if counter else 0)
    return losses, frames


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_compiled_training_never_recompiles_and_matches_eager(recipe):
    eager_losses, _ = _train(recipe, backend=None)
    losses, frames = _train(recipe, backend="aot_eager")
    assert frames[0] > 0, "nothing was compiled"
    assert frames == [frames[0]] * STEPS, f"frames compiled after each step: {frames} (a recompilation happened)"
    assert losses == eager_losses  # the FP8 layers run the same code; aot_eager keeps the rest bit-exact
    assert losses[-1] < losses[0]


def test_delayed_scaling_without_sync_scales_does_not_recompile():
    """Layers then advance their delayed scales locally at the next forward: still no recompilation."""
    _, frames = _train(DelayedScaling(), backend="aot_eager", sync=False)
    assert frames == [frames[0]] * STEPS, frames


@pytest.mark.slow
def test_inductor_compiles_delayed_scaling_once():
    """The real CPU backend (inductor, C++ codegen): one compilation, numbers close to eager."""
    eager_losses, _ = _train(DelayedScaling(), backend=None)
    losses, frames = _train(DelayedScaling(), backend="inductor")
    assert frames == [frames[0]] * STEPS and frames[0] > 0, frames
    assert losses == pytest.approx(eager_losses, rel=1e-4)
