"""A checkpoint recompute of FP8 experts counts no GEMM, also when torch stops the recompute early.

Non-reentrant checkpointing stops a recompute as soon as it has rebuilt the last saved tensor it needs
(``set_checkpoint_early_stop``, on by default), which can be inside the last projection's forward: the count must
not depend on where the recompute stopped. Reference: the counts of the same step without checkpointing.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as checkpoint

from fp8_lightning import GroupedExperts, convert_to_fp8, fp8_autocast


def _fprop_counts(ckpt: bool, early_stop: bool) -> dict[str, int]:
    torch.manual_seed(0)
    x = torch.randn(20, 64, requires_grad=True)
    offs = torch.tensor([5, 5, 12, 20], dtype=torch.int32)
    experts = GroupedExperts(64, 32, 4)
    convert_to_fp8(experts, "tensorwise")
    with checkpoint.set_checkpoint_early_stop(early_stop), fp8_autocast():
        y = checkpoint.checkpoint(experts, x, offs, use_reentrant=False) if ckpt else experts(x, offs)
    y.square().sum().backward()
    return {name: part.gemms["fprop"] for name, part in experts.fp8_scaling().parts.items()}


@pytest.mark.parametrize("early_stop", [True, False])
def test_a_recompute_counts_no_fprop(early_stop):
    reference = _fprop_counts(ckpt=False, early_stop=early_stop)
    assert reference == {"w1": 1, "w3": 1, "w2": 1}
    assert _fprop_counts(ckpt=True, early_stop=early_stop) == reference
