"""``torch.compile`` over a model sharded with FSDP2 whose weights all-gather in FP8: 2 gloo processes, every recipe,
a dense MLP (64 and 128 wide), a hand-written MoE (a linear layer into ``GroupedExperts``) and a random-init
transformers Qwen3-MoE.

Compiled experts whose weights arrived gathered in FP8 failed: the trace saw the gathered weight as the plain tensor
its ``nn.Parameter`` wraps, and took the transpose of its dequantized copy or failed to build guards. A linear
layer told a gathered weight by its methods, which a trace can also miss (a 64-wide MLP compiled in a fresh process
raised "Mixing fake modes"). ``enable_fp8_all_gather`` now marks each module whose weight gathers in FP8 with a plain
attribute, and such a module runs its eager step between graphs. The compiled run must take the gathered FP8
operands as often as the eager run and give its losses and gradients bit for bit (the ``aot_eager`` backend runs the
traced ops as recorded; Qwen3-MoE's gradients within 1e-5, its traced attention and embedding adding in another
order).
"""

import math

import pytest
import torch
import torch.multiprocessing as mp

from fp8_lightning.testing import free_port
from tests.distributed._fsdp_compile_workers import RECIPES, compile_worker

pytestmark = [pytest.mark.timeout(600), pytest.mark.filterwarnings("ignore")]

KINDS = ("narrow_mlp", "mlp", "hand_moe", "qwen3_moe")
# blockwise gathers in FP8 only shards of whole 128 x 128 blocks: not the narrow MLP's 64-wide weights, nor these
# Qwen3-MoE experts (8 of 32 x 64)
SMALL = {("narrow_mlp", "blockwise"), ("qwen3_moe", "blockwise")}


@pytest.fixture(scope="module")
def results() -> dict:
    out = mp.Manager().dict()
    mp.spawn(compile_worker, args=(2, free_port(), out, KINDS), nprocs=2)
    return dict(out)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_compiled_training_equals_eager_with_weights_gathered_in_fp8(results, kind, recipe):
    run = results[kind, recipe]
    assert "error" not in run, run.get("error")
    eager, compiled = run["eager"], run["compiled"]
    if (kind, recipe) not in SMALL:
        assert eager["gathered"], "no weight gathered in FP8: the test would not test the gathered path"
        assert "mlp" in kind or any("experts." in name for name in eager["gathered"]), eager["gathered"]
        assert compiled["uses"] == eager["uses"] > 0  # the compiled steps took the gathered FP8 operands as eager did
    assert compiled["losses"] == eager["losses"] and all(map(math.isfinite, eager["losses"]))
    assert sorted(compiled["grads"]) == sorted(eager["grads"])
    for name, grad in eager["grads"].items():
        if kind == "qwen3_moe":  # the traced graph of the rest of the model adds some gradients in another order
            error = float((compiled["grads"][name] - grad).norm() / grad.norm().clamp_min(1e-30))
            assert error <= 1e-5, (name, error)  # measured at most 4.7e-7
        else:
            assert torch.equal(compiled["grads"][name].view(torch.int32), grad.view(torch.int32)), name


def test_the_mark_comes_and_goes_with_the_fp8_gather():
    import torch.nn as nn

    from fp8_lightning import GroupedExperts, convert_to_fp8
    from fp8_lightning.distributed import enable_fp8_all_gather
    from fp8_lightning.distributed.sharding import disable_fp8_all_gather
    from fp8_lightning.linear import GATHERED_IN_FP8

    model = nn.ModuleDict({"linear": nn.Linear(64, 64), "experts": GroupedExperts(64, 64, 4)})
    convert_to_fp8(model, "tensorwise")
    assert model["linear"]._traceable()
    enable_fp8_all_gather(model, 2)
    assert all(GATHERED_IN_FP8 in module.__dict__ for module in model.values())
    assert not model["linear"]._traceable()
    assert sorted(disable_fp8_all_gather(model)) == ["experts.w1", "experts.w2", "experts.w3", "linear"]
    assert not any(GATHERED_IN_FP8 in module.__dict__ for module in model.values())
    assert model["linear"]._traceable()  # a plain weight again: the traced step serves it
