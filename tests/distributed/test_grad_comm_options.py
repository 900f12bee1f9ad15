"""The FP8 gradient communication switches that need no process group: Hydra configs, registry, refusals."""

import hydra
import pytest
from lightning.pytorch.strategies import StrategyRegistry
from omegaconf import OmegaConf

from fp8_lightning import FP8DDPStrategy, FP8FSDPStrategy
from fp8_lightning.distributed import FP8CommState, fp8_compress_hook
from fp8_lightning.train import build_strategy
from tests.distributed._workers import REPO_ROOT
from tests.hydra.helpers import compose_config

STRATEGIES = REPO_ROOT / "conf" / "strategy"


def compose(name: str, **overrides):
    config = OmegaConf.merge(OmegaConf.load(STRATEGIES / f"{name}.yaml"), overrides)
    return hydra.utils.instantiate(config)


def test_hydra_ddp_switch():
    plain = compose("ddp")
    assert isinstance(plain, FP8DDPStrategy) and plain.fp8_comm_state is None and plain._ddp_comm_hook is None
    fp8 = compose("ddp", fp8_gradients=True, fp8_format="e5m2", block_size=1024)
    state = fp8.fp8_comm_state
    assert fp8._ddp_comm_hook is fp8_compress_hook and isinstance(state, FP8CommState)
    assert str(state.dtype) == "torch.float8_e5m2" and state.block_size == 1024


def test_hydra_fsdp_switch():
    assert compose("fp8_fsdp").fp8_reduce_scatter is False
    strategy = compose("fp8_fsdp", fp8_reduce_scatter=True)
    assert isinstance(strategy, FP8FSDPStrategy) and strategy.fp8_reduce_scatter is True


def test_the_readme_commands_compose(tmp_path):
    ddp = build_strategy(compose_config(tmp_path, "trainer=ddp", "strategy.fp8_gradients=true"))
    assert isinstance(ddp, FP8DDPStrategy) and ddp._ddp_comm_hook is fp8_compress_hook
    fsdp = build_strategy(compose_config(tmp_path, "strategy=fp8_fsdp", "strategy.fp8_reduce_scatter=true"))
    assert isinstance(fsdp, FP8FSDPStrategy) and fsdp.fp8_reduce_scatter


def test_fp8_ddp_strategy_string():
    entry = StrategyRegistry["fp8_ddp"]
    assert entry["strategy"] is FP8DDPStrategy and entry["init_params"] == {"fp8_gradients": True}


def test_fp8_ddp_refuses_a_second_hook():
    with pytest.raises(ValueError, match="registers its own communication hook"):
        FP8DDPStrategy(fp8_gradients=True, ddp_comm_hook=lambda state, bucket: None)
    with pytest.raises(ValueError, match="'e4m3' or 'e5m2'"):
        FP8DDPStrategy(fp8_gradients=True, fp8_format="hybrid")


def test_reduce_scatter_divides_as_fsdp_asks():
    import torch.distributed as dist

    from fp8_lightning.distributed.reduce_scatter import divisor_of

    assert divisor_of(dist.ReduceOp.AVG, 4) == 4.0 and divisor_of(dist.ReduceOp.SUM, 4) == 1.0
    assert divisor_of(dist.ReduceOp.PREMUL_SUM(0.25), 4) == 4.0
    with pytest.raises(ValueError, match="AVG, SUM and PREMUL_SUM"):
        divisor_of(dist.ReduceOp.MAX, 4)
