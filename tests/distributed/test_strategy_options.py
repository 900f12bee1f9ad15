"""FP8FSDPStrategy's choices that need no process group: registration, precision handling, sharding policy, and
the two places it leans on how Lightning's ModelParallelStrategy works inside (checked so a Lightning release that
changes them fails here, loudly, instead of training differently)."""

import ast
import inspect
import textwrap

import hydra
import pytest
import torch
import torch.nn as nn
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy, StrategyRegistry
from omegaconf import OmegaConf

import fp8_lightning
from fp8_lightning import FP8FSDPStrategy, FP8Precision, TensorwiseScaling
from fp8_lightning.distributed import default_shard_targets, shard_model
from fp8_lightning.lightning.fsdp import default_roots, shard_over_every_rank_by_default
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


def called_names(function) -> set[str]:
    """Names of the functions and methods a function's source calls."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    calls = (node.func for node in ast.walk(tree) if isinstance(node, ast.Call))
    return {f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "") for f in calls}


def test_auto_data_parallel_size_takes_every_rank():
    strategy = FP8FSDPStrategy()
    strategy.parallel_devices, strategy.num_nodes = [torch.device("cpu")] * 2, 3
    shard_over_every_rank_by_default(strategy)
    assert strategy._data_parallel_size == 6
    fixed = FP8FSDPStrategy(data_parallel_size=2)
    fixed.parallel_devices, fixed.num_nodes = [torch.device("cpu")] * 2, 3
    shard_over_every_rank_by_default(fixed)
    assert fixed._data_parallel_size == 2
    # Lightning still keeps the size under this name and builds its device mesh from it
    assert ModelParallelStrategy(data_parallel_size=5)._data_parallel_size == 5
    assert "self._data_parallel_size" in inspect.getsource(ModelParallelStrategy.setup_environment)


def test_setup_without_configure_model_takes_every_step_of_lightnings_setup():
    """For a module without configure_model the strategy runs Strategy.setup plus the steps below; a step a Lightning
    release adds to ModelParallelStrategy.setup shows up here (update fsdp.setup_as_strategy, then this list)."""
    taken = {"_materialize_distributed_module", "barrier"}
    checks = {"is_overridden", "TypeError", "any", "isinstance", "modules", "type"}  # configure_model, FSDP1
    extra = called_names(ModelParallelStrategy.setup) - called_names(Strategy.setup)
    assert extra == taken | checks, f"ModelParallelStrategy.setup now also calls {sorted(extra - taken - checks)}"
