"""FP8StatsMonitor read back from a CSVLogger run, and the divergence guard rescuing runs with an injected NaN
and an injected overflow."""

import csv
import math

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from fp8_lightning import DivergenceGuard, FP8Precision, FP8StatsMonitor
from fp8_lightning.formats import fp8_max

from .user_model import TinyTransformerLM, loader, trainer_kwargs


def read_csv(path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_monitor_logs_every_n_steps_to_csv_and_summarises(tmp_path):
    L.seed_everything(0, verbose=False)
    model = TinyTransformerLM()
    head_input_amax = {}  # independent record of the head's input amax per optimizer step
    model.head.register_forward_pre_hook(
        lambda m, args: head_input_amax.__setitem__(model.trainer.global_step, args[0].detach().abs().max().item())
    )
    monitor = FP8StatsMonitor(log_every_n_steps=3, print_summary=False)
    logger = CSVLogger(tmp_path, name="run")
    trainer = L.Trainer(max_steps=7, callbacks=[monitor], **trainer_kwargs(logger=logger, precision="fp8-hybrid"))
    trainer.fit(model, loader())

    rows = [r for r in read_csv(tmp_path / "run" / "version_0" / "metrics.csv") if r.get("fp8/head/input/amax")]
    assert [int(r["step"]) for r in rows] == [0, 3, 6]
    for r in rows:
        step = int(r["step"])
        assert float(r["fp8/head/input/amax"]) == pytest.approx(head_input_amax[step], rel=1e-6)
        for role in ("input", "weight", "grad_output"):
            for layer in ("blocks.0.qkv", "blocks.1.fc2", "head"):
                prefix = f"fp8/{layer}/{role}"
                assert float(r[f"{prefix}/amax"]) > 0 and float(r[f"{prefix}/scale"]) > 0
                assert 0 <= float(r[f"{prefix}/overflow"]) <= 1 and 0 <= float(r[f"{prefix}/underflow"]) <= 1
    # the scale logged for step 3 is the delayed scale of that step: fp8_max / max(amax of steps 0..2)
    weight_history = [float(r["fp8/head/weight/amax"]) for r in rows]
    assert float(rows[1]["fp8/head/weight/scale"]) <= fp8_max(torch.float8_e4m3fn) / weight_history[0] * 1.0001
    assert "FP8 layers closest to trouble" in monitor.summary and "head" in monitor.summary
    assert all(m.fp8_observer is None for m in model.modules() if hasattr(m, "fp8_observer"))  # removed at teardown


def test_no_observer_without_monitor_or_guard():
    L.seed_everything(0, verbose=False)
    model = TinyTransformerLM()
    L.Trainer(max_steps=1, **trainer_kwargs(precision="fp8-hybrid")).fit(model, loader())
    assert all(m.fp8_observer is None for m in model.modules() if hasattr(m, "fp8_observer"))
    assert "_fp8_stats_collector" not in model.__dict__


def _fit_with_injection(inject, guard: DivergenceGuard, steps: int = 10, tmp_path=None):
    L.seed_everything(0, verbose=False)
    model = TinyTransformerLM()
    inject(model)
    plugin = FP8Precision(divergence_guard=guard)
    logger = CSVLogger(tmp_path, name="guard") if tmp_path is not None else False
    monitor = FP8StatsMonitor(log_every_n_steps=1, print_summary=False)
    trainer = L.Trainer(max_steps=steps, plugins=[plugin], callbacks=[monitor], **trainer_kwargs(logger=logger))
    trainer.fit(model, loader())
    return model, plugin, monitor, trainer


def test_guard_falls_back_on_nan_gradient_and_training_continues(tmp_path):
    bad_step = 3

    def inject(model):
        def poison(module, args, out):
            if module.training and model.trainer.global_step == bad_step:
                out.register_hook(lambda g: g.index_fill(-1, torch.tensor([0]), float("nan")))

        model.blocks[1].fc2.register_forward_hook(poison)

    with pytest.warns(UserWarning, match="'blocks.1.fc2' falls back to high precision: non-finite amax in grad_output"):
        model, plugin, monitor, trainer = _fit_with_injection(inject, DivergenceGuard(), tmp_path=tmp_path)
    assert all(math.isfinite(x) for x in model.losses)
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the poisoned step was skipped
    assert plugin.skipped_steps == 1
    events = plugin.guard_state.events
    assert [(e.layer, e.kind, e.step) for e in events] == [("blocks.1.fc2", "nonfinite", bad_step)]
    assert model.blocks[1].fc2.fp8_disabled_reason.startswith("non-finite amax in grad_output")
    assert model.blocks[0].fc2.fp8_disabled_reason is None  # NaN reached it, but it did not start there
    assert "blocks.1.fc2" in monitor.summary and "fell back" in monitor.summary
    metrics = read_csv(tmp_path / "guard" / "version_0" / "metrics.csv")
    assert [int(r["step"]) for r in metrics if r.get("fp8_guard/blocks.1.fc2")] == [bad_step]
    # the decision is kept in the checkpoint
    ckpt = tmp_path / "guard.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)["FP8Precision"]
    assert saved["modules"][0]["blocks.1.fc2"]["disabled_reason"] == model.blocks[1].fc2.fp8_disabled_reason
    assert saved["guard"]["events"][0]["layer"] == "blocks.1.fc2"
    fresh_plugin, fresh = FP8Precision(divergence_guard=True), TinyTransformerLM()
    fresh_plugin.convert_module(fresh)
    fresh_plugin.load_state_dict(saved)
    assert fresh.blocks[1].fc2.fp8_disabled_reason == model.blocks[1].fc2.fp8_disabled_reason
    assert fresh_plugin.guard_state.disabled_layers == {"blocks.1.fc2"}


def test_guard_falls_back_after_patience_steps_of_overflow():
    start, patience = 2, 2

    def inject(model):
        def grow(module, args):  # the input of fc1 grows 1000x per step from `start` on: a stale delayed scale
            step = model.trainer.global_step
            if module.training and start <= step < start + patience + 2:
                return (args[0] * 1000.0 ** (step - start + 1),)

        model.blocks[0].fc1.register_forward_pre_hook(grow)

    guard = DivergenceGuard(overflow_threshold=0.05, patience=patience)
    with pytest.warns(UserWarning, match="'blocks.0.fc1' falls back .*input overflow fraction above 0.05 for 2"):
        model, plugin, _, _ = _fit_with_injection(inject, guard, steps=8)
    event = next(e for e in plugin.guard_state.events if e.layer == "blocks.0.fc1")
    assert (event.role, event.kind, event.step) == ("input", "overflow", start + patience - 1)
    assert model.blocks[0].fc1.fp8_disabled_reason == event.reason
    assert plugin.skipped_steps == 0
    assert all(math.isfinite(x) for x in model.losses)
    casts = model.blocks[0].fc1.fp8_weight_casts
    assert casts == start + patience  # no FP8 casts after the fallback


def test_trouble_table_keeps_whole_layer_names():
    from fp8_lightning.lightning.callbacks import TroubleRow, format_table

    name = "model.layers.11.self_attn.q_proj.some_long_wrapper"
    table = format_table([TroubleRow(name, "input"), TroubleRow("head", "weight")])
    assert f"{name} input" in table and "\nhead " in table
