"""A recipe defined here, and nowhere in the library, trains end to end: the proof that the recipe protocol is the
whole interface (``fp8_lightning/recipes/base.py``).

``FixedPowerOf2Scaling`` scales every operand by one fixed power of two, ``data = saturate(x * 2**exponent)``. It
goes through the Lightning plugin, ``torch.compile(fullgraph=True)``, FSDP2's FP8 all-gather with FP8 gradient
reduce-scatter on 2 gloo processes, and a checkpoint save and load. Its numbers are checked against the same
arithmetic written out here in float64.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import ClassVar

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn as nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, TensorDataset

from fp8_lightning import FP8Linear, convert_to_fp8, fp8_autocast, fp8_state_dict, load_fp8_state_dict, recipe_from
from fp8_lightning.recipes import PerTensorRecipe
from fp8_lightning.testing import free_port

E4M3_MAX = 448.0


@dataclasses.dataclass(frozen=True)
class FixedPowerOf2Scaling(PerTensorRecipe):
    """Every operand scaled by ``2**exponent`` (E4M3 forward, E5M2 gradients): no amax decides anything."""

    name: ClassVar[str] = "test_fixed_power_of_2"

    exponent: int = 3

    def just_in_time_scale(self, state, clean_amax, host_amax):
        return torch.full((), 2.0**self.exponent, device=clean_amax.device)

    def traced_scale(self, clean, scale, flags, dtype):
        return torch.full_like(scale, 2.0**self.exponent)


RECIPE = FixedPowerOf2Scaling()


def _fp8(x: torch.Tensor, exponent: int, dtype: torch.dtype, limit: float) -> torch.Tensor:
    """The float64 value each element stands for after the recipe's cast."""
    scale = 2.0**exponent
    return (x.double() * scale).clamp(-limit, limit).to(dtype).double() / scale


def test_the_recipe_is_found_by_name_and_round_trips_as_a_dict():
    assert recipe_from("test_fixed_power_of_2") == RECIPE
    assert recipe_from(RECIPE.to_dict()) == RECIPE
    assert recipe_from({"name": "test_fixed_power_of_2", "exponent": 5}).exponent == 5


def test_layer_forward_and_backward_are_the_recipe_arithmetic():
    torch.manual_seed(0)
    layer = FP8Linear.from_linear(nn.Linear(64, 32), RECIPE)
    x = torch.randn(16, 64, requires_grad=True)
    g = torch.randn(16, 32)
    with fp8_autocast():
        y = layer(x)
    y.backward(g)
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    xq, wq = _fp8(x.detach(), 3, e4m3, E4M3_MAX), _fp8(layer.weight.detach(), 3, e4m3, E4M3_MAX)
    gq = _fp8(g, 3, e5m2, 57344.0)
    want_y = xq @ wq.T + layer.bias.detach().double()
    torch.testing.assert_close(y.double(), want_y, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), gq @ wq, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(layer.weight.grad.double(), gq.T @ xq, rtol=1e-6, atol=1e-4)
    assert layer.fp8_scaling(RECIPE).operands["input"].scale.item() == 8.0


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))


def _train(model, forward, steps: int = 4) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(1)
    x, target = torch.randn(16, 32), torch.randn(16, 32)
    losses = []
    for _ in range(steps):
        with fp8_autocast():
            loss = ((forward(x) - target) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_fullgraph_compile_is_one_graph_with_the_eager_numbers():
    eager_model = _model()
    convert_to_fp8(eager_model, RECIPE)
    eager = _train(eager_model, eager_model)
    torch._dynamo.reset()
    counters.clear()
    model = _model()
    convert_to_fp8(model, RECIPE)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = _train(model, torch.compile(model, backend=counter, fullgraph=True))
    assert counter.frame_count == 1 and sum(counters["graph_break"].values()) == 0
    assert compiled == eager and eager[-1] < eager[0]


class _Lit:
    """A LightningModule of two FP8 layers (made lazily: Lightning is imported by the tests that use it)."""

    @staticmethod
    def make():
        import lightning.pytorch as pl

        class Lit(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = _model()
                self.losses: list[float] = []

            def training_step(self, batch, batch_idx):
                x, y = batch
                loss = ((self.net(x) - y) ** 2).mean()
                self.losses.append(loss.item())
                return loss

            def train_dataloader(self):
                torch.manual_seed(2)
                return DataLoader(TensorDataset(torch.randn(64, 32), torch.randn(64, 32)), batch_size=16)

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.05)

        return Lit()


def _trainer(epochs: int, **kwargs):
    import lightning.pytorch as pl

    from fp8_lightning import FP8Precision

    return pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=epochs, plugins=[FP8Precision(recipe=RECIPE)], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs
    )


def test_lightning_plugin_trains_and_a_checkpoint_resumes_the_same_run(tmp_path):
    straight = _Lit.make()
    _trainer(2).fit(straight)
    assert all(isinstance(m, FP8Linear) and m.fp8_recipe == RECIPE for m in straight.net if isinstance(m, nn.Linear))
    first = _Lit.make()
    trainer = _trainer(1)
    trainer.fit(first)
    path = tmp_path / "fixed.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    layers = saved["FP8Precision"]["modules"][0]
    assert {entry["recipe"]["name"] for layer in layers.values() for entry in layer["scalings"]} == {RECIPE.name}
    resumed = _Lit.make()
    _trainer(2).fit(resumed, ckpt_path=path)
    assert first.losses + resumed.losses == straight.losses
    assert straight.losses[-1] < straight.losses[0]
    # the FP8 state round-trips outside Lightning too
    model = _model()
    convert_to_fp8(model, RECIPE)
    load_fp8_state_dict(model, fp8_state_dict(straight.net))


def _fsdp_worker(rank: int, world: int, port: int, out: dict) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world)
    )
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from fp8_lightning.lightning.fsdp import FP8FSDPStrategy
    from fp8_lightning.testing import end_worker
    from tests.distributed._lightning_workers import fit, make_module

    module = make_module()
    trainer, losses = fit(module, FP8FSDPStrategy(fp8_reduce_scatter=True), recipe=RECIPE)
    report = trainer.strategy.all_gather_report
    out[rank] = {
        "losses": losses,
        "fp8_gathers": len(report.fp8),
        "high_precision_gathers": len(report.high_precision),
        "recipes": sorted({type(m.fp8_recipe).__name__ for m in module.modules() if isinstance(m, FP8Linear)}),
    }
    end_worker()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore")
def test_fsdp2_gathers_and_reduces_in_fp8_on_two_processes():
    out = mp.Manager().dict()
    mp.spawn(_fsdp_worker, args=(2, free_port(), out), nprocs=2)
    first, second = out[0], out[1]
    assert first == second  # the same losses on both ranks, the same gathers
    assert first["recipes"] == ["FixedPowerOf2Scaling"]
    assert first["fp8_gathers"] > 0 and first["high_precision_gathers"] == 0
    assert all(loss == loss for loss in first["losses"]) and first["losses"][-1] < first["losses"][0]
