"""FSDP2 with FP8 all-gather on 2 gloo processes versus a single-process FP8 run of the same global batch.

One spawn runs every case (process start-up dominates the cost). What each assertion shows:

* FP8 all-gather == high-precision all-gather, to float32 rounding, for tensorwise and delayed scaling: the
  gathered FP8 weight is bit-for-bit what the layer would cast from the whole weight (the agreed amax gives the
  same scale on every rank), so the FP8 wire format changes nothing.
* Versus one process with the whole batch: MXFP8 agrees to 1e-5 (block scales do not depend on the batch split;
  the residual is summation order and dgrad's columnwise copy, which is re-quantized from the gathered FP8 weight).
  Tensorwise/delayed agree to 5e-3 relative: each rank scales its *activations* by its own half batch
  (tensorwise always, delayed at the first, just-in-time step), the same difference plain data parallelism has;
  the measured worst case in this test is 1.4e-3 (MXFP8: 9e-8).
* ``fully_shard`` applied by hand (high-precision gathers) trains exactly like ``shard_model``: the layer re-casts
  the weight FSDP2 refilled in place (same buffer, same version counter) instead of reusing a stale FP8 copy.
* Exactly one coalesced amax all-reduce per optimizer step for per-tensor weights, none for MXFP8 and rowwise.
* Rowwise: each rank scales its own half batch per row (as one process would) and dgrad's column copy is
  re-quantized from the gathered FP8 weight: within 1e-3 of one process.
* NVFP4 (16x16 weight tiles): every rank casts its whole tiles with the global scale of the agreed whole-weight
  amax, so the gathered codes and scales are the unsharded cast's bits and the losses equal the high-precision
  gather's exactly; versus one process within 5e-3 (each rank's activations get their own global scale and their
  stochastic rounding is keyed by the rank; measured worst case 2.0e-3). One amax all-reduce per step.
* Bytes this rank sends through all-gathers for one training step of a bias-free model (weights only):
  FP8 <= 0.52x bf16 and <= 0.26x fp32 (per-tensor: exactly 0.25x fp32; MX: 1 + 1/32 bytes per element; rowwise:
  1 + 4/K); NVFP4 between 0.25x and 0.26x bf16 with 16x16 tiles (half a byte of codes plus a tile scale per 256
  elements), 0.28x with 1x16 blocks (plus a scale byte per 16 elements).
"""

import pytest
import torch.multiprocessing as mp

from tests.distributed._workers import RECIPES, parity_worker
from fp8_lightning.testing import free_port

STEPS = 4
pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")]


@pytest.fixture(scope="module")
def results():
    out = mp.Manager().dict()
    mp.spawn(parity_worker, args=(2, free_port(), STEPS, out), nprocs=2)
    return dict(out)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "nvfp4"])
def test_fp8_all_gather_equals_high_precision_gather(results, recipe):
    assert results[recipe]["fp8"]["losses"] == pytest.approx(results[recipe]["hp"]["losses"], rel=1e-6)


@pytest.mark.parametrize("recipe", RECIPES)
def test_plain_fully_shard_sees_every_steps_weight(results, recipe):
    """FSDP2 refills the gathered weight in place without bumping its version counter: a layer under a hand-made
    ``fully_shard`` must still cast each step's new weight (a stale FP8 weight would change every later loss)."""
    assert results[recipe]["plain_fully_shard"] == pytest.approx(results[recipe]["hp"]["losses"], rel=1e-6)


@pytest.mark.parametrize("recipe,rel", [("tensorwise", 5e-3), ("delayed", 5e-3), ("mxfp8", 1e-5), ("rowwise", 1e-3),
                                        ("nvfp4", 5e-3)])
def test_losses_match_single_process(results, recipe, rel):
    fsdp, single = results[recipe]["fp8"]["losses"], results[recipe]["single"]
    assert len(fsdp) == STEPS
    assert fsdp == pytest.approx(single, rel=rel)


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_weight_gathered_in_fp8(results, recipe):
    assert results[recipe]["fp8"]["fp8_weights"] == 5
    # the same collectives as a high-precision gather (one per FSDP group and pass), fewer bytes
    assert results[recipe]["fp8"]["allgather_calls"] == results[recipe]["hp"]["allgather_calls"]
    assert results[recipe]["fp8"]["allgather_bytes"] < 0.3 * results[recipe]["hp"]["allgather_bytes"]


def test_one_amax_all_reduce_per_step(results):
    assert results["tensorwise"]["fp8"]["amax_reductions"] == STEPS
    assert results["delayed"]["fp8"]["amax_reductions"] == STEPS
    assert results["mxfp8"]["fp8"]["amax_reductions"] == 0
    assert results["rowwise"]["fp8"]["amax_reductions"] == 0
    assert results["nvfp4"]["fp8"]["amax_reductions"] == STEPS  # the global scale needs the whole weight's amax


def test_nvfp4_gather_is_bit_exact(results):
    """The packed codes, E4M3 tile scales and agreed global scale rebuild the unsharded cast bit for bit (both
    GEMM operands of the weight), so every loss equals the high-precision gather's exactly."""
    assert results["nvfp4"]["fp8"]["losses"] == results["nvfp4"]["hp"]["losses"]


def test_nvfp4_all_gather_bytes(results):
    """Half a byte per element of codes, plus one E4M3 byte per 16x16 tile (<= 1/64 byte per element here) or per
    1x16 block (1/16 byte per element); never the 2 bytes of bf16."""
    measured = results["bytes"]
    assert 0.25 * measured["bf16"] < measured["nvfp4"] <= (0.25 + 1 / 128) * measured["bf16"]
    assert measured["nvfp4_1x16"] == pytest.approx((0.5 + 1 / 16) / 2 * measured["bf16"], rel=1e-9)


@pytest.mark.parametrize("recipe", RECIPES)
def test_all_gather_bytes(results, recipe):
    measured = results["bytes"]
    scale_bytes = 4 / 64 if recipe == "rowwise" else 0.0  # a float32 scale per row of K >= 64 codes
    assert measured[recipe] <= (0.52 + scale_bytes / 2) * measured["bf16"]
    assert measured[recipe] <= (0.26 + scale_bytes / 4) * measured["fp32"]
    assert measured["bf16"] == measured["fp32"] // 2  # the baselines themselves are what they claim


def test_composes_with_the_fp8_optimizer(results):
    """FP8Optimizer updates the local shards directly: the weight amaxes must still be agreed again every step."""
    run = results["fp8_optimizer"]
    assert run["fp8"]["amax_reductions"] == STEPS
    assert run["fp8"]["losses"] == pytest.approx(run["hp"]["losses"], rel=1e-6)
    assert run["fp8"]["losses"][-1] < run["fp8"]["losses"][0]


def test_fp8_weights_next_to_bf16_parameters(results):
    """A bf16 MixedPrecisionPolicy: biases and norms gather in bf16, weights in FP8, in the same collective."""
    run = results["bf16_params"]
    assert run["fp8_weights"] == 5 and run["allgather_calls"] == results["tensorwise"]["fp8"]["allgather_calls"]
    assert run["allgather_bytes"] < results["tensorwise"]["fp8"]["allgather_bytes"]  # 2-byte instead of 4-byte biases
    assert run["losses"] == pytest.approx(results["tensorwise"]["fp8"]["losses"], rel=2e-2)
