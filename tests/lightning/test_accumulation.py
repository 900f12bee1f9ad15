"""Gradient accumulation: weights are cast to FP8 once per optimizer step, amax histories advance once per
step with the max over the step's micro-batches, and the scale sync runs once per optimizer step."""

import lightning as L
import torch

import fp8_lightning.lightning.plugin_base as plugin_base
from fp8_lightning import FP8Linear

from .user_model import TinyTransformerLM, loader, trainer_kwargs

STEPS, ACCUMULATE = 3, 4


def test_weights_cast_once_per_optimizer_step_with_accumulation(monkeypatch):
    syncs = []
    real_sync = plugin_base.sync_scales
    monkeypatch.setattr(plugin_base, "sync_scales", lambda m, g=None: syncs.append(1) or real_sync(m, g))

    L.seed_everything(0, verbose=False)
    model = TinyTransformerLM()
    micro_amaxes: list[float] = []  # the input amax of fc1 per micro-batch, from an independent hook
    model.blocks[0].fc1.register_forward_pre_hook(
        lambda m, args: micro_amaxes.append(args[0].detach().double().abs().max().item()) if m.training else None
    )
    trainer = L.Trainer(max_steps=STEPS, accumulate_grad_batches=ACCUMULATE, **trainer_kwargs(precision="fp8-hybrid"))
    trainer.fit(model, loader())

    assert len(model.losses) == STEPS * ACCUMULATE  # 12 micro-batches
    assert trainer.global_step == STEPS
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    # not 12; + 1: a layer's first reuse casts again (it takes checksums of the weight from then on)
    assert layers and all(layer.fp8_weight_casts == STEPS + 1 for layer in layers)
    assert len(syncs) == STEPS and trainer.precision_plugin.optimizer_steps == STEPS

    # the history advanced once per optimizer step, each entry the max over that step's 4 micro-batches
    history = model.blocks[0].fc1.fp8_scaling().operands["input"].amax_history
    per_step = [max(micro_amaxes[i * ACCUMULATE:(i + 1) * ACCUMULATE]) for i in range(STEPS)]
    expected = torch.tensor(per_step[::-1], dtype=torch.float32)  # newest first
    assert torch.equal(history[:STEPS], expected)
    assert torch.count_nonzero(history[STEPS:]) == 0


def test_without_accumulation_one_cast_per_micro_batch():
    L.seed_everything(0, verbose=False)
    model = TinyTransformerLM()
    L.Trainer(max_steps=STEPS, **trainer_kwargs(precision="fp8-tensorwise")).fit(model, loader())
    assert model.head.fp8_weight_casts == STEPS
