"""Every option of every config group composes and instantiates on a CPU (or fails fast where it needs a GPU)."""

import importlib.util

import lightning.pytorch as pl
import pytest
import torch
from omegaconf import OmegaConf

from fp8_lightning.lightning.strings import PRECISION_RECIPES
from fp8_lightning.recipes import BlockwiseScaling, RowwiseScaling, recipe_from
from fp8_lightning.train import ConfigError, build, build_precision, check_config
from tests.hydra.helpers import CONF, group_options

GROUPS = ("precision", "model", "data", "optimizer", "scheduler", "strategy", "trainer", "callbacks", "logger",
          "experiment")
CASES = [(group, option) for group in GROUPS for option in group_options(group)]
HAS_TENSORBOARD = any(importlib.util.find_spec(m) for m in ("tensorboard", "tensorboardX"))


def needs_gpu(cfg) -> bool:
    return str(cfg.trainer.accelerator) in ("gpu", "cuda")


def test_every_group_has_options():
    for group in GROUPS:
        assert group_options(group), f"conf/{group}/ has no options"
    assert (CONF / "train.yaml").is_file() and (CONF / "__init__.py").is_file()


@pytest.mark.parametrize(("group", "option"), CASES, ids=[f"{g}={o}" for g, o in CASES])
def test_compose_and_instantiate(compose_train, group, option):
    if group == "logger" and option == "tensorboard" and not HAS_TENSORBOARD:
        pytest.skip("needs tensorboard or tensorboardX (pip install fp8-lightning[tensorboard])")
    cfg = compose_train(f"{group}={option}")
    OmegaConf.resolve(cfg)  # every interpolation resolves
    if needs_gpu(cfg) and not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no usable CUDA GPU"):
            check_config(cfg)
        return
    check_config(cfg)
    parts = build(cfg)
    assert isinstance(parts["trainer"], pl.Trainer)
    assert isinstance(parts["model"], pl.LightningModule)
    assert isinstance(parts["datamodule"], pl.LightningDataModule)
    if parts["model"].optimizer_factory is not None:  # the optimizer partial builds a real optimizer
        parts["model"].trainer = parts["trainer"]
        configured = parts["model"].configure_optimizers()
        optimizer = configured["optimizer"] if isinstance(configured, dict) else configured
        assert isinstance(optimizer, torch.optim.Optimizer)


@pytest.mark.parametrize("option", [o for o in group_options("precision") if o.startswith(("fp8_", "fp4_"))])
def test_fp8_precision_configs_match_the_precision_strings(compose_train, option):
    """precision=fp8_x with default fields is the same recipe as Trainer(precision="fp8-x")."""
    cfg = compose_train(f"precision={option}")
    flag, plugins = build_precision(cfg)
    assert flag is None and len(plugins) == 1
    assert plugins[0].recipe == PRECISION_RECIPES[option.replace("_", "-")]


@pytest.mark.parametrize(("option", "flag"), [("fp32", "32-true"), ("bf16_mixed", "bf16-mixed")])
def test_lightning_precisions_pass_the_flag(compose_train, option, flag):
    assert build_precision(compose_train(f"precision={option}")) == (flag, [])


def test_recipe_field_overrides_reach_the_plugin(compose_train):
    cfg = compose_train("precision=fp8_hybrid", "precision.recipe.amax_history_len=32", "precision.recipe.margin=1",
                        "precision.recipe.amax_compute_algo=most_recent")
    _, (plugin,) = build_precision(cfg)
    expected = recipe_from({"name": "delayed", "fp8_format": "HYBRID", "amax_history_len": 32, "margin": 1,
                            "amax_compute_algo": "most_recent"})
    assert plugin.recipe == expected


def test_mxfp8_fields_override(compose_train):
    cfg = compose_train("precision=fp8_mxfp8", "precision.recipe.scale_rounding=floor",
                        "precision.recipe.fp8_format=HYBRID")
    _, (plugin,) = build_precision(cfg)
    assert (plugin.recipe.scale_rounding, plugin.recipe.fp8_format.value) == ("floor", "HYBRID")


def test_rowwise_and_blockwise_fields_override(compose_train):
    cfg = compose_train("precision=fp8_rowwise", "precision.recipe.high_precision_wgrad=true",
                        "precision.recipe.power_of_2_scales=false", "precision.recipe.fp8_format=HYBRID")
    _, (plugin,) = build_precision(cfg)
    assert plugin.recipe == RowwiseScaling(fp8_format="HYBRID", power_of_2_scales=False, high_precision_wgrad=True)
    cfg = compose_train("precision=fp8_blockwise", "precision.recipe.power_of_2_scales=false")
    _, (plugin,) = build_precision(cfg)
    assert plugin.recipe == BlockwiseScaling(power_of_2_scales=False)


def test_model_overrides_and_data_block_size_follow(compose_train):
    cfg = compose_train("model.n_layer=3", "data.block_size=96", "data=synthetic")
    parts = build(cfg)
    assert len(parts["model"].blocks) == 3
    assert parts["model"].hparams.block_size == 96 == parts["datamodule"].hparams.block_size


def test_trainer_ddp_selects_ddp_strategy(compose_train):
    trainer = build(compose_train("trainer=ddp"))["trainer"]
    from lightning.pytorch.strategies import DDPStrategy

    assert isinstance(trainer.strategy, DDPStrategy) and trainer.num_devices == 2
    assert trainer.strategy.fp8_comm_state is None  # FP8 gradients are off unless strategy.fp8_gradients=true


def test_scheduler_total_steps_follows_max_steps(compose_train):
    cfg = compose_train("trainer.max_steps=77")
    assert cfg.scheduler.total_steps == 77


def test_nvfp4_layer_policy_reaches_the_plugin(compose_train):
    _, (plugin,) = build_precision(compose_train("precision=fp4_nvfp4"))
    assert plugin.recipe.name == "nvfp4" and plugin.layers is None  # the recipe's default: bf16 tail
    cfg = compose_train("precision=fp4_nvfp4", "precision.layers={last: 0.25, lm_head: null, blocks.0: mxfp8}")
    _, (plugin,) = build_precision(cfg)
    assert plugin.layers == {"last": 0.25, "lm_head": None, "blocks.0": "mxfp8"}


def test_run_summary_lists_the_fused_experts_modules():
    """A mixture of experts' run summary names its expert modules beside its linear layers."""
    from types import SimpleNamespace

    from fp8_lightning.convert import ConversionReport
    from fp8_lightning.train import conversion_summary, format_summary

    report = ConversionReport(converted=["attn.q"], experts=["layers.0.mlp.experts"],
                              experts_skipped={"layers.1.mlp.experts": "kept by the layer policy"})
    layers = conversion_summary(None, [SimpleNamespace(conversion_report=report)])
    assert layers["experts"] == ["layers.0.mlp.experts"]
    summary = dict(precision="fp4-nvfp4", steps=1, val_loss=None, val_ppl=None, tokens_per_s=None,
                   peak_memory_mib=None, peak_memory_kind="cpu", layers=layers, checkpoint=None, output_dir="out")
    text = format_summary(summary)
    assert "  experts converted: layers.0.mlp.experts" in text
    assert "  experts skipped layers.1.mlp.experts: kept by the layer policy" in text
