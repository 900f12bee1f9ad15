"""The layer policy of the precision plugin on a mixture of experts (random-init Qwen3-MoE): linear layers in one
recipe and experts in another train through the Trainer, each experts module's grouped-GEMM counters showing the
recipe it was given; NVFP4's default tail keeps the last block's experts in high precision; a checkpoint of mixed
recipes resumes exactly; the "converted nothing" warning counts experts."""

import lightning as L
import pytest
import torch
import torch.nn as nn

from fp8_lightning import FP8Precision, GroupedExperts, MXFP8BlockScaling, NVFP4BlockScaling, convert_to_fp8
from fp8_lightning.grouped.experts import FP8ExpertsMixin

from .user_model import CausalLM, loader, trainer_kwargs

STEPS = 4
FIRST, LAST = "model.model.layers.0.mlp.experts", "model.model.layers.1.mlp.experts"


def _fit(steps: int = STEPS, epochs: int | None = None, ckpt_path=None, **kwargs):
    pytest.importorskip("transformers", reason="needs transformers (dev extras)")
    from tests.helpers.moe import tiny_moe

    L.seed_everything(0, verbose=False)
    module = CausalLM(lambda: tiny_moe("qwen3_moe"))
    limit = dict(max_epochs=epochs) if epochs else dict(max_steps=steps)
    trainer = L.Trainer(**limit, **trainer_kwargs(**kwargs))
    trainer.fit(module, loader(n=(3 if epochs else steps) * 16, batch_size=16), ckpt_path=ckpt_path)
    return module, trainer


def _gemms(module, recipe) -> dict:
    return dict(module.fp8_scaling(recipe).gemms)


def test_experts_train_under_their_own_recipe_beside_linear_layers_in_another():
    plugin = FP8Precision(recipe="tensorwise", layers={"*experts": "mxfp8", "model.lm_head": None})
    module, _ = _fit(plugins=[plugin])
    report = plugin.conversion_report
    assert sorted(report.experts) == [FIRST, LAST]
    assert report.recipes[FIRST] == "mxfp8 (matches '*experts')"
    every_step = {"fprop": 2 * STEPS, "dgrad": 2 * STEPS, "wgrad": 2 * STEPS}
    for name in (FIRST, LAST):
        experts = module.get_submodule(name)
        assert [r.name for r, _ in experts.fp8_scalings()] == ["mxfp8"]
        assert _gemms(experts, MXFP8BlockScaling()) == every_step
    assert module.model.model.layers[0].self_attn.q_proj.fp8_recipe.name == "tensorwise"
    assert type(module.model.lm_head) is nn.Linear
    assert module.losses[-1] < module.losses[0]


def test_nvfp4_default_tail_keeps_the_last_blocks_experts_in_high_precision():
    module, trainer = _fit(steps=2, precision="fp4-nvfp4")
    report = trainer.precision_plugin.conversion_report
    assert report.experts == [FIRST] and not isinstance(module.get_submodule(LAST), FP8ExpertsMixin)
    assert "in the last 1 of 2 blocks of 'model.model.layers'" in report.experts_skipped[LAST]
    assert _gemms(module.get_submodule(FIRST), NVFP4BlockScaling()) == {"fprop": 4, "dgrad": 4, "wgrad": 4}


def test_mixed_recipes_resume_exactly(tmp_path):
    """Linear layers in MXFP8 (no state between steps), experts in delayed scaling (amax histories): the experts'
    histories travel in the checkpoint, so a run resumed after epoch 1 reproduces the uninterrupted one."""

    def plugin():
        return FP8Precision(recipe="mxfp8", layers={"*experts": "delayed"})

    uninterrupted, _ = _fit(epochs=2, plugins=[plugin()])
    first, trainer = _fit(epochs=1, plugins=[plugin()])
    path = tmp_path / "epoch1.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["FP8Precision"]["modules"][0]
    assert [e["recipe"]["name"] for e in saved[FIRST]["scalings"]] == ["delayed"]
    assert [e["recipe"]["name"] for e in saved["model.model.layers.0.self_attn.q_proj"]["scalings"]] == ["mxfp8"]
    resumed, _ = _fit(epochs=2, ckpt_path=path, plugins=[plugin()])
    assert first.losses + resumed.losses == pytest.approx(uninterrupted.losses, rel=1e-6)


class _Experts(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 64)
        self.experts = GroupedExperts(64, 64, 2)


def test_the_converted_nothing_warning_counts_experts(recwarn):
    with pytest.warns(UserWarning, match="converted no layer of _Experts"):
        FP8Precision(recipe="mxfp8", layers={"*": None}).convert_module(_Experts())
    recwarn.clear()
    plugin = FP8Precision(recipe="mxfp8", layers={"proj": None})  # only the experts convert
    plugin.convert_module(_Experts())
    assert plugin.conversion_report.experts == ["experts"] and plugin.conversion_report.converted == []
    assert not [w for w in recwarn if "converted no layer" in str(w.message)]


def test_experts_the_user_converted_keep_their_recipe_under_the_plugin():
    module = _Experts()
    convert_to_fp8(module, "tensorwise")
    plugin = FP8Precision(recipe="mxfp8")
    plugin.convert_module(module)
    assert module.experts.fp8_recipe.name == "tensorwise" and module.proj.fp8_recipe.name == "tensorwise"
    assert plugin.conversion_report.experts == ["experts"] and plugin.conversion_report.experts_skipped == {}
