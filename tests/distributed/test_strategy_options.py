"""FP8FSDPStrategy's choices that need no process group: registration, precision handling, sharding policy."""

import hydra
import pytest
import torch
import torch.nn as nn
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import StrategyRegistry
from omegaconf import OmegaConf

import fp8_lightning
from fp8_lightning import FP8FSDPStrategy, FP8Precision, TensorwiseScaling
from fp8_lightning.distributed import default_shard_targets, shard_model
from fp8_lightning.lightning.fsdp import default_roots
from tests.distributed._workers import REPO_ROOT, Block, Net


def test_registered_as_fp8_fsdp():
    assert StrategyRegistry["fp8_fsdp"]["strategy"] is FP8FSDPStrategy
    assert fp8_lightning.FP8FSDPStrategy is FP8FSDPStrategy


def test_hydra_config_instantiates_the_strategy():
    strategy = hydra.utils.instantiate(OmegaConf.load(REPO_ROOT / "conf" / "strategy" / "fp8_fsdp.yaml"))
    assert isinstance(strategy, FP8FSDPStrategy) and strategy.fp8_all_gather and strategy.reduce_dtype is None


def test_options_are_parsed():
    strategy = FP8FSDPStrategy(recipe="mxfp8", block_classes="Block", param_dtype="bf16", reduce_dtype="float32")
    assert strategy.block_classes == ["Block"] and strategy.recipe.per_tensor is False
    assert strategy.param_dtype is torch.bfloat16 and strategy.reduce_dtype is torch.float32
    with pytest.raises(ValueError, match="dtype="):
        FP8FSDPStrategy(reduce_dtype="int8")


@pytest.mark.parametrize(
    "plugin,dtype",
    [(Precision(), None), (MixedPrecision("bf16-mixed", "cpu"), torch.bfloat16)],
    ids=["32-true", "bf16-mixed"],
)
def test_installs_fp8_precision_when_there_is_none(plugin, dtype):
    strategy = FP8FSDPStrategy(recipe="tensorwise")
    strategy.precision_plugin = plugin
    strategy._ensure_fp8_precision()
    assert isinstance(strategy.precision_plugin, FP8Precision)
    assert strategy.precision_plugin.recipe == TensorwiseScaling() and strategy.precision_plugin.dtype == dtype


def test_refuses_half_weights_and_conflicting_recipes():
    strategy = FP8FSDPStrategy()
    strategy.precision_plugin = HalfPrecision("bf16-true")
    with pytest.raises(ValueError, match="bf16-true"):
        strategy._ensure_fp8_precision()
    strategy = FP8FSDPStrategy(recipe="tensorwise")
    strategy.precision_plugin = FP8Precision(recipe="mxfp8")
    with pytest.raises(ValueError, match="set the recipe in one place"):
        strategy._ensure_fp8_precision()


def test_default_policy_blocks_and_roots():
    net = Net()
    assert default_shard_targets(net) == list(net.blocks)
    assert default_shard_targets(net, ["Linear"]) == [net.blocks[0].up, net.blocks[0].down, net.blocks[1].up,
                                                      net.blocks[1].down, net.head]

    class Holder(nn.Module):
        def __init__(self, tied: bool):
            super().__init__()
            self.embed = nn.Embedding(32, 64)
            self.trunk = Block()
            self.head = nn.Linear(64, 32, bias=False)
            if tied:
                self.head.weight = self.embed.weight

    untied, tied = Holder(False), Holder(True)
    assert default_roots(untied) == [untied.embed, untied.trunk, untied.head]
    assert default_roots(tied) == [tied]  # one unit holds the shared parameter


def test_unknown_block_class_is_explained():
    with pytest.raises(ValueError, match="matched no module"):
        shard_model(Net(), block_classes=["Missing"])
