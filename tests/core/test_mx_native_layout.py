"""The swizzled E8M0 scale layout of the native (sm100+) MX GEMM, against the cuBLAS layout formula."""

import pytest
import torch

from fp8_lightning.gemm import native_mx_gemm_support, swizzle_mx_scales


def _formula_layout(scale_bytes: torch.Tensor) -> torch.Tensor:
    """cuBLAS 1D block-scaling-factor layout, element by element: 128x4 tiles, row-major tile order,
    offset tile * 512 + (r % 32) * 16 + (r // 32) * 4 + c."""
    rows, cols = scale_bytes.shape
    row_tiles, col_tiles = -(-rows // 128), -(-cols // 4)
    out = torch.zeros(row_tiles * col_tiles * 512, dtype=torch.uint8)
    for row in range(rows):
        for col in range(cols):
            tile = (row // 128) * col_tiles + col // 4
            r, c = row % 128, col % 4
            out[tile * 512 + (r % 32) * 16 + (r // 32) * 4 + c] = scale_bytes[row, col]
    return out


@pytest.mark.parametrize("shape", [(128, 4), (256, 8), (130, 5), (7, 3)])
def test_swizzle_matches_the_layout_formula(shape):
    scale_bytes = torch.randint(0, 255, shape, dtype=torch.uint8)
    got = swizzle_mx_scales(scale_bytes.view(torch.float8_e8m0fnu))
    assert got.dtype == torch.float8_e8m0fnu
    assert torch.equal(got.view(torch.uint8), _formula_layout(scale_bytes))


def test_native_mx_gemm_is_reported_unavailable_off_blackwell():
    ok, reason = native_mx_gemm_support("cpu")
    assert not ok and "CUDA" in reason


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_the_weights_scales_are_swizzled_once_per_optimizer_step(micro_batches, monkeypatch):
    """On the native MX GEMM route (stood in for on CPU: the route forced, ``_scaled_mm`` replaced by the float32
    product of the dequantized operands), each micro-batch swizzles the scales of its own four operands (x, x.T,
    grad, grad.T) and the weight's two copies are swizzled once per step: their cast is cached, and so is their
    cuBLAS layout."""
    from fp8_lightning import FP8Linear, MXFP8BlockScaling, fp8_autocast, gemm
    from tests.environment import set_env

    set_env(monkeypatch, FP8_LIGHTNING_GEMM="scaled_mm")
    monkeypatch.setattr(gemm, "native_mx_gemm_support", lambda device: (True, "stood in for"))
    calls = []
    monkeypatch.setattr(gemm, "swizzle_mx_scales", lambda scale: calls.append(scale.shape) or swizzle_mx_scales(scale))
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, **kw: torch.zeros(a.shape[0], b.shape[1], dtype=kw["out_dtype"]))
    layer = FP8Linear.from_linear(torch.nn.Linear(64, 32), MXFP8BlockScaling())
    with torch.no_grad():
        layer.weight.mul_(1.0)  # a new weight version: this step casts the weight once
    for _ in range(micro_batches):
        with fp8_autocast():
            layer(torch.randn(8, 64, requires_grad=True)).sum().backward()
    recast = micro_batches > 1  # a layer's first reuse casts again (no checksum of the weight taken yet)
    assert len(calls) == 2 + 4 * micro_batches + 2 * recast  # without the kept layout: 6 per micro-batch
    assert layer.fp8_weight_casts == 1 + recast
