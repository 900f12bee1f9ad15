"""FP8Optimizer state through torch.distributed.checkpoint's optimizer state dicts, which key the state by parameter
name and drop the wrapper's own entry: the FP8 codes and their scales come back exactly, not re-quantized as if
they were a plain optimizer's float state."""

import copy

import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from fp8_lightning.optim import fp8_adamw


def test_named_state_dict_round_trip_restores_the_fp8_states_exactly():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = fp8_adamw(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, 64)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    saved = copy.deepcopy(get_optimizer_state_dict(model, opt))
    assert "0.weight" in saved["state"] and "fp8_optimizer" not in saved  # keyed by name, the entry dropped
    other = copy.deepcopy(model)
    restored = fp8_adamw(other.parameters(), lr=1e-2)
    set_optimizer_state_dict(other, restored, saved)
    for p, q in zip(model.parameters(), other.parameters()):
        want, got = opt.state[p], restored.state[q]
        assert sorted(want) == sorted(got)
        for key in want:
            assert torch.equal(want[key].view(torch.uint8) if want[key].dtype.itemsize == 1 else want[key],
                               got[key].view(torch.uint8) if got[key].dtype.itemsize == 1 else got[key]), key
    batch = torch.randn(4, 64)
    for m, o in ((model, opt), (other, restored)):  # the next step is the same step
        m(batch).square().sum().backward()
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), other.parameters()))
