"""What an MoE sharded with FSDP2 (``reshard_after_forward=True``) holds between its forward and its backward when its
fused expert weights are all-gathered in FP8: 2 gloo processes, three blocks of experts and a linear layer each.

FSDP2 frees each block's gathered weights after its forward and gathers them again before its backward, so the
autograd graph must hold nothing of them: the grouped GEMM saves the gathered weight (whose buffer FSDP2 frees and
re-fills), not operands made from it. The bytes are counted by walking the graph (every storage a node holds that the
model does not hold anyway, :mod:`tests.distributed._expert_memory_workers`) and checked against formulas:

* the grouped GEMMs' nodes hold what the same model holds in one unsharded process (the activations' FP8 copies;
  there the weights' casts are the modules' cache), plus at most one float32 per expert and weight (NVFP4's global
  scales, the pack's metadata). Without the fix they also held every block's operands made from the gathered
  weights: 6.06 bytes per gathered element under MXFP8, 5.63 under NVFP4 (codes, scales, float32 values);
* the unsharded expert parameters (the graph's leaves) hold nothing: their buffers were freed;
* each rank holds its shard of the experts, ``E / W * N * K * 4`` bytes per weight;
* losses and gradients bit for bit those of the same model with its experts gathered in high precision (tensorwise,
  NVFP4 16x16 tiles: the FP8 gather makes the same operands), and, for every recipe, those of the same FP8 gather
  kept between forward and backward (``reshard_after_forward=False``): rebuilding the operands changes no bit.
"""

import math

import pytest
import torch
import torch.multiprocessing as mp

from fp8_lightning.testing import free_port
from tests.distributed._expert_memory_workers import BLOCKS, DIM, EXPERTS, HIDDEN, RECIPES, STEPS, memory_worker

pytestmark = [pytest.mark.timeout(600), pytest.mark.filterwarnings("ignore")]

WORLD = 2
GROUPED = "FP8GroupedMMFunctionBackward"
EXACT = ("tensorwise", "nvfp4")  # recipes whose FP8 gather makes the high-precision gather's operands


@pytest.fixture(scope="module")
def results():
    out = mp.Manager().dict()
    mp.spawn(memory_worker, args=(WORLD, free_port(), out), nprocs=WORLD)
    return dict(out)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_graph_holds_no_gathered_expert_weight_between_forward_and_backward(results, recipe):
    held, unsharded = results[recipe]["fp8"]["held"], results[recipe]["unsharded"]
    metadata = BLOCKS * 3 * EXPERTS * 4  # at most one float32 per expert and weight
    assert 0 <= held[GROUPED] - unsharded[GROUPED] <= metadata, (held, unsharded)
    assert held.get("AccumulateGrad[FP8GatheredExperts]", 0) <= metadata, held


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_rank_holds_its_shard_of_the_experts(results, recipe):
    shard = BLOCKS * 3 * (EXPERTS // WORLD) * HIDDEN * DIM * 4  # w1, w2, w3: (E / W, H, D) or (E / W, D, H), float32
    assert results[recipe]["fp8"]["shard_bytes"] == shard


@pytest.mark.parametrize("recipe", EXACT)
def test_losses_and_gradients_are_those_of_the_high_precision_gather(results, recipe):
    fp8, hp = results[recipe]["fp8"], results[recipe]["hp"]
    assert fp8["losses"] == hp["losses"] and len(set(fp8["losses"])) == STEPS and all(map(math.isfinite, fp8["losses"]))
    assert sorted(fp8["grads"]) == sorted(hp["grads"])
    assert all(torch.equal(fp8["grads"][n].view(torch.int32), hp["grads"][n].view(torch.int32)) for n in hp["grads"])


@pytest.mark.parametrize("recipe", RECIPES)
def test_resharding_after_forward_changes_no_bit(results, recipe):
    resharded, kept = results[recipe]["fp8"], results[recipe]["kept"]
    assert resharded["losses"] == kept["losses"] and all(map(math.isfinite, kept["losses"]))
    assert sorted(resharded["grads"]) == sorted(kept["grads"])
    for name, grad in kept["grads"].items():
        assert torch.equal(resharded["grads"][name].view(torch.int32), grad.view(torch.int32)), name


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8", "nvfp4", "nvfp4_1x16"])
def test_the_forward_makes_no_stacked_transposed_weight(results, recipe):
    """Backward makes W_e.T's operands from the re-gathered weight: a forward that made them would only drop them."""
    assert results[recipe]["fp8"]["columns_in_forward"] == 0
    assert results[recipe]["fp8"]["columns_in_backward"] > 0  # the counter counts: backward makes them
