"""Hugging Face models this project did not write, from random-init configs (no download), train through
``Trainer(precision=...)`` for every FP8 string: Llama (nn.Linear projections) and GPT-2 (transformers' Conv1D
projections). Every projection runs in FP8, the state_dict keeps its keys and shapes, and the losses follow the
float32 run's."""

import lightning as L
import pytest

from fp8_lightning import FP8Linear
from fp8_lightning.conv1d import FP8Conv1D
from fp8_lightning.lightning.strings import PRECISION_RECIPES
from fp8_lightning.policy import POLICY_SKIP

from .user_model import VOCAB, CausalLM, fit_causal_lm

transformers = pytest.importorskip("transformers", reason="needs transformers (dev extras)")
STEPS = 6
TINY = dict(vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=4)


def llama():
    config = transformers.LlamaConfig(**TINY, hidden_size=64, intermediate_size=128, num_key_value_heads=2,
                                      max_position_embeddings=64)  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def gpt2():
    config = transformers.GPT2Config(**TINY, n_embd=64, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


MODELS = {"llama": (llama, FP8Linear, 2 * 7 + 1), "gpt2": (gpt2, FP8Conv1D, 2 * 4)}  # (factory, class, how many)


def _fit(name: str, precision: str) -> tuple[CausalLM, L.Trainer]:
    return fit_causal_lm(MODELS[name][0], precision, STEPS)


@pytest.fixture(scope="module")
def fp32_losses():
    return {name: _fit(name, "32-true")[0].losses for name in MODELS}


@pytest.mark.parametrize("precision", list(PRECISION_RECIPES))
@pytest.mark.parametrize("name", list(MODELS))
def test_hugging_face_model_trains_in_fp8(name, precision, fp32_losses):
    _, fp8_class, count = MODELS[name]
    reference = CausalLM(MODELS[name][0]).state_dict()
    module, trainer = _fit(name, precision)
    fp8_layers = [n for n, m in module.model.named_modules() if isinstance(m, fp8_class)]
    report = trainer.precision_plugin.conversion_report
    kept = [n for n, why in report.skipped.items() if why.startswith(POLICY_SKIP)]  # NVFP4's bf16 tail
    assert len(fp8_layers) + len(kept) == count, report
    state = module.state_dict()
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in reference.items()}
    assert trainer.precision_plugin.optimizer_steps == STEPS
    want = fp32_losses[name]
    assert module.losses[0] == pytest.approx(want[0], rel=0.01)  # the same model, the same first batch
    assert module.losses[-1] < module.losses[0]  # it learns
    assert module.losses[-1] == pytest.approx(want[-1], rel=0.03)
