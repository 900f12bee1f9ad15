"""NVFP4 through Lightning: Trainer(precision="fp4-nvfp4") with its default bf16 tail, a layer policy from the
plugin, a checkpoint that carries the RHT signs and the rounding counter and resumes exactly, and loads into a plain
model."""

import torch

from fp8_lightning import FP8Linear, FP8Precision, NVFP4BlockScaling
from fp8_lightning.nvfp4 import rht_signs

from .test_checkpoint import run
from .user_model import TinyTransformerLM


def test_precision_string_keeps_the_last_block_in_high_precision_and_resumes_exactly(tmp_path):
    full, _ = run(2, precision="fp4-nvfp4")
    plugin = full.trainer.precision_plugin
    assert plugin.recipe == NVFP4BlockScaling()
    assert type(full.blocks[1].fc1) is torch.nn.Linear and isinstance(full.blocks[0].fc1, FP8Linear)
    assert "in the last 1 of 2 blocks of 'blocks'" in plugin.conversion_report.skipped["blocks.1.fc1"]
    ckpt = tmp_path / "epoch1.ckpt"
    first, _ = run(1, ckpt_out=ckpt, precision="fp4-nvfp4")
    saved = torch.load(ckpt, weights_only=True)["FP8Precision"]["modules"][0]["blocks.0.fc1"]["scalings"][0]
    grad_state = saved["operands"]["grad_output"]
    assert torch.equal(grad_state["rht_signs"], rht_signs(0))
    assert grad_state["sr_casts"].item() == 4  # one stochastic cast per optimizer step (4 steps per epoch)
    resumed, _ = run(2, ckpt_in=ckpt, seed=123, precision="fp4-nvfp4")
    assert resumed.losses == full.losses[len(first.losses):]
    assert full.losses[-1] < full.losses[0]
    plain = TinyTransformerLM()
    plain.load_state_dict(torch.load(ckpt, weights_only=True)["state_dict"])  # loads into a plain model


def test_plugin_layer_policy_mixes_recipes():
    plugin = FP8Precision(recipe="nvfp4", layers={"last": 0, "head": None, "blocks.0": "mxfp8"})
    model, _ = run(1, plugins=[plugin])
    assert model.blocks[0].fc1.fp8_recipe.name == "mxfp8" and model.blocks[1].fc1.fp8_recipe.name == "nvfp4"
    assert type(model.head) is torch.nn.Linear
    assert plugin.conversion_report.recipes["blocks.1.qkv"] == "nvfp4 (the default recipe)"
    assert model.losses[-1] < model.losses[0]
