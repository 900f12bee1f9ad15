"""The FSDP2 all-gather hooks of fused expert weights in one process: each shard of whole experts is cast, the
shards' bytes are concatenated (what the all-gather does) and post-processed, and each expert's gathered operand is
compared with casting that expert on its own by the core's reference quantizers (float64 for per-tensor scales)."""

import pytest
import torch
import torch.nn as nn

from fp8_lightning import convert_to_fp8, fp8_autocast, recipe_from
from fp8_lightning.blockwise import WEIGHT_BLOCK, dequantize_blockwise, quantize_blockwise
from fp8_lightning.distributed import disable_fp8_all_gather, enable_fp8_all_gather
from fp8_lightning.distributed.expert_weight import FP8GatheredExperts, FP8ShardedExperts
from fp8_lightning.distributed.sharding import AMAX_SYNC_ATTR
from fp8_lightning.grouped.experts import GroupedExperts
from fp8_lightning.mx import dequantize_mxfp8, quantize_mxfp8
from fp8_lightning.ops.dispatch import dequantize_operand
from fp8_lightning.rowwise import dequantize_rowwise, quantize_rowwise

WORLD, EXPERTS, DIM, HIDDEN = 2, 4, 96, 64
E4M3 = torch.float8_e4m3fn


class _Mesh:
    ndim = 1

    def __init__(self, rank: int):
        self.rank = rank

    def get_group(self, mesh_dim=None):
        return None

    def get_local_rank(self, mesh_dim=None):
        return self.rank


def _experts(recipe: str, experts: int = EXPERTS):
    torch.manual_seed(0)
    model = nn.Sequential(GroupedExperts(DIM, HIDDEN, experts))
    with torch.no_grad():  # experts (and rows) of very different magnitudes
        for w in (model[0].w1, model[0].w2, model[0].w3):
            w.mul_(torch.logspace(-2, 1, experts)[:, None, None] * torch.linspace(0.1, 2, w.shape[1])[None, :, None])
    convert_to_fp8(model, recipe_from(recipe))
    return model, model[0]


def _gather(model, experts, name: str):
    """Cast each rank's experts, concatenate the uint8 inputs (the all-gather), then post-process."""
    weight = getattr(experts, name)
    full = weight._hp.detach().clone()
    sync = getattr(model, AMAX_SYNC_ATTR)
    sync.global_amax = lambda module, group, param: full.double().abs().amax(dim=(1, 2)).float()  # agreed amaxes
    shards = weight.chunk(WORLD)
    assert all(isinstance(s, FP8ShardedExperts) and s._projection == name for s in shards)
    pre = [s.fsdp_pre_all_gather(_Mesh(r), weight.shape, weight.stride(), experts, None) for r, s in enumerate(shards)]
    assert all(p[0][0].dtype == torch.uint8 for p in pre)
    wire = torch.cat([p[0][0] for p in pre])
    gathered, inner = shards[0].fsdp_post_all_gather((wire,), pre[0][1], torch.float32)
    return gathered, full, wire


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_per_tensor_experts_each_get_their_own_scale(recipe):
    model, experts = _experts(recipe)
    enable_fp8_all_gather(model, WORLD)
    gathered, full, wire = _gather(model, experts, "w1")
    assert isinstance(gathered, FP8GatheredExperts) and gathered.shape == full.shape
    assert wire.numel() == full.numel()  # 1 byte per element: the scales stay on every rank
    for e, q in enumerate(gathered._q):
        amax = full[e].double().abs().max()
        scale = 448.0 / amax
        assert q.scale.item() == pytest.approx(scale.item(), rel=1e-7)
        codes = (full[e].double() * q.scale.double()).clamp(-448, 448).to(E4M3)
        assert torch.equal(q.data.view(torch.uint8), codes.view(torch.uint8))
    states = experts.fp8_scaling().parts["w1"].expert_states
    assert [s.scale.item() for s in states] == [q.scale.item() for q in gathered._q]  # every expert's state moved


def test_rowwise_blockwise_and_mx_experts_are_cast_expert_by_expert():
    for recipe, reference in [
        ("rowwise", lambda w: dequantize_rowwise(*quantize_rowwise(w, E4M3, -1, 1e-12, True))),
        ("blockwise", lambda w: dequantize_blockwise(*quantize_blockwise(w, WEIGHT_BLOCK, E4M3, True))),
        ("mxfp8", lambda w: dequantize_mxfp8(*quantize_mxfp8(w, block_size=32, scale_rounding="rceil"))),
    ]:
        model, experts = _experts(recipe)
        enable_fp8_all_gather(model, WORLD)
        gathered, full, _ = _gather(model, experts, "w2")
        values = gathered.dequantize()
        for e in range(EXPERTS):
            assert torch.equal(values[e], reference(full[e]).float()), (recipe, e)


def test_the_gathered_experts_follow_the_forward_transposes():
    model, experts = _experts("tensorwise")
    enable_fp8_all_gather(model, WORLD)
    gathered, full, _ = _gather(model, experts, "w1")
    flipped = gathered.transpose(-2, -1)
    assert isinstance(flipped, FP8GatheredExperts) and flipped.shape == (EXPERTS, DIM, HIDDEN)
    assert torch.equal(flipped.transpose(1, 2).dequantize(), gathered.dequantize())
    assert torch.equal(flipped.dequantize(), gathered.dequantize().transpose(1, 2))
    plain = gathered * 1.0  # any other op sees the dequantized value
    assert type(plain) is torch.Tensor and torch.equal(plain, gathered.dequantize())
    with pytest.raises(RuntimeError, match="takes the \\(E, N, K\\) view"):
        flipped.fp8_expert_operands(experts.fp8_scaling().parts["w1"], True)


def test_the_experts_forward_uses_the_gathered_casts():
    """The same bytes and scales as the experts' own casts of the whole weight: the same output."""
    model, experts = _experts("tensorwise")
    x, offs = torch.randn(24, DIM), torch.tensor([3, 3, 10, 24], dtype=torch.int32)
    with fp8_autocast():
        expected = experts(x, offs)
    enable_fp8_all_gather(model, WORLD)
    gathered = {name: _gather(model, experts, name)[0] for name in ("w1", "w2", "w3")}
    for name, weight in gathered.items():
        setattr(experts, name, nn.Parameter(weight))  # what FSDP2 installs during forward
    with fp8_autocast():
        got = experts(x, offs)
    assert torch.equal(got, expected)


def test_another_recipe_casts_the_gathered_value_afresh():
    """Under ``fp8_autocast(recipe=...)`` with another recipe the experts cast the gathered (FP8-rounded) weights
    with that recipe, as they would cast those values held in high precision."""
    from fp8_lightning import MXFP8BlockScaling

    model, experts = _experts("tensorwise")
    x, offs = torch.randn(24, DIM), torch.tensor([3, 3, 10, 24], dtype=torch.int32)
    enable_fp8_all_gather(model, WORLD)
    gathered = {name: _gather(model, experts, name)[0] for name in ("w1", "w2", "w3")}
    for name, weight in gathered.items():
        setattr(experts, name, nn.Parameter(weight))
    with fp8_autocast(recipe=MXFP8BlockScaling()):
        got = experts(x, offs)
    for name, weight in gathered.items():
        setattr(experts, name, nn.Parameter(weight.dequantize()))  # the same values, in high precision
    with fp8_autocast(recipe=MXFP8BlockScaling()):
        expected = experts(x, offs)
    assert torch.equal(got, expected)


def test_uneven_experts_stay_in_high_precision_with_the_reason():
    model, _ = _experts("mxfp8", experts=3)
    report = enable_fp8_all_gather(model, WORLD)
    assert report.fp8 == []
    for name in ("0.w1", "0.w2", "0.w3"):
        assert "num_experts=3 is not divisible by the shard world size 2" in report.high_precision[name]


def test_enable_is_idempotent_and_disable_restores_plain_parameters():
    model, experts = _experts("rowwise")
    assert enable_fp8_all_gather(model, WORLD).fp8 == ["0.w1", "0.w3", "0.w2"]
    assert enable_fp8_all_gather(model, WORLD).fp8 == ["0.w1", "0.w3", "0.w2"]
    assert isinstance(experts.w1, nn.Parameter) and isinstance(experts.w1.data, FP8ShardedExperts)
    assert sorted(disable_fp8_all_gather(model)) == ["0.w1", "0.w2", "0.w3"]
    assert all(type(getattr(experts, n).data) is torch.Tensor for n in ("w1", "w2", "w3"))


def test_experts_of_one_model_gather_under_the_recipe_the_layer_policy_gave_each():
    """Two experts modules of one model, given tensorwise and MXFP8 by the layer policy: each gathers in its own
    recipe's wire format (per-tensor: one byte per element, the scales stay on every rank; MXFP8: the E8M0 scale bytes
    travel too), and each expert's gathered operand equals its recipe's reference cast of that expert."""
    torch.manual_seed(0)
    model = nn.Sequential(GroupedExperts(DIM, HIDDEN, EXPERTS), GroupedExperts(DIM, HIDDEN, EXPERTS))
    with torch.no_grad():
        for w in (p for p in model.parameters()):
            w.mul_(torch.logspace(-2, 1, EXPERTS)[:, None, None] * torch.linspace(0.1, 2, w.shape[1])[None, :, None])
    report = convert_to_fp8(model, "tensorwise", layers={"1": "mxfp8"})
    assert report.recipes == {"0": "tensorwise (the default recipe)", "1": "mxfp8 (matches '1')"}
    assert enable_fp8_all_gather(model, WORLD).fp8 == ["0.w1", "0.w3", "0.w2", "1.w1", "1.w3", "1.w2"]
    per_tensor, full, wire = _gather(model, model[0], "w2")
    assert wire.numel() == full.numel() and per_tensor._recipe == recipe_from("tensorwise")
    for e, q in enumerate(per_tensor._q):
        scale = 448.0 / full[e].double().abs().max()
        codes = (full[e].double() * scale).clamp(-448, 448).to(E4M3)
        assert torch.equal(q.data.view(torch.uint8), codes.view(torch.uint8))
    mx, full, wire = _gather(model, model[1], "w2")
    assert wire.numel() == full.numel() + full.numel() // 32 and mx._recipe == recipe_from("mxfp8")
    values = mx.dequantize()
    for e in range(EXPERTS):
        reference = dequantize_mxfp8(*quantize_mxfp8(full[e], block_size=32, scale_rounding="rceil"))
        assert torch.equal(values[e], reference.float()), e
@pytest.mark.parametrize("tiles", [True, False])
def test_nvfp4_experts_travel_as_codes_and_block_scales_of_each_expert(tiles):
    """Each expert's gathered fprop copy has the bits of casting that expert whole (its own global scale from its own
    amax); dgrad's copy of W_e.T: 16x16 tiles transposed, the bits of casting W_e.T; 1x16 blocks re-cast along N from
    the gathered values, within one E2M1 step of them. The wire holds K/2 code bytes per row plus the scales."""
    from fp8_lightning import dequantize_nvfp4, quantize_nvfp4

    model, experts = _experts({"name": "nvfp4", "fp4_2d_weights": tiles})
    assert enable_fp8_all_gather(model, WORLD).fp8 == ["0.w1", "0.w3", "0.w2"]
    tile = 16 if tiles else 1
    for name in ("w1", "w2"):
        gathered, full, wire = _gather(model, experts, name)
        n, k = full.shape[1:]
        scale_bytes = -(-(n // 16) * (k // 16) // n) if tiles else k // 16
        assert wire.shape == (EXPERTS * n, k // 2 + scale_bytes)
        pairs = gathered.fp8_expert_operands(experts.fp8_scaling().parts[name], True)
        for e, (row, column) in enumerate(pairs):
            whole = quantize_nvfp4(full[e], tile_rows=tile)
            assert whole.global_scale.item() == pytest.approx(full[e].abs().max().item() / (448 * 6), rel=1e-7)
            assert torch.equal(row.data, whole.codes), (name, e)
            want = dequantize_nvfp4(whole, torch.float64)
            assert torch.equal(dequantize_operand(row, torch.float64), want), (name, e)
            got_t = dequantize_operand(column, torch.float64)
            if tiles:
                whole_t = quantize_nvfp4(full[e].t(), tile_rows=16)
                assert torch.equal(column.data, whole_t.codes), (name, e)
                assert torch.equal(got_t, dequantize_nvfp4(whole_t, torch.float64)), (name, e)
            else:
                step = full[e].abs().max().double() / 6 * 2  # the largest block multiplier times E2M1's top step
                assert (got_t - want.t()).abs().max() <= step


def test_nvfp4_experts_forward_and_backward_use_the_gathered_casts():
    """16x16 tiles: the gathered casts are the bits the experts cast from the whole weight, so the forward output and
    the input's gradient are equal (gradients round to nearest: the stochastic rounding counter would advance)."""
    model, experts = _experts({"name": "nvfp4", "disable_stochastic_rounding": True})
    x, offs = torch.randn(32, DIM, requires_grad=True), torch.tensor([0, 8, 20, 32], dtype=torch.int32)
    with fp8_autocast():
        expected = experts(x, offs)
    expected.square().sum().backward()
    expected_grad = x.grad.clone()
    x.grad = None
    enable_fp8_all_gather(model, WORLD)
    gathered = {name: _gather(model, experts, name)[0] for name in ("w1", "w2", "w3")}
    for name, weight in gathered.items():
        setattr(experts, name, nn.Parameter(weight))
    with fp8_autocast():
        got = experts(x, offs)
    got.square().sum().backward()
    assert torch.equal(got, expected) and torch.equal(x.grad, expected_grad)
