"""Activation memory: an FP8Linear saves FP8 copies for backward, about half of what a bf16 layer saves."""

import pytest
import torch
import torch.nn as nn

from fp8_lightning import DelayedScaling, FP8Linear, MXFP8BlockScaling, TensorwiseScaling, fp8_autocast


def _saved_bytes(fn) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


@pytest.mark.parametrize("recipe", [DelayedScaling(), TensorwiseScaling(), MXFP8BlockScaling()], ids=lambda r: r.name)
def test_fp8_linear_saves_at_most_055x_of_bf16(recipe):
    x = torch.randn(256, 512, requires_grad=True)
    bf16 = nn.Linear(512, 512).to(torch.bfloat16)
    bf16_bytes = _saved_bytes(lambda: bf16(x.detach().to(torch.bfloat16).requires_grad_()))
    layer = FP8Linear.from_linear(nn.Linear(512, 512), recipe)

    def fp8_forward():
        with fp8_autocast():
            layer(x)

    fp8_bytes = _saved_bytes(fp8_forward)
    assert bf16_bytes == 2 * (256 * 512 + 512 * 512)  # bf16 saves input and weight
    assert fp8_bytes <= 0.55 * bf16_bytes, (fp8_bytes, bf16_bytes)
