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
