"""FP8Optimizer on FSDP2 (``fully_shard``) parameters: states per local shard, same training as unsharded.

Two gloo processes on CPU. Both ranks see the same batch, so the reduce-scattered (averaged) gradient equals the
unsharded gradient and each rank's shard must follow an unsharded FP8Optimizer run on the same data. The shards
are row blocks whose sizes are multiples of the 128-element state blocks, so the quantization blocks line up
with the unsharded ones and the comparison can be tight.
"""

import json
import os

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn as nn

from fp8_lightning.optim import FP8Optimizer
from fp8_lightning.testing import end_worker, free_port, init_gloo

WIDTH, HIDDEN, STEPS = 64, 128, 4


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH))


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    init_gloo(rank, world, port)
    results = {}
    for preset in ("fp32", "default", "max_savings"):
        sharded, reference = make_model(), make_model()
        for layer in (sharded[0], sharded[2]):
            fully_shard(layer)
        fully_shard(sharded)
        options = dict(min_quantize_numel=256)
        opt = FP8Optimizer(torch.optim.AdamW(sharded.parameters(), lr=1e-2, foreach=False), preset, **options)
        ref_opt = FP8Optimizer(torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False), preset,
                               **options)
        gen = torch.Generator().manual_seed(1)
        for _ in range(STEPS):
            x, y = torch.randn(16, WIDTH, generator=gen), torch.randn(16, WIDTH, generator=gen)
            for model, optimizer in ((sharded, opt), (reference, ref_opt)):
                nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
        weight = sharded[0].weight
        assert isinstance(weight, DTensor)
        local = weight.to_local()
        state = opt.state[weight]
        max_diff = max(
            (p.full_tensor() - q).abs().max().item() for p, q in zip(sharded.parameters(), reference.parameters())
        )
        results[preset] = {
            "local_numel": local.numel(),
            "full_numel": weight.numel(),
            "state_shape": state["shape"].tolist(),
            "exp_avg_numel": state["exp_avg"].numel(),
            "exp_avg_dtype": str(state["exp_avg"].dtype),
            "max_param_diff": max_diff,
        }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    end_worker()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp2_sharded_parameters_keep_states_per_local_shard(tmp_path):
    mp.spawn(worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for preset, r in results.items():
            assert r["local_numel"] * 2 == r["full_numel"]
            assert r["state_shape"] == [HIDDEN // 2, WIDTH]  # the state describes the local shard only
            assert r["exp_avg_numel"] == r["local_numel"]  # ... and holds only its elements
            assert r["max_param_diff"] < 1e-6, (preset, r)
        assert results["default"]["exp_avg_dtype"] == "torch.float8_e4m3fn"
        assert results["fp32"]["exp_avg_dtype"] == "torch.float32"
