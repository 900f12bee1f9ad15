"""NVFP4's FSDP2 wire format in one process: shards packed by ``fsdp_pack`` and gathered by concatenation give the
operands of casting the whole weight (16x16 tiles: both copies bit for bit; 1x16 blocks: the fprop copy bit for bit,
dgrad's re-cast within one E2M1 step of the exact weight), with the GEMM scales cuBLAS reads (the whole weight's), the
byte counts the format promises, and the refusals."""

import pytest
import torch

from fp8_lightning import NVFP4BlockScaling, dequantize_nvfp4, quantize_nvfp4
from fp8_lightning.nvfp4_gemm import gemm_scales, split_gemm_scales
from fp8_lightning.ops.dispatch import dequantize_operand


def _gather(recipe, w: torch.Tensor, world: int):
    amax = w.abs().amax()  # the whole weight's amax, as the shard group agrees it
    parts = [recipe.fsdp_pack(shard, None, lambda: amax) for shard in w.chunk(world)]
    gathered = torch.cat([bytes_ for bytes_, _ in parts])
    assert all(torch.equal(meta, parts[0][1]) for _, meta in parts)  # the same global scale on every rank
    q = recipe.fsdp_unpack(gathered, w.shape[0] // world, w.shape[1], parts[0][1])
    return gathered, recipe.fsdp_operands(q, None, parts[0][1], True)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("shape", [(64, 96), (128, 512), (32, 16)])
def test_tiles_gather_to_the_unsharded_cast(world, shape):
    if shape[0] // world % 16:
        pytest.skip("shards would cut a 16-row tile (refused, see below)")
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.logspace(-3, 1, shape[1])  # columns of very different magnitudes
    recipe = NVFP4BlockScaling()
    gathered, (row, column) = _gather(recipe, w, world)
    whole, whole_t = quantize_nvfp4(w, tile_rows=16), quantize_nvfp4(w.t(), tile_rows=16)
    assert torch.equal(row.data, whole.codes) and torch.equal(column.data, whole_t.codes)
    torch.testing.assert_close(dequantize_operand(row, torch.float64), dequantize_nvfp4(whole, torch.float64),
                               rtol=0, atol=0)  # fmt: skip
    torch.testing.assert_close(dequantize_operand(column, torch.float64), dequantize_nvfp4(whole_t, torch.float64),
                               rtol=0, atol=0)  # fmt: skip
    for operand, cast in ((row, whole), (column, whole_t)):  # cuBLAS's scales: those of the whole weight's casts
        assert torch.equal(operand.cache.native, gemm_scales(cast, cast.codes.shape[0]))
    rows, k = shape
    tile_bytes = -(-(rows // world // 16) * (k // 16) // (rows // world))
    assert gathered.dtype == torch.uint8 and gathered.shape == (rows, k // 2 + tile_bytes)


def test_row_blocks_gather_to_the_unsharded_fprop_cast():
    torch.manual_seed(1)
    w = torch.randn(48, 64)
    recipe = NVFP4BlockScaling(fp4_2d_weights=False)
    gathered, (row, column) = _gather(recipe, w, 3)
    assert gathered.shape == (48, 64 // 2 + 64 // 16)  # codes, then one E4M3 scale per 16 elements
    want = dequantize_nvfp4(quantize_nvfp4(w), torch.float64)
    assert torch.equal(dequantize_operand(row, torch.float64), want)
    # dgrad's copy is re-cast along N from the gathered values: within one E2M1 step (its block's scale) of them
    got_t = dequantize_operand(column, torch.float64)
    step = w.abs().amax().double() / 6 * 2  # the largest block multiplier times the top binade's step
    assert (got_t - want.t()).abs().max() <= step
    assert torch.equal(row.cache.native, gemm_scales(quantize_nvfp4(w), 48))
    blocks, global_scale = split_gemm_scales(column.cache.native, column.data.shape[0])  # the multiplier's factors
    assert torch.equal(column.scale, global_scale * blocks.float())


def test_shards_that_cut_a_tile_are_refused_with_the_fix():
    reason = NVFP4BlockScaling().fsdp_unsupported_reason(48, 64, 2)
    assert "24 rows per shard" in reason and "16x16" in reason and "fp4_2d_weights=False" in reason
    assert NVFP4BlockScaling(fp4_2d_weights=False).fsdp_unsupported_reason(48, 64, 2) is None
    assert NVFP4BlockScaling().fsdp_unsupported_reason(64, 64, 2) is None
    assert "in_features=40" in NVFP4BlockScaling().fsdp_unsupported_reason(64, 40, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the NVFP4 wire format on CUDA)")
def test_on_cuda_the_wire_format_has_the_cpu_bits():
    torch.manual_seed(2)
    w = torch.randn(64, 256)
    recipe = NVFP4BlockScaling()
    cpu_bytes, (cpu_row, cpu_column) = _gather(recipe, w, 2)
    cuda_bytes, (row, column) = _gather(recipe, w.cuda(), 2)
    assert torch.equal(cuda_bytes.cpu(), cpu_bytes)
    for got, want in ((row, cpu_row), (column, cpu_column)):
        assert torch.equal(got.data.cpu(), want.data) and torch.equal(got.scale.cpu(), want.scale)
