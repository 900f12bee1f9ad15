"""Validation never changes FP8 training: the same run gives bit-identical training losses and scaling state
whether or not Lightning's sanity check and validation loops ran in between, on other data, for every FP8
precision string (and with the divergence guard watching, whose statistics must not count evaluation casts)."""

import lightning as L
import pytest
import torch

from fp8_lightning import FP8Precision, fp8_state_dict
from fp8_lightning.lightning.strings import PRECISION_RECIPES

from .user_model import TinyTransformerLM, loader, markov_tokens, trainer_kwargs

STEPS = 6


def _fit(validate: bool, **trainer_overrides) -> tuple[list[float], dict]:
    L.seed_everything(0, verbose=False)
    model = TinyTransformerLM()
    # validation text from another chain, scaled activations differ: a first use there would set other scales
    val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(markov_tokens(64, seed=99)), batch_size=32)
    overrides = dict(num_sanity_val_steps=2, limit_val_batches=2, val_check_interval=2) if validate else {}
    trainer = L.Trainer(max_steps=STEPS, **trainer_kwargs(**overrides, **trainer_overrides))
    trainer.fit(model, loader(), val if validate else None)
    return model.losses, fp8_state_dict(model)


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for layer in a:
        for sa, sb in zip(a[layer]["scalings"], b[layer]["scalings"], strict=True):
            for role in sa["operands"]:
                for key, value in sa["operands"][role].items():
                    other = sb["operands"][role][key]
                    assert (torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other), (
                        layer, role, key)  # fmt: skip


@pytest.mark.parametrize("precision", list(PRECISION_RECIPES))
def test_validation_loops_leave_training_bit_identical(precision):
    plain_losses, plain_state = _fit(False, precision=precision)
    losses, state = _fit(True, precision=precision)
    assert len(plain_losses) == STEPS
    assert losses == plain_losses
    _assert_same_state(plain_state, state)


def test_validation_is_invisible_to_the_divergence_guard():
    plugin = lambda: FP8Precision(recipe="delayed", divergence_guard=True)  # noqa: E731
    plain_losses, plain_state = _fit(False, plugins=[plugin()])
    losses, state = _fit(True, plugins=[plugin()])
    assert losses == plain_losses
    _assert_same_state(plain_state, state)
