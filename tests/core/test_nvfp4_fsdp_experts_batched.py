"""NVFP4's FSDP2 expert pack (before the all-gather), unpack (after it) and gathered GEMM operands, each one set of
operations whatever the number of experts, against the per-expert code they replace, kept here as the reference:
each expert packed as one weight (:func:`~fp8_lightning.nvfp4_shards.pack_nvfp4_shard`, its own global scale from its
own agreed amax), unpacked on its own, and its (W_e, W_e.T) operands made as a linear layer's (``fsdp_operands``).

Every byte on the wire, every code, block multiplier and GEMM scale (E4M3 block scales and the global scale cuBLAS
reads) must be bit-identical, at 1, 3 and 8 experts, with 16x16 tiles and 1x16 blocks, for a whole weight and for one
rank's half of it, and the stacked operands' float32 values must be those of the per-expert operands.
"""

from __future__ import annotations

import pytest
import torch

from torch.utils._python_dispatch import TorchDispatchMode

from fp8_lightning.nvfp4 import global_scale_from_amax
from fp8_lightning.nvfp4_shards import pack_nvfp4_shard, unpack_nvfp4_gathered
from fp8_lightning.recipes.nvfp4 import NVFP4BlockScaling, _operand, nvfp4_to_f32
from tests.conftest import requires_cuda_fp8

N, K = 32, 48  # K: three 16-blocks (not a power of two); N: two 16-row tiles
# on CUDA the per-expert reference packs run the Triton NVFP4 cast, the batched pack torch's operations
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda_fp8])]


class _Ops(TorchDispatchMode):
    """Counts the torch operations that are not views."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


def _reference_pack(recipe, shard, first, agreed):
    tile = recipe._weight_tile()
    packed = [pack_nvfp4_shard(w, agreed[first + i], tile)[0] for i, w in enumerate(shard)]
    return torch.cat(packed), global_scale_from_amax(agreed)


def _reference_unpack(recipe, gathered, meta):
    return [_operand(unpack_nvfp4_gathered(part, N, K, scale, recipe._weight_tile()))
            for part, scale in zip(gathered.split(N), meta)]  # fmt: skip


def _same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _same_operand(got, want) -> bool:
    return _same(got.data, want.data) and _same(got.scale, want.scale) and _same(got.cache.native, want.cache.native)


def _weights(experts: int, dtype, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(experts)
    w = torch.randn(experts, N, K, generator=g) * torch.logspace(-3, 2, experts).view(-1, 1, 1)  # each its own scale
    w[0, 3, 5:20] = 0.0  # a zero block
    return w.to(device=device, dtype=dtype)


@pytest.mark.parametrize("experts", [1, 3, 8])
@pytest.mark.parametrize("tiles", [True, False], ids=["16x16", "1x16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_batched_expert_pack_unpack_and_operands_have_the_per_expert_bits(experts, tiles, dtype, device):
    recipe = NVFP4BlockScaling(fp4_2d_weights=tiles)
    weight = _weights(experts, dtype, device)
    agreed = weight.float().abs().amax(dim=(1, 2))
    halves = [(0, experts)] if experts % 2 else [(0, experts // 2), (experts // 2, experts // 2)]  # one rank's shard
    parts = []
    for first, count in halves:
        shard = weight[first : first + count]
        packed, meta = recipe.fsdp_experts_pack(shard, None, first, True, lambda: agreed)
        want_packed, want_meta = _reference_pack(recipe, shard, first, agreed)
        assert _same(packed, want_packed) and _same(meta, want_meta)
        parts.append(packed)
    gathered = torch.cat(parts)  # what the all-gather makes of the ranks' bytes
    unpacked = recipe.fsdp_experts_unpack(gathered, experts, N, K, meta)
    reference = _reference_unpack(recipe, gathered, meta)
    assert len(unpacked) == experts and all(_same_operand(g, w) for g, w in zip(unpacked, reference))
    operands = recipe.fsdp_experts_operands(unpacked, None, meta, False)
    want = [recipe.fsdp_operands(q, None, scale, False) for q, scale in zip(reference, meta)]
    assert len(operands) == experts
    for (row, column), (want_row, want_column) in zip(operands, want):
        assert _same_operand(row, want_row) and _same_operand(column, want_column)
    assert _same(operands.values(), torch.stack([nvfp4_to_f32(r) for r, _ in want]))
    assert _same(operands.transposed_values().contiguous(), torch.stack([nvfp4_to_f32(c).t() for _, c in want]))


@pytest.mark.parametrize("tiles", [True, False], ids=["16x16", "1x16"])
def test_the_pack_unpack_and_operands_count_the_same_operations_at_4_and_16_experts(tiles):
    recipe = NVFP4BlockScaling(fp4_2d_weights=tiles)
    counts = []
    for experts in (4, 16):
        weight = _weights(experts, torch.float32)
        agreed = weight.abs().amax(dim=(1, 2))
        with _Ops() as ops:
            packed, meta = recipe.fsdp_experts_pack(weight, None, 0, True, lambda: agreed)
            recipe.fsdp_experts_operands(recipe.fsdp_experts_unpack(packed, experts, N, K, meta), None, meta, False)
        counts.append(ops.count)
    assert counts[0] == counts[1] > 0
