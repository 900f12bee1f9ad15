"""The FSDP2 all-gather hooks in one process: shards are cast, "gathered" by concatenating their bytes (what
the all-gather does), and compared with casting the whole weight by the core's reference quantizers."""

import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fp8_lightning import DelayedScaling, MXFP8BlockScaling, TensorwiseScaling, convert_to_fp8, fp8_autocast
from fp8_lightning.distributed import (
    FP8GatheredWeight,
    FP8ShardedWeight,
    enable_fp8_all_gather,
    fp8_all_gather_unsupported_reason,
)
from fp8_lightning.formats import fp8_max
from fp8_lightning.blockwise import WEIGHT_BLOCK, quantize_blockwise
from fp8_lightning.mx import dequantize_mxfp8, quantize_mxfp8
from fp8_lightning.recipes import BlockwiseScaling, RowwiseScaling
from fp8_lightning.rowwise import quantize_rowwise

WORLD = 2
E4M3 = torch.float8_e4m3fn


class _Mesh:
    ndim = 1

    def get_group(self, mesh_dim=None):
        return None


def _layer(recipe, out_features=64, in_features=96):
    layer = nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        layer.weight.mul_(torch.linspace(0.01, 3.0, out_features)[:, None])  # rows of very different magnitude
    model = nn.Sequential(layer)
    convert_to_fp8(model, recipe)
    report = enable_fp8_all_gather(model, WORLD)
    assert report.fp8 == ["0"]
    return model, layer


def _gather(layer):
    """Cast each row shard, concatenate the uint8 inputs per slot (the all-gather), then post-process."""
    shards = layer.weight.chunk(WORLD)
    assert all(isinstance(s, FP8ShardedWeight) for s in shards)
    pre = [s.fsdp_pre_all_gather(_Mesh(), layer.weight.shape, layer.weight.stride(), layer, None) for s in shards]
    inputs = [p[0] for p in pre]
    assert all(t.dtype == torch.uint8 for ts in inputs for t in ts)  # gloo-safe wire format
    gathered_bytes = tuple(torch.cat([ts[i] for ts in inputs]) for i in range(len(inputs[0])))
    weight, inner = shards[0].fsdp_post_all_gather(gathered_bytes, pre[0][1], torch.float32)
    return weight, inner, gathered_bytes, pre[0][1]


def test_sharded_weight_behaves_as_its_tensor():
    hp = torch.randn(8, 4)
    w = FP8ShardedWeight(hp, None)
    for view in (w.detach(), w[2:4], w.view(-1), w.chunk(2)[1]):
        assert isinstance(view, FP8ShardedWeight)
    out = w * 2 + 1
    assert type(out) is torch.Tensor and torch.equal(out, hp * 2 + 1)
    w.copy_(torch.ones(8, 4))
    assert torch.equal(hp, torch.ones(8, 4))
    buffer = io.BytesIO()
    torch.save(w, buffer)  # checkpoints hold the plain tensor
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert type(loaded) is torch.Tensor and torch.equal(loaded, hp)


@pytest.mark.parametrize("recipe", [TensorwiseScaling(), DelayedScaling()], ids=["tensorwise", "delayed"])
def test_per_tensor_gather_equals_casting_the_whole_weight(recipe):
    _, layer = _layer(recipe)
    full = layer.weight._hp.clone()
    weight, inner, wire, (_, (scale, amax)) = _gather(layer)
    # reference in float64: one scale from the whole weight's amax (delayed: its just-in-time first scale)
    ref_amax = full.double().abs().max()
    assert amax.item() == pytest.approx(ref_amax.item(), rel=0)
    assert scale.item() == pytest.approx((fp8_max(torch.float8_e4m3fn) / ref_amax).item(), rel=1e-7)
    ref = (full.double() * scale.double()).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(weight._q.data.view(torch.uint8), ref.view(torch.uint8))
    assert isinstance(weight, FP8GatheredWeight) and weight.shape == full.shape and weight.dtype == torch.float32
    assert weight._q.data.untyped_storage().data_ptr() == wire[0].untyped_storage().data_ptr()  # a view, no copy
    assert sum(t.numel() * t.element_size() for t in wire) == full.numel()  # 1 byte per element


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_mx_gather_equals_casting_the_whole_weight(rounding):
    _, layer = _layer(MXFP8BlockScaling(scale_rounding=rounding))
    full = layer.weight._hp.clone()
    weight, _, wire, _ = _gather(layer)
    ref_data, ref_scale = quantize_mxfp8(full, block_size=32, scale_rounding=rounding)
    assert torch.equal(weight._q.data.view(torch.uint8), ref_data.view(torch.uint8))
    assert torch.equal(weight._q.scale.view(torch.uint8), ref_scale.view(torch.uint8))
    assert sum(t.numel() * t.element_size() for t in wire) == full.numel() * (1 + 1 / 32)


def test_mx_columnwise_copy_comes_from_the_gathered_weight():
    _, layer = _layer(MXFP8BlockScaling())
    weight, *_ = _gather(layer)
    scaling = layer.fp8_scaling()
    row, col = weight.fp8_weight_operands(scaling, record=True)
    assert torch.equal(row.data.view(torch.uint8), weight._q.data.view(torch.uint8))  # no re-quantization
    assert torch.equal(row.scale.view(torch.uint8), weight._q.scale.view(torch.uint8))
    exact = dequantize_mxfp8(row.data, row.scale)  # the gathered value, exactly
    ref_data, ref_scale = quantize_mxfp8(exact.t().contiguous(), block_size=32)
    assert torch.equal(col.data.view(torch.uint8), ref_data.view(torch.uint8))
    assert torch.equal(col.scale.view(torch.uint8), ref_scale.view(torch.uint8))


def test_delayed_records_the_agreed_amax_and_uses_the_delayed_scale_next():
    _, layer = _layer(DelayedScaling(amax_history_len=4, margin=1))
    state = layer.fp8_scaling().operands["weight"]
    weight, _, _, (_, (_, amax)) = _gather(layer)
    weight.fp8_weight_operands(layer.fp8_scaling(), record=True)
    assert state.pending_amax.item() == amax.item() and state.dirty
    state.update()
    expected = fp8_max(torch.float8_e4m3fn) / amax.item() / 2  # margin 1
    assert state.scale.item() == pytest.approx(expected, rel=1e-6)
    with torch.no_grad():
        layer.weight.mul_(10)  # the next gather still uses the delayed scale, not the new amax
    _, _, _, (_, (scale, _)) = _gather(layer)
    assert scale.item() == pytest.approx(expected, rel=1e-6)


def test_gathered_weight_in_an_fp8_linear_and_outside_fp8():
    torch.manual_seed(0)
    model, layer = _layer(TensorwiseScaling())
    x = torch.randn(16, 96)
    with fp8_autocast():
        expected = layer(x)  # the unsharded wrapped weight: the layer casts it itself
    weight, *_ = _gather(layer)
    hp_weight = layer.weight
    layer.weight = nn.Parameter(weight)  # what FSDP2 installs during forward
    with fp8_autocast():
        got = layer(x)
    assert torch.equal(got, expected)  # same bytes, same scale, same GEMM
    ref = x @ weight.dequantize().t()  # outside fp8_autocast: the dequantized (FP8-rounded) weight
    assert torch.allclose(F.linear(x, layer.weight), ref, rtol=1e-6, atol=1e-6)
    assert torch.allclose(layer(x), ref, rtol=1e-6, atol=1e-6)
    layer.weight = hp_weight


def test_later_gathers_refill_the_same_buffer():
    _, layer = _layer(TensorwiseScaling())
    weight, inner, wire, (_, (first_scale, _)) = _gather(layer)
    first_value = weight.dequantize().clone()
    with torch.no_grad():
        layer.weight.mul_(0.5)  # an optimizer-like in-place update: the amax is agreed again
    shards = layer.weight.chunk(WORLD)
    pre = [s.fsdp_pre_all_gather(_Mesh(), None, None, layer, None) for s in shards]
    wire[0].copy_(torch.cat([p[0][0] for p in pre]))  # FSDP2 copies into the existing buffer
    assert shards[0].fsdp_post_all_gather(wire, pre[0][1], torch.float32, out=weight) is None
    assert weight._q.scale.item() == pytest.approx(2 * first_scale.item(), rel=1e-6)
    assert torch.equal(weight.dequantize(), first_value * 0.5)  # same FP8 codes, twice the scale: the refill landed


def test_unsupported_shapes_are_explained():
    assert "not divisible by the shard world size 4" in fp8_all_gather_unsupported_reason((66, 32), 4, TensorwiseScaling())
    assert "MX block size" in fp8_all_gather_unsupported_reason((64, 48), 2, MXFP8BlockScaling())
    assert fp8_all_gather_unsupported_reason((64, 96), 2, TensorwiseScaling()) is None
    model = nn.Sequential(nn.Linear(32, 48, bias=False))
    convert_to_fp8(model, TensorwiseScaling())
    report = enable_fp8_all_gather(model, 5)
    assert report.fp8 == [] and "uneven" in report.high_precision["0"]


@pytest.mark.parametrize("recipe", [DelayedScaling(), TensorwiseScaling()], ids=lambda r: type(r).__name__)
def test_an_evaluation_gather_leaves_the_weight_scaling_state_alone(recipe):
    model, layer = _layer(recipe)
    state = layer.fp8_scaling().operands["weight"]
    before = {name: getattr(state, name).clone() for name in (*state._TENSORS, "flags")}
    layer.eval()
    weight, _, _, _ = _gather(layer)
    with fp8_autocast(), torch.no_grad():
        layer.weight.data = weight  # what FSDP2 hands the layer: the gathered FP8 weight
        layer(torch.randn(4, 96))
    assert all(torch.equal(value, getattr(state, name)) for name, value in before.items())
    assert not state.initialized and state.casts == 0


@pytest.mark.parametrize("recipe", [RowwiseScaling(), BlockwiseScaling(power_of_2_scales=False)], ids=lambda r: r.name)
def test_rowwise_and_blockwise_gather_equal_casting_the_whole_weight(recipe):
    """Row scales (any shard) and 128x128 block scales (shards of whole blocks: 256 rows over 2 ranks) travel in
    the shard's rows; the gathered operand is the whole weight's cast, dgrad's copy is exact for blocks and the
    column cast of the gathered value for rows."""
    _, layer = _layer(recipe, out_features=256, in_features=176)
    full = layer.weight._hp.clone()
    weight, _, wire, _ = _gather(layer)
    if isinstance(recipe, BlockwiseScaling):
        ref_data, ref_scale = quantize_blockwise(full, WEIGHT_BLOCK, E4M3, power_of_2=False)
        assert sum(t.numel() for t in wire) == full.numel() + 256 * -(-2 * 2 * 4 // 128)  # 2x2 blocks per shard
    else:
        ref_data, ref_scale = quantize_rowwise(full, E4M3)
        assert sum(t.numel() for t in wire) == full.numel() + 4 * 256  # 4 scale bytes per row
    assert torch.equal(weight._q.data.view(torch.uint8), ref_data.view(torch.uint8))
    assert torch.equal(weight._q.scale, ref_scale)
    row, col = weight.fp8_weight_operands(layer.fp8_scaling(), record=True)
    assert torch.equal(row.data.view(torch.uint8), ref_data.view(torch.uint8))
    if isinstance(recipe, BlockwiseScaling):
        want_data, want_scale = ref_data.t(), ref_scale.t()
    else:
        exact = row.data.double() / ref_scale.double()  # the gathered value, exactly (power-of-two scales)
        col_data, col_scale = quantize_rowwise(exact.float(), E4M3, dim=0)
        want_data, want_scale = col_data.t(), col_scale.t()
    assert torch.equal(col.data.view(torch.uint8), want_data.view(torch.uint8)) and torch.equal(col.scale, want_scale)


def test_blockwise_shards_must_hold_whole_blocks():
    reason = fp8_all_gather_unsupported_reason((128, 64), 2, BlockwiseScaling())
    assert "64 rows per shard is not a multiple of the 128-row weight block" in reason
    assert fp8_all_gather_unsupported_reason((256, 64), 2, BlockwiseScaling()) is None
    assert fp8_all_gather_unsupported_reason((48, 64), 1, BlockwiseScaling()) is None  # one shard: the whole weight


@pytest.mark.parametrize("recipe", [RowwiseScaling(), MXFP8BlockScaling(), BlockwiseScaling()], ids=lambda r: r.name)
def test_the_forward_makes_no_dgrad_copy_of_a_gathered_weight(recipe):
    """Backward makes W.T's operand from the re-gathered buffer, so the forward's weight operands leave it out; what
    backward makes has the bits of the copy the forward used to make."""
    out_features, in_features = (256, 256) if isinstance(recipe, BlockwiseScaling) else (64, 96)
    _, layer = _layer(recipe, out_features, in_features)
    weight, *_ = _gather(layer)
    scaling = layer.fp8_scaling()
    w, w_col = scaling.weight_operands(weight, record=True)
    assert w_col is None and weight.fp8_regathered_for_backward(scaling)
    row, col = weight.fp8_weight_operands(scaling, record=False)  # the copy, asked for
    dgrad = weight.fp8_dgrad_operand(scaling)
    expected = recipe.transposed(row, col)
    for got, want in ((dgrad.data, expected.data), (dgrad.scale, expected.scale), (w.data, row.data)):
        assert got.shape == want.shape and torch.equal(_bits(got), _bits(want))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.flatten().contiguous().view(torch.uint8)
