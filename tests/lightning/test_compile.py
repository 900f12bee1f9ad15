"""``Trainer(precision="fp8-...")`` with a LightningModule compiled by ``torch.compile(fullgraph=True)``: the
plugin converts the layers in place, the compiled forward traces them into one graph, and training matches the
uncompiled run (under ``aot_eager``, which runs the same operations)."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from fp8_lightning import FP8Linear
from fp8_lightning.lightning.strings import PRECISION_RECIPES

from .user_model import TinyTransformerLM, fit_trainer

STEPS = 6


class CompiledLM(TinyTransformerLM):
    """The user compiles the model's body where Lightning lets them: in ``configure_model``."""

    def __init__(self, backend: str):
        super().__init__()
        self.counter = CompileCounterWithBackend(backend)

    def configure_model(self):
        self.compiled = torch.compile(super().forward, backend=self.counter, fullgraph=True)

    def forward(self, tokens):
        return self.compiled(tokens)


@pytest.mark.parametrize("precision", list(PRECISION_RECIPES))
def test_trainer_precision_string_with_a_compiled_module(precision, monkeypatch):
    eager = fit_trainer(STEPS, precision=precision)
    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr("tests.lightning.user_model.TinyTransformerLM", lambda: CompiledLM("aot_eager"))
    compiled = fit_trainer(STEPS, precision=precision)
    assert isinstance(compiled, CompiledLM) and isinstance(compiled.blocks[0].fc1, FP8Linear)
    assert compiled.counter.frame_count == 1 and sum(counters["graph_break"].values()) == 0
    assert compiled.losses == eager.losses
