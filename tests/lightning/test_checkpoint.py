"""Checkpoints: a resumed FP8 run reproduces the uninterrupted one exactly (CPU), the scaling state travels in
the plugin's entry, and the model's state_dict interchanges with plain-precision runs both ways."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from fp8_lightning import FP8Precision, fp8_state_dict

from .user_model import TinyTransformerLM, markov_tokens, trainer_kwargs

N_SAMPLES, BATCH = 128, 32  # 4 optimizer steps per epoch


def data() -> DataLoader:
    return DataLoader(TensorDataset(markov_tokens(N_SAMPLES)), batch_size=BATCH, shuffle=False)


def val_data() -> DataLoader:
    return DataLoader(TensorDataset(markov_tokens(32, seed=99)), batch_size=BATCH)


def run(epochs: int, ckpt_in=None, ckpt_out=None, seed: int = 0, **overrides):
    L.seed_everything(seed, verbose=False)
    model = TinyTransformerLM()
    kwargs = trainer_kwargs(limit_val_batches=1, **overrides)
    trainer = L.Trainer(max_epochs=epochs, **kwargs)
    trainer.fit(model, data(), val_data(), ckpt_path=ckpt_in)
    if ckpt_out is not None:
        trainer.save_checkpoint(ckpt_out)
    return model, trainer


def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path):
    full, full_trainer = run(3, precision="fp8-hybrid")
    ckpt = tmp_path / "epoch1.ckpt"
    first, _ = run(1, ckpt_out=ckpt, precision="fp8-hybrid")
    saved = torch.load(ckpt, weights_only=True)
    saved_fc1 = saved["FP8Precision"]["modules"][0]["blocks.0.fc1"]["scalings"][0]["operands"]["input"]
    assert torch.equal(saved_fc1["amax_history"], first.blocks[0].fc1.fp8_scaling().operands["input"].amax_history)
    assert set(saved["FP8Precision"]["modules"][0]) == {n for n, m in full.named_modules() if hasattr(m, "fp8_recipe")}
    resumed, resumed_trainer = run(3, ckpt_in=ckpt, seed=123, precision="fp8-hybrid")  # seed must not matter
    assert resumed.losses == full.losses[len(first.losses):]  # bit-for-bit the same losses
    for (name, p), q in zip(full.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
    a, b = fp8_state_dict(full), fp8_state_dict(resumed)
    for layer in a:
        for sa, sb in zip(a[layer]["scalings"], b[layer]["scalings"]):
            for role in sa["operands"]:
                for key, value in sa["operands"][role].items():
                    other = sb["operands"][role][key]
                    assert torch.equal(torch.as_tensor(value), torch.as_tensor(other)), (layer, role, key)
    assert resumed_trainer.precision_plugin.optimizer_steps == full_trainer.precision_plugin.optimizer_steps


def test_fp8_checkpoint_loads_into_plain_fp32_training_and_back(tmp_path):
    plain = TinyTransformerLM()
    fp8_ckpt, plain_ckpt = tmp_path / "fp8.ckpt", tmp_path / "plain.ckpt"
    fp8_model, _ = run(1, ckpt_out=fp8_ckpt, precision="fp8-hybrid")
    state = torch.load(fp8_ckpt, weights_only=True)["state_dict"]
    reference = plain.state_dict()
    assert list(state) == list(reference)
    assert all(state[k].shape == reference[k].shape and state[k].dtype == reference[k].dtype for k in state)
    plain.load_state_dict(state, strict=True)  # into a model that never saw FP8

    # FP8 -> plain Trainer: resumes (the FP8Precision entry is simply not used) and keeps training
    resumed_plain, _ = run(2, ckpt_in=fp8_ckpt, ckpt_out=plain_ckpt, precision="32-true")
    assert len(resumed_plain.losses) == N_SAMPLES // BATCH and all(torch.isfinite(torch.tensor(resumed_plain.losses)))
    assert "FP8Precision" not in torch.load(plain_ckpt, weights_only=True)

    # plain -> FP8 Trainer: starts from the plain weights with fresh scaling state
    back, back_trainer = run(3, ckpt_in=plain_ckpt, precision="fp8-hybrid")
    assert len(back.losses) == N_SAMPLES // BATCH and all(torch.isfinite(torch.tensor(back.losses)))
    assert back_trainer.precision_plugin.optimizer_steps == N_SAMPLES // BATCH  # counted from the resume


def test_state_loaded_before_setup_is_applied_at_conversion():
    model = TinyTransformerLM()
    source = FP8Precision()
    source.convert_module(model)
    layer = model.blocks[0].fc1
    layer.fp8_scaling().operands["input"].scale.fill_(7.0)
    layer.fp8_disabled_reason = "test"
    state = source.state_dict()

    target, fresh = FP8Precision(), TinyTransformerLM()
    target.load_state_dict(state)  # nothing converted yet: kept until convert_module
    target.convert_module(fresh)
    assert fresh.blocks[0].fc1.fp8_scaling().operands["input"].scale.item() == 7.0
    assert fresh.blocks[0].fc1.fp8_disabled_reason == "test"


def test_checkpoint_from_another_model_is_refused():
    small, plugin = TinyTransformerLM(layers=1), FP8Precision()
    plugin.convert_module(small)
    other, bigger = FP8Precision(), TinyTransformerLM()
    other.convert_module(bigger)
    with pytest.raises(KeyError, match="missing .*blocks.1"):
        other.load_state_dict(plugin.state_dict())


@pytest.mark.parametrize("saved_replicas", [1, 2])
def test_another_data_parallel_size_restarts_only_the_delayed_gradient_scales(saved_replicas):
    """Each data-parallel replica's loss averages its own share of the batch, so a resume with another number of
    replicas sees output gradients of another size: their delayed scales are made afresh from the first backward
    (histories kept), while activation and weight scales continue. The same number restores everything as is."""
    from fp8_lightning import fp8_autocast
    from fp8_lightning.saved_state import fp8_state_checksum

    torch.manual_seed(0)
    model, source = TinyTransformerLM(), FP8Precision(recipe="delayed")
    source.convert_module(model)
    with fp8_autocast():
        model.loss((markov_tokens(4),)).backward()
    source.fp8_after_optimizer_step()
    state = source.state_dict()
    assert state["data_parallel_replicas"] == 1  # one process
    state["data_parallel_replicas"] = saved_replicas
    state["checksum"] = fp8_state_checksum({k: v for k, v in state.items() if k != "checksum"})

    target, fresh = FP8Precision(recipe="delayed"), TinyTransformerLM()
    target.convert_module(fresh)
    target.load_state_dict(state)
    saved, loaded = state["modules"][0], fp8_state_dict(fresh)
    for layer in saved:
        for role, entry in saved[layer]["scalings"][0]["operands"].items():
            here = loaded[layer]["scalings"][0]["operands"][role]
            assert all(torch.equal(entry[k], here[k]) for k in ("scale", "amax_history")), (layer, role)
            restarted = role == "grad_output" and saved_replicas != 1
            assert here["initialized"] is not restarted, (layer, role)
