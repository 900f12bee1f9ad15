"""Activation checkpointing (``shard_model(activation_checkpointing=True)``) over FSDP2 whose linear and expert
weights all-gather in FP8: 2 gloo processes, every recipe, blocks of a linear layer into ``GroupedExperts``.

The grouped GEMM's backward read its saved tensors twice; under checkpointing each read unpacks them, and the second
raised ``CheckpointError: Unpack is being triggered for a tensor that was already unpacked once`` for every recipe
whose expert weights gather in FP8. The checkpointed steps must give the losses and gradients of the same steps
without checkpointing, bit for bit (the recompute replays the forward's FP8 setting and casts).
"""

import pytest
import torch
import torch.multiprocessing as mp

from fp8_lightning.testing import free_port
from tests.distributed._fsdp_checkpoint_workers import RECIPES, checkpoint_worker

pytestmark = [pytest.mark.timeout(600), pytest.mark.filterwarnings("ignore")]


@pytest.fixture(scope="module")
def results() -> dict:
    out = mp.Manager().dict()
    mp.spawn(checkpoint_worker, args=(2, free_port(), out), nprocs=2)
    return dict(out)


@pytest.mark.parametrize("recipe", RECIPES)
def test_checkpointed_steps_equal_plain_ones_with_experts_gathered_in_fp8(results, recipe):
    run = results[recipe]
    assert "error" not in run, run.get("error")
    plain, checkpointed = run["plain"], run["checkpointed"]
    assert any(".experts." in name for name in plain["gathered"]), plain["gathered"]
    assert checkpointed["losses"] == plain["losses"]
    assert sorted(checkpointed["grads"]) == sorted(plain["grads"])
    for name, grad in plain["grads"].items():
        assert torch.equal(checkpointed["grads"][name].view(torch.int32), grad.view(torch.int32)), name
