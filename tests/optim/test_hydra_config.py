"""``optimizer=fp8_adamw`` composes with the training config and builds an FP8Optimizer over AdamW."""

from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

from fp8_lightning.optim import PRESETS, FP8Optimizer

CONF = Path(__file__).resolve().parents[2] / "conf"


def test_fp8_adamw_config_builds_the_wrapper(tmp_path):
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
            cfg = compose("train", overrides=[f"paths.output_dir={tmp_path}", "optimizer=fp8_adamw",
                                              "optimizer.preset=max_savings"])
    finally:
        GlobalHydra.instance().clear()
    factory = instantiate(cfg.optimizer)
    model = torch.nn.Linear(128, 64)
    optimizer = factory(params=model.parameters())
    assert isinstance(optimizer, FP8Optimizer) and isinstance(optimizer.optimizer, torch.optim.AdamW)
    assert optimizer.config == PRESETS["max_savings"] and optimizer.config != PRESETS["default"]
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    assert optimizer.param_groups[0]["weight_decay"] == cfg.optimizer.weight_decay
