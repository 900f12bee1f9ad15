"""torchao as a second implementation of NVFP4: on the round-to-nearest path (no RHT, no stochastic rounding) our
1x16 codes and E4M3 block scales equal ``torchao.prototype.mx_formats.nvfp4_tensor.nvfp4_quantize`` bit for bit, with
the global scale from its ``per_tensor_amax_to_scale``: normal, ragged-range, zero, NaN, inf, subnormal and bf16
inputs."""

from __future__ import annotations

import warnings

import pytest
import torch

from fp8_lightning import quantize_nvfp4

nvfp4_tensor = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")


def _inputs() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    out = {
        "randn": torch.randn(64, 128),
        "bf16": torch.randn(64, 128).bfloat16(),
        "wide range": torch.randn(33, 48) * torch.logspace(-30, 30, 48),
        "e2m1 grid and ties": torch.linspace(-6, 6, 16 * 97).reshape(1, -1),
        "subnormal tensor": torch.randn(8, 32) * 1e-41,
        "subnormal elements": torch.randn(8, 32) * torch.where(torch.rand(8, 32) < 0.3, 1e-40, 1.0),
        "zeros": torch.zeros(4, 32),
    }
    x = torch.randn(8, 32)
    x[0, :16] = 0
    out["zero block"] = x
    x = torch.randn(8, 32)
    x[1, 5] = float("nan")
    out["nan"] = x
    x = torch.randn(8, 32)
    x[1, 5] = float("inf")
    x[3, 20] = -float("inf")
    out["inf"] = x
    return out


@pytest.mark.parametrize("name", list(_inputs()))
def test_codes_and_block_scales_equal_torchao(name):
    x = _inputs()[name]
    global_scale = nvfp4_tensor.per_tensor_amax_to_scale(x.float().abs().amax())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scales, codes = nvfp4_tensor.nvfp4_quantize(x.contiguous(), 16, global_scale)
    q = quantize_nvfp4(x, global_scale=global_scale)
    assert torch.equal(scales.view(torch.uint8).reshape(q.block_scales.shape), q.block_scales.view(torch.uint8))
    assert torch.equal(codes.view(torch.uint8).reshape(q.codes.shape), q.codes)


def test_the_default_global_scale_is_torchaos_for_finite_nonzero_amaxes():
    x = torch.randn(16, 64)
    want = nvfp4_tensor.per_tensor_amax_to_scale(x.abs().amax())
    assert torch.equal(quantize_nvfp4(x).global_scale, want)
