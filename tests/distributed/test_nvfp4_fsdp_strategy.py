"""NVFP4 under FP8FSDPStrategy on 2 gloo processes, through a real Trainer: mixed recipes in one model
(``FP8Precision(recipe="nvfp4", layers={...})``: one MXFP8 layer, the rest NVFP4), FP8 gradient reduce-scatter, FP8
optimizer states, a sharded checkpoint after epoch 1 and a resumed run.

* every weight gathers in FP8 (NVFP4 as packed codes and block scales), each layer under the recipe the policy gave;
* one amax all-reduce per optimizer step (the NVFP4 weights' global scales);
* the FP8 all-gather trains exactly as the high-precision gather (both NVFP4 and MXFP8 gathers rebuild the operands a
  gathered high-precision weight gives; MXFP8's dgrad copy from the gathered codes is within float32 rounding);
* the resumed run reproduces the uninterrupted one exactly, with AdamW and with FP8 optimizer states (weights,
  each rank's optimizer states, NVFP4 rounding counters and sign vectors travel in the checkpoint);
* transformers' Qwen3-MoE with its expert modules in NVFP4 trains under the strategy (expert weights gathered in FP4,
  each expert's codes and scales under its own global scale) within 1.5% of one process on the same global batches
  (stochastic rounding is keyed by the rank, so the two runs round gradients differently).
"""

import pytest
import torch.multiprocessing as mp

from fp8_lightning.testing import free_port
from tests.distributed._nvfp4_workers import nvfp4_strategy_worker

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore")]
LAYERS = [f"net.blocks.{i}.{n}" for i in (0, 1) for n in ("down", "up")] + ["net.head"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = mp.Manager().dict()
    mp.spawn(nvfp4_strategy_worker, args=(2, free_port(), str(tmp_path_factory.mktemp("nvfp4")), out), nprocs=2)
    return dict(out)


def test_mixed_recipes_all_gather_in_fp8(results):
    assert results["report"] == (sorted(LAYERS), {})
    assert results["recipes"] == {name: "mxfp8" if name == "net.blocks.0.up" else "nvfp4" for name in LAYERS}
    assert results["amax_reductions"] == 4  # 2 epochs x 2 steps


def test_fp8_gather_trains_as_the_high_precision_gather(results):
    assert results["fp8"] == pytest.approx(results["hp_gather"], rel=1e-5)
    assert results["fp8"][-1] < results["fp8"][0]


def test_resume_reproduces_the_uninterrupted_run(results):
    """AdamW: the sharded checkpoint carries the weights, the optimizer and the NVFP4 state (rounding counters, sign
    vectors) of every layer."""
    assert results["resume_adamw"] == pytest.approx(results["adamw"], rel=1e-6)
    assert results["resumed_sr_casts_adamw"] == 4  # the stochastic-rounding counter continued from the checkpoint
    assert results["ckpt_fp8_state"] == sorted(LAYERS)


def test_resume_with_fp8_optimizer_states_reproduces_the_uninterrupted_run(results):
    """The FP8 optimizer states of each rank's shards travel as DTensors, so each rank loads back its own."""
    assert results["resume_fp8_adamw"] == pytest.approx(results["fp8"], rel=1e-6)


def test_nvfp4_experts_train_under_the_strategy(results):
    pytest.importorskip("transformers")
    from tests.distributed._moe_workers import STEPS
    from tests.distributed._nvfp4_workers import moe_run

    single = moe_run(None, strategy="auto", devices=1)
    assert results["moe_experts"] == single["moe_experts"] and len(single["moe_experts"]) == 2
    assert results["moe_gathered_experts"] == sorted(f"{e}.{p}" for e in single["moe_experts"]
                                                     for p in ("down_proj", "gate_up_proj"))  # in FP4
    per_step = {"fprop": 2 * STEPS, "dgrad": 2 * STEPS, "wgrad": 2 * STEPS}  # two projections per expert module
    assert results["moe_gemms"] == [per_step] * 2
    assert results["moe"][-1] < results["moe"][0]
    # each rank rounds its gradients with its own stochastic noise (rank and layer in the key): closeness, not bits
    assert results["moe"] == pytest.approx(single["moe"], rel=3e-2)
