"""Mixture-of-experts models from transformers (random-init Qwen3-MoE and Mixtral) train through
``Trainer(precision=...)`` for every FP8 string with their fused experts in FP8 (the conversion report and the
experts' grouped-GEMM counters show it), follow the float32 run's losses, and checkpoint into the plain model."""

import lightning as L
import pytest
import torch

from fp8_lightning.lightning.strings import PRECISION_RECIPES
from fp8_lightning.policy import POLICY_SKIP

from .user_model import CausalLM, fit_causal_lm, loader, trainer_kwargs

pytest.importorskip("transformers", reason="needs transformers (dev extras)")
from tests.helpers.moe import tiny_moe  # noqa: E402

STEPS = 6
FAMILIES = ["qwen3_moe", "mixtral"]


def moe_lm(family: str) -> CausalLM:
    return CausalLM(lambda: tiny_moe(family))


def _fit(family: str, precision: str, **kwargs) -> tuple[CausalLM, L.Trainer]:
    return fit_causal_lm(lambda: tiny_moe(family), precision, STEPS, **kwargs)


@pytest.fixture(scope="module")
def fp32_losses():
    return {family: _fit(family, "32-true")[0].losses for family in FAMILIES}


@pytest.mark.parametrize("precision", list(PRECISION_RECIPES))
@pytest.mark.parametrize("family", FAMILIES)
def test_moe_model_trains_with_experts_in_fp8(family, precision, fp32_losses, tmp_path):
    module, trainer = _fit(family, precision)
    report = trainer.precision_plugin.conversion_report
    experts = {name: m for name, m in module.named_modules() if name.endswith("mlp.experts")}
    kept = [name for name, why in report.experts_skipped.items() if why.startswith(POLICY_SKIP)]  # NVFP4's tail
    assert sorted(report.experts + kept) == sorted(experts) and len(report.experts) >= 1, report
    for name in report.experts:  # two projections, three FP8 grouped GEMMs each, every step
        assert experts[name].fp8_gemm_counts == {"fprop": 2 * STEPS, "dgrad": 2 * STEPS, "wgrad": 2 * STEPS}
    want = fp32_losses[family]
    assert module.losses[0] == pytest.approx(want[0], rel=0.01)
    assert module.losses[-1] < module.losses[0]
    assert module.losses[-1] == pytest.approx(want[-1], rel=0.03)

    path = tmp_path / "moe.ckpt"
    trainer.save_checkpoint(path)
    weights = torch.load(path, weights_only=False)["state_dict"]
    plain = tiny_moe(family, seed=1)
    plain.load_state_dict({k.removeprefix("model."): v for k, v in weights.items()}, strict=True)
    for name, p in plain.named_parameters():
        assert torch.equal(p, module.model.get_parameter(name)), name


def _fit_epochs(epochs: int, ckpt_path=None) -> tuple[CausalLM, L.Trainer]:
    L.seed_everything(0, verbose=False)
    module = moe_lm("qwen3_moe")
    trainer = L.Trainer(max_epochs=epochs, precision="fp8-hybrid", **trainer_kwargs())
    trainer.fit(module, loader(n=3 * 16, batch_size=16), ckpt_path=ckpt_path)
    return module, trainer


def test_resume_restores_the_experts_scaling_state(tmp_path):
    """Delayed scaling: the experts' amax histories travel in the checkpoint, so a run resumed after epoch 1
    reproduces the uninterrupted run's losses."""
    uninterrupted, _ = _fit_epochs(2)
    first, trainer = _fit_epochs(1)
    path = tmp_path / "epoch1.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["FP8Precision"]["modules"][0]
    assert sum(name.endswith("mlp.experts") for name in saved) == 2
    resumed, _ = _fit_epochs(2, ckpt_path=path)
    assert first.losses + resumed.losses == pytest.approx(uninterrupted.losses, rel=1e-6)


def test_divergence_guard_moves_an_expert_module_back_and_names_the_expert():
    from fp8_lightning import DivergenceGuard, FP8Precision

    L.seed_everything(0, verbose=False)
    module = moe_lm("qwen3_moe")
    experts = module.model.model.layers[0].mlp.experts
    with torch.no_grad():  # expert 3: one large value, the rest far below the FP8 range its scale leaves them
        experts.down_proj[3].fill_(1e-9)
        experts.down_proj[3, 0, 0] = 1.0
    guard = DivergenceGuard(underflow_threshold=0.3, patience=1)
    trainer = L.Trainer(max_steps=3, plugins=[FP8Precision(recipe="tensorwise", divergence_guard=guard)],
                        **trainer_kwargs())  # fmt: skip
    trainer.fit(module, loader(n=3 * 16, batch_size=16))
    events = trainer.precision_plugin.guard_state.events
    assert [(e.step, e.layer, e.role, e.kind) for e in events] == [
        (0, "model.model.layers.0.mlp.experts", "down_proj.weight[3]", "underflow")]
    assert "down_proj.weight[3] underflow" in experts.fp8_disabled_reason
    assert experts.fp8_gemm_counts["fprop"] == 2  # FP8 in the first step only, then high precision
    assert all(torch.isfinite(torch.tensor(module.losses)))
