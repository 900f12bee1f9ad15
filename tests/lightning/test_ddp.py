"""2-process DDP on CPU (gloo): both ranks end with identical FP8 scales, histories and parameters, and each
history entry is the MAX of the two ranks' local amaxes of that step (one coalesced all-reduce per step)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fp8_lightning.testing import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("route", ["string", "guard"])
def test_two_rank_ddp_agrees_on_scales_and_parameters(tmp_path, route):
    env = dict(os.environ, PYTHONPATH=str(ROOT), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               OMP_NUM_THREADS="1", PL_DISABLE_FORK="1")  # fmt: skip
    env.pop("LOCAL_RANK", None)
    args = [sys.executable, str(ROOT / "tests/lightning/ddp_worker.py"), str(tmp_path)]
    args += ["guard"] if route == "guard" else []
    result = subprocess.run(args,
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert (r0["rank"], r1["rank"]) == (0, 1)
    assert r0["precision"] == r1["precision"] == "fp8-hybrid"
    assert r0["losses"] != r1["losses"]  # the ranks saw different data
    assert r0["local_amax"] != r1["local_amax"]
    for name in r0["params"]:
        assert torch.equal(r0["params"][name], r1["params"][name]), name
    for layer, saved in r0["fp8"].items():
        for s0, s1 in zip(saved["scalings"], r1["fp8"][layer]["scalings"]):
            for role, op in s0["operands"].items():
                assert torch.equal(op["scale"], s1["operands"][role]["scale"]), (layer, role)
                assert torch.equal(op["amax_history"], s1["operands"][role]["amax_history"]), (layer, role)
    history = r0["fp8"]["blocks.0.fc1"]["scalings"][0]["operands"]["input"]["amax_history"]
    steps = len(r0["local_amax"])
    expected = [max(a, b) for a, b in zip(r0["local_amax"], r1["local_amax"])][::-1]  # newest first
    assert history[:steps].tolist() == torch.tensor(expected, dtype=torch.float32).tolist()
    if route == "guard":  # the guard decides on statistics reduced across ranks: identical on both
        assert r0["guard"] == r1["guard"] and r0["guard"]["events"] == []
        assert r0["monitor"] == r1["monitor"] and len(r0["monitor"]) == 27
