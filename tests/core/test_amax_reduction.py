"""Cross-rank amax reduction for delayed scaling, for real: 2 processes, gloo, one coalesced all-reduce."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from fp8_lightning import DelayedScaling, convert_to_fp8, fp8_autocast, sync_scales
from fp8_lightning.testing import end_worker


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    torch.manual_seed(0)  # same weights on both ranks
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    convert_to_fp8(model, DelayedScaling(amax_history_len=4))
    torch.manual_seed(100 + rank)  # different data per rank
    for _ in range(2):
        x = torch.randn(8, 32) * (1 + 3 * rank)
        with fp8_autocast():
            model(x).square().mean().backward()
        sync_scales(model)
    layer = model[0].fp8_scaling()
    torch.save(
        {
            "calls": calls,
            "scales": [s.scale for s in layer.operands.values()],
            "histories": [s.amax_history for s in layer.operands.values()],
            "local_input_amax": layer.operands["input"].last_amax,
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    end_worker()


@pytest.mark.timeout(180)
def test_two_ranks_agree_on_scales_with_one_collective_per_step():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, os.path.join(tmp, "init"), tmp), nprocs=2, join=True)
        r0, r1 = (torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2))
    # 2 steps, 2 layers x 3 operands: each step one all-reduce carrying (amax, observed) for all 6 states
    assert r0["calls"] == [12, 12] and r1["calls"] == [12, 12]
    for a, b in zip(r0["scales"] + r0["histories"], r1["scales"] + r1["histories"]):
        assert torch.equal(a, b)
    # the agreed input amax is the larger rank's (rank 1 scales its data up), so it differs from rank 0's own
    input_history = r0["histories"][0]
    assert input_history[0] == r1["local_input_amax"] > r0["local_input_amax"]
    assert r0["scales"][0].item() == pytest.approx(448.0 / input_history.max().item())
