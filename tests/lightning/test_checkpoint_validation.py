"""A damaged checkpoint is refused with one clear message, never resumed into NaN.

The plugin's entry carries a checksum of the FP8 state and is checked on load (finite, positive scales; histories
of the shapes the model holds), naming the checkpoint; a truncated or byte-flipped Lightning file is caught before
``torch.load`` reads it.
"""

import os

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from fp8_lightning import FP8Precision, convert_to_fp8, fp8_state_dict, load_fp8_state_dict
from fp8_lightning.saved_state import fp8_state_checksum
from fp8_lightning.lightning.checkpoint import CheckpointFileError, check_checkpoint_file

from .user_model import TinyTransformerLM, markov_tokens, trainer_kwargs


def _fit(epochs: int, ckpt_in=None, ckpt_out=None):
    L.seed_everything(0, verbose=False)
    model = TinyTransformerLM()
    trainer = L.Trainer(max_epochs=epochs, precision="fp8-hybrid", **trainer_kwargs(limit_val_batches=0))
    trainer.fit(model, DataLoader(TensorDataset(markov_tokens(64)), batch_size=32), ckpt_path=ckpt_in)
    if ckpt_out is not None:
        trainer.save_checkpoint(ckpt_out)
    return model, trainer


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "epoch1.ckpt"
    _fit(1, ckpt_out=path)
    return path


def _first_operand(state: dict) -> dict:
    layer = next(iter(state["FP8Precision"]["modules"][0].values()))
    return layer["scalings"][0]["operands"]["input"]


def test_a_nan_scale_planted_in_the_checkpoint_is_refused_naming_it(saved, tmp_path):
    """Guards against resuming with a NaN scale in the FP8 state (it trained into NaN): the Trainer's resume fails
    before the first step, and the error names the checkpoint file and the fix."""
    state = torch.load(saved, weights_only=True)
    _first_operand(state)["scale"] = torch.tensor(float("nan"))
    entry = state["FP8Precision"]
    entry["checksum"] = fp8_state_checksum({k: v for k, v in entry.items() if k != "checksum"})  # a consistent edit
    planted = tmp_path / "planted.ckpt"
    torch.save(state, planted)
    with pytest.raises(ValueError, match=r"checkpoint .*planted\.ckpt is corrupted: .*'scale' = nan is not finite"):
        _fit(2, ckpt_in=planted)


@pytest.mark.parametrize("value", [0.0, -2.0, float("inf")])
def test_a_scale_that_is_not_finite_and_positive_is_refused(value):
    """Guards the scale check without a checksum (an older entry, or fp8_state_dict used directly)."""
    model = TinyTransformerLM()
    convert_to_fp8(model)
    state = fp8_state_dict(model)
    next(iter(state.values()))["scalings"][0]["operands"]["input"]["scale"] = torch.tensor(value)
    with pytest.raises(ValueError, match="checkpoint /x/y.ckpt is corrupted: .*scales (and amaxes )?must be"):
        load_fp8_state_dict(model, state, source="/x/y.ckpt")


def test_a_changed_byte_in_the_fp8_entry_fails_its_checksum(saved):
    """Guards against a silently changed FP8 entry: a finite, positive but altered value fails the checksum."""
    state = torch.load(saved, weights_only=True)["FP8Precision"]
    operand = next(iter(state["modules"][0].values()))["scalings"][0]["operands"]["weight"]
    operand["amax_history"] = operand["amax_history"] * 1.5
    model = TinyTransformerLM()
    plugin = FP8Precision()
    plugin.convert_module(model)
    plugin.checkpoint_path = "/runs/x.ckpt"
    before = fp8_state_dict(model)
    with pytest.raises(ValueError, match=r"checkpoint /runs/x.ckpt fails its checksum .*delete its 'FP8Precision'"):
        plugin.load_state_dict(state)
    after = fp8_state_dict(model)  # nothing was restored
    first = next(iter(before))
    assert torch.equal(before[first]["scalings"][0]["operands"]["weight"]["amax_history"],
                       after[first]["scalings"][0]["operands"]["weight"]["amax_history"])


def test_a_history_of_another_shape_names_the_checkpoint():
    """Guards the shape check: a history of another length is refused before anything is restored, naming the
    file."""
    model = TinyTransformerLM()
    convert_to_fp8(model)
    state = fp8_state_dict(model)
    next(iter(state.values()))["scalings"][0]["operands"]["input"]["amax_history"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"checkpoint /c.ckpt does not fit this model: .*shape \(3,\) there"):
        load_fp8_state_dict(model, state, source="/c.ckpt")


def test_a_valid_checkpoint_still_resumes(saved):
    """Guards against the checks refusing a good checkpoint (the checksum is stable across save and load)."""
    model, trainer = _fit(2, ckpt_in=saved)
    assert trainer.precision_plugin.optimizer_steps == 4 and all(map(torch.isfinite, map(torch.tensor, model.losses)))


@pytest.mark.parametrize("cut", ["empty", "half", "tail"])
def test_a_truncated_checkpoint_file_gives_one_clear_message(saved, tmp_path, cut):
    """Guards against a bare EOFError / miniz error / OSError for a truncated Lightning checkpoint file."""
    data = saved.read_bytes()
    broken = tmp_path / "broken.ckpt"
    broken.write_bytes({"empty": b"", "half": data[: len(data) // 2], "tail": data[:-10]}[cut])
    with pytest.raises(CheckpointFileError, match=r"broken\.ckpt .*(empty|truncated).* Resume from another"):
        check_checkpoint_file(broken)


def test_flipped_bytes_in_a_checkpoint_file_are_caught(saved, tmp_path):
    """Guards against a checkpoint with 8 flipped bytes resuming silently (its loss went NaN a step later)."""
    data = bytearray(saved.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    flipped = tmp_path / "flipped.ckpt"
    flipped.write_bytes(bytes(data))
    with pytest.raises(CheckpointFileError, match="flipped.ckpt (is corrupted|.*truncated)"):
        check_checkpoint_file(flipped)
    check_checkpoint_file(saved)  # the intact file passes


def test_fp8_train_refuses_a_truncated_checkpoint_with_a_config_error(saved, tmp_path):
    """Guards the CLI route: fp8-train ckpt_path=<truncated file> fails with one message and exit status 2."""
    from fp8_lightning.train import ConfigError, prepare_resume

    broken = tmp_path / "last.ckpt.part"
    broken.write_bytes(saved.read_bytes()[:100])
    plugin = FP8Precision()
    with pytest.raises(ConfigError, match=r"ckpt_path=.*last\.ckpt\.part.*truncated"):
        prepare_resume(str(broken), [plugin])
    assert prepare_resume(str(saved), [plugin]) == str(saved) and plugin.checkpoint_path == str(saved)
    assert os.path.exists(saved)


@pytest.mark.parametrize("damage", ["flipped", "empty", "truncated"])
def test_trainer_fit_refuses_a_damaged_checkpoint_before_loading_it(saved, tmp_path, damage):
    """Guards the plain Trainer route (not fp8-train): Trainer(precision="fp8-hybrid").fit(ckpt_path=...) with 8
    flipped bytes resumed and its second loss was NaN; an empty file gave a bare EOFError."""
    data = bytearray(saved.read_bytes())
    if damage == "flipped":
        middle = len(data) // 2
        data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    broken = tmp_path / f"{damage}.ckpt"
    broken.write_bytes({"flipped": bytes(data), "empty": b"", "truncated": bytes(data[:-10])}[damage])
    with pytest.raises(CheckpointFileError, match=rf"{damage}\.ckpt (is corrupted|is empty|.*is truncated)"):
        _fit(2, ckpt_in=broken)


def test_fabric_load_refuses_a_damaged_checkpoint(tmp_path):
    """Guards the Fabric route: fabric.load of a byte-flipped file names it instead of loading damaged tensors."""
    import pickle

    fabric = L.Fabric(accelerator="cpu", devices=1, precision="fp8-hybrid")
    model = fabric.setup(torch.nn.Sequential(torch.nn.Linear(32, 32)))
    path = tmp_path / "fabric.ckpt"
    fabric.save(path, {"model": model})
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointFileError, match=r"fabric\.ckpt is corrupted"):
        fabric.load(path, {"model": model})
    pickle.loads(pickle.dumps(fabric.strategy))  # ddp_spawn sends the strategy to its processes
