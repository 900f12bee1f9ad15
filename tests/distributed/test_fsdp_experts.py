"""FSDP2 all-gathers fused expert weights in FP8: 2 gloo processes, every recipe, against the same model with its
expert weights gathered in high precision (each expert then cast to FP8 after the gather, by the same recipe).

One spawn runs every case. The standards are those ``test_fsdp_parity.py`` holds linear layers to:

* tensorwise and delayed: equal to float32 rounding (rel 1e-6). Each expert's scale comes from that expert's
  amax, agreed across the shard group, so the gathered codes are the codes of the cast after a high-precision
  gather. Blockwise: the same (each expert's 128x128 blocks lie inside the rank holding the expert, and W_e.T's
  operand is the gathered blocks transposed, exactly as in one process).
* MXFP8 within 1e-5 and rowwise within 1e-3: dgrad's W_e.T copy (blocks or scales along N) is re-quantized from
  the exactly dequantized gathered weight, a second rounding in dgrad only, as for linear layers.
* NVFP4 stays in high precision, with the reason in the report.
* Exactly one amax all-reduce per optimizer step for per-tensor recipes (the linear layers' and the experts'
  amaxes travel together), none for the others; bytes: per-tensor 1/4 of float32, block recipes 1/4 plus their
  scale bytes.
* gpt-oss experts, stored transposed (E, K, N) with biases: the same equalities under tensorwise and MXFP8.
* Mixed recipes (a layer policy: one block's experts delayed, the other's MXFP8): each gathers in its own recipe's
  wire format, within MXFP8's tolerance of the high-precision gather, with one amax all-reduce per step.

The linear layers gather in high precision in both runs (their FP8 gather is tested in ``test_fsdp_parity.py``),
so the two runs differ only by how the experts gather.
"""

import pytest
import torch.multiprocessing as mp

from fp8_lightning.testing import free_port
from tests.distributed._expert_workers import DIM, EXPERTS, HIDDEN, RECIPES, STEPS, experts_gather_worker

pytestmark = [pytest.mark.timeout(600), pytest.mark.filterwarnings("ignore")]

EXPERT_WEIGHTS = [f"blocks.{b}.{w}" for b in range(2) for w in ("w1", "w2", "w3")]
FP8_RECIPES = [r for r in RECIPES if r != "nvfp4"]
TOLERANCE = {"tensorwise": 1e-6, "delayed": 1e-6, "blockwise": 1e-6, "mxfp8": 1e-5, "rowwise": 1e-3}


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("transformers", reason="needs transformers (dev extras) for the gpt-oss experts")
    out = mp.Manager().dict()
    mp.spawn(experts_gather_worker, args=(2, free_port(), out), nprocs=2)
    return dict(out)


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_fp8_gather_of_experts_matches_high_precision_gather(results, recipe):
    fp8, hp = results[recipe]["fp8"]["losses"], results[recipe]["hp"]["losses"]
    assert len(fp8) == STEPS and fp8[-1] < fp8[0]
    assert fp8 == pytest.approx(hp, rel=TOLERANCE[recipe])


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_the_report_says_the_experts_gathered_in_fp8(results, recipe):
    run = results[recipe]["fp8"]
    assert run["fp8"] == sorted(EXPERT_WEIGHTS) and run["high_precision"] == {}


def test_nvfp4_experts_gather_in_high_precision_with_the_reason(results):
    run = results["nvfp4"]["fp8"]
    assert run["fp8"] == []
    for name in EXPERT_WEIGHTS:
        assert "NVFP4" in run["high_precision"][name] and "high precision" in run["high_precision"][name]
    assert run["losses"] == results["nvfp4"]["hp"]["losses"]
    assert run["allgather_bytes"] == results["nvfp4"]["hp"]["allgather_bytes"]


def test_one_amax_all_reduce_per_step_for_per_tensor_recipes(results):
    for recipe in FP8_RECIPES:
        expected = STEPS if recipe in ("tensorwise", "delayed") else 0
        assert results[recipe]["fp8"]["amax_reductions"] == expected, recipe


# the extra bytes per row of an (N, K) expert weight: none, a float32 per row, K/32 E8M0 scales per row, and the
# expert's 128x128 block scales (float32) spread over its rows, rounded up to whole bytes per row
SCALE_BYTES_PER_ROW = {
    "tensorwise": lambda n, k: 0, "delayed": lambda n, k: 0, "rowwise": lambda n, k: 4, "mxfp8": lambda n, k: k // 32,
    "blockwise": lambda n, k: -(-(-(-n // 128) * -(-k // 128) * 4) // n),
}


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_expert_weights_move_fp8_bytes(results, recipe):
    """Per step and rank: 2 gathers (forward, backward) of this rank's half of each block's 3 expert weights, plus
    what is not an expert weight (the head's float32 weight, the same in both runs)."""
    fp8, hp = results[recipe]["fp8"], results[recipe]["hp"]
    assert fp8["allgather_calls"] == hp["allgather_calls"]
    shapes = [(HIDDEN, DIM), (DIM, HIDDEN), (HIDDEN, DIM)]  # w1, w2, w3 as (N, K)
    per_gather_fp32 = sum(EXPERTS // 2 * n * k * 4 for n, k in shapes) * 2  # two blocks
    per_gather_fp8 = sum(EXPERTS // 2 * n * (k + SCALE_BYTES_PER_ROW[recipe](n, k)) for n, k in shapes) * 2
    rest = hp["allgather_bytes"] - STEPS * 2 * per_gather_fp32
    assert rest > 0
    assert fp8["allgather_bytes"] - rest == STEPS * 2 * per_gather_fp8
    assert per_gather_fp8 <= 0.27 * per_gather_fp32


@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8"])
def test_transposed_transformers_experts_gather_in_fp8(results, recipe):
    run, hp = results[f"gpt_oss/{recipe}"]["fp8"], results[f"gpt_oss/{recipe}"]["hp"]
    experts = [n for n in run["fp8"] if ".mlp.experts." in n]
    assert sorted(experts) == [f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("down_proj", "gate_up_proj")]
    assert run["losses"] == pytest.approx(hp["losses"], rel=TOLERANCE[recipe])
    assert run["allgather_bytes"] < hp["allgather_bytes"]



def test_experts_of_mixed_recipes_each_gather_in_their_own(results):
    fp8, hp = results["mixed"]["fp8"], results["mixed"]["hp"]
    assert fp8["fp8"] == sorted(EXPERT_WEIGHTS) and fp8["high_precision"] == {}
    assert fp8["losses"] == pytest.approx(hp["losses"], rel=TOLERANCE["mxfp8"]) and fp8["losses"][-1] < fp8["losses"][0]
    assert fp8["amax_reductions"] == STEPS  # block 0's delayed experts; block 1's MXFP8 scales need none
    shapes = [(HIDDEN, DIM), (DIM, HIDDEN), (HIDDEN, DIM)]
    per_gather_fp32 = sum(EXPERTS // 2 * n * k * 4 for n, k in shapes) * 2
    per_gather_fp8 = sum(EXPERTS // 2 * n * (2 * k + SCALE_BYTES_PER_ROW["mxfp8"](n, k)) for n, k in shapes)
    rest = hp["allgather_bytes"] - STEPS * 2 * per_gather_fp32
    assert fp8["allgather_bytes"] - rest == STEPS * 2 * per_gather_fp8


def test_the_full_state_dict_holds_the_plain_expert_weights(results):
    assert results["full_state_dict"]
