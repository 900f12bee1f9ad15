"""RowwiseScaling against torchao.float8 (its ``AXISWISE`` casts and ``rowwise`` / ``rowwise_with_gw_hp`` layers,
written independently of this project), against float64 products, and in cuBLAS's layout on fake CUDA tensors."""

from __future__ import annotations

import copy

import pytest
import torch

from fp8_lightning import FP8Linear, fp8_autocast
from fp8_lightning.quantize import Quantized
from fp8_lightning.recipes import RowwiseScaling
from fp8_lightning.rowwise import quantize_rowwise, rowwise_scaled_mm_args
from tests.core.fake_cuda import fake_cuda, fake_operand

pytest.importorskip("torchao.float8", reason="torchao.float8 (the peer) is not installed: pip install -e '.[peer]'")
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8.config import ScalingGranularity  # noqa: E402
from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
U = 2.0**-24  # float32 unit roundoff


def _inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(64, 96, generator=gen) * torch.logspace(-20, 20, 64).unsqueeze(1)  # a binade range per row
    wide[5] = 0.0  # an all-zero row
    wide[:, 7] = 0.0  # an all-zero column
    return [torch.randn(48, 80, generator=gen) * 3, wide, wide.bfloat16(), torch.randn(1, 16, generator=gen)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("power_of_2", [False, True])
@pytest.mark.parametrize("dim", [-1, 0])
def test_rowwise_scales_and_codes_equal_torchaos_axiswise_cast(dtype, power_of_2, dim):
    for x in _inputs():
        peer_scale = tensor_to_scale(x, dtype, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=dim,
                                     round_scales_to_power_of_2=power_of_2)  # fmt: skip
        peer_data = to_fp8_saturated(x.float() * peer_scale, dtype)
        data, scale = quantize_rowwise(x, dtype, dim, power_of_2=power_of_2)
        assert scale.shape == peer_scale.shape and torch.equal(scale.view(torch.int32), peer_scale.view(torch.int32))
        assert torch.equal(_bits(data), _bits(peer_data))


def test_non_finite_rows_get_scale_one_and_leave_the_other_rows_alone():
    x = torch.randn(4, 32) * 10
    x[1, 3], x[2, 5] = float("inf"), float("nan")
    data, scale = quantize_rowwise(x, E4M3, power_of_2=False)
    assert scale[1].item() == scale[2].item() == 1.0
    assert data[1, 3].float().item() == 448.0 and torch.isnan(data[2, 5].float())
    assert torch.equal(_bits(data[1]), _bits(x[1].clamp(-448, 448).to(E4M3)))  # scale 1, inf saturated
    for row in (0, 3):  # as if quantized alone
        alone_data, alone_scale = quantize_rowwise(x[row : row + 1], E4M3, power_of_2=False)
        assert torch.equal(scale[row], alone_scale[0]) and torch.equal(_bits(data[row]), _bits(alone_data[0]))


def _pair(recipe_name: str, recipe: RowwiseScaling, dtype: torch.dtype, bias: bool = False):
    torch.manual_seed(0)
    base = torch.nn.Linear(256, 128, bias=bias).to(dtype)
    peer = torch.nn.Sequential(copy.deepcopy(base))
    convert_to_float8_training(peer, config=Float8LinearConfig.from_recipe_name(recipe_name))
    return base, peer, FP8Linear.from_linear(copy.deepcopy(base), recipe)


def _run(layer, x, grad_y, autocast):
    x = x.clone().requires_grad_()
    if autocast:
        with fp8_autocast():
            y = layer(x)
    else:
        y = layer(x)
    y.backward(grad_y)
    weight = layer.weight if hasattr(layer, "weight") else layer[0].weight
    return y, x.grad, weight.grad


PEER_RECIPES = [("rowwise", RowwiseScaling()), ("rowwise_with_gw_hp", RowwiseScaling(high_precision_wgrad=True))]


@pytest.mark.parametrize("name, recipe", PEER_RECIPES)
def test_bf16_layer_equals_torchaos_float8_linear_bit_for_bit(name, recipe):
    """Same casts, same ``torch._scaled_mm`` calls (power-of-two scales make torchao's scaling after its bf16 GEMM
    exact): output, input gradient and weight gradient are equal."""
    _, peer, ours = _pair(name, recipe, torch.bfloat16)
    x = (torch.randn(64, 256) * torch.logspace(-3, 3, 64).unsqueeze(1)).bfloat16()
    grad_y = (torch.randn(64, 128) * 1e-3).bfloat16()
    for got, want in zip(_run(ours, x, grad_y, True), _run(peer, x, grad_y, False)):
        assert torch.equal(got, want)


def _within_float32_sum_bound(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``got`` is a float32 ``a @ b.T``: each entry within (K + 2) u of the float64 sum of |products| (K additions,
    one rounding of the sum, one of each scaling)."""
    a, b = a.double(), b.double()
    exact, magnitude = a @ b.t(), a.abs() @ b.abs().t()
    err = (got.double() - exact).abs()
    assert (err <= (a.shape[1] + 2) * U * magnitude).all(), (err / magnitude.clamp(min=1e-300)).max().item()


def _peer_dequantized(t: torch.Tensor, dtype: torch.dtype, dim: int | None) -> torch.Tensor:
    """torchao's cast of ``t`` (rowwise along ``dim``, or per tensor with ``dim=None``), dequantized in float64."""
    granularity = ScalingGranularity.TENSORWISE if dim is None else ScalingGranularity.AXISWISE
    scale = tensor_to_scale(t, dtype, scaling_granularity=granularity, axiswise_dim=dim,
                            round_scales_to_power_of_2=True)  # fmt: skip
    return to_fp8_saturated(t.float() * scale, dtype).double() / scale.double()


@pytest.mark.parametrize("high_precision_wgrad", [False, True])
def test_float32_layer_gradients_are_float64_products_of_the_dequantized_operands(high_precision_wgrad):
    """In float32 each GEMM multiplies its own rowwise copies: y from x and W along K, dx from g along N and W down
    its columns (or per tensor), dW from g and x down their columns (or unquantized)."""
    torch.manual_seed(1)
    base = torch.nn.Linear(96, 48, bias=True)
    recipe = RowwiseScaling(fp8_format="HYBRID", high_precision_wgrad=high_precision_wgrad)
    ours = FP8Linear.from_linear(copy.deepcopy(base), recipe)
    x, grad_y = torch.randn(40, 96) * 3, torch.randn(40, 48) * 1e-2
    y, dx, dw = _run(ours, x, grad_y, True)
    w = base.weight.detach()
    _within_float32_sum_bound(y - base.bias.detach(), _peer_dequantized(x, E4M3, -1), _peer_dequantized(w, E4M3, -1))
    w_for_dgrad = _peer_dequantized(w, E4M3, None if high_precision_wgrad else 0)
    _within_float32_sum_bound(dx, _peer_dequantized(grad_y, E5M2, -1), w_for_dgrad.t())
    if high_precision_wgrad:
        _within_float32_sum_bound(dw, grad_y.t(), x.t())
    else:
        _within_float32_sum_bound(dw, _peer_dequantized(grad_y, E5M2, 0).t(), _peer_dequantized(x, E4M3, 0).t())
    assert torch.allclose(ours.bias.grad, grad_y.sum(0))


@pytest.mark.parametrize("m, k, n", [(64, 256, 128), (40, 200, 72), (1, 24, 8)])
def test_cuda_layouts_pass_torchs_scaled_mm_checks(m, k, n):
    """On fake CUDA tensors: mat1 row-major, mat2 column-major, K and N padded to 16, scales (M, 1) and (1, N)
    contiguous float32, which torch's meta ``_scaled_mm`` accepts as rowwise; the padded columns' factors are 1."""
    with fake_cuda():
        mat1, mat2, scale_a, scale_b = rowwise_scaled_mm_args(fake_operand((m, k), (m, 1), "row"),
                                                              fake_operand((n, k), (n, 1), "row"))  # fmt: skip
        out = torch._scaled_mm(mat1, mat2, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
        assert out.device.type == "cuda" and out.shape == (m, -(-n // 16) * 16)
        assert mat1.stride(1) == 1 and mat2.stride(0) == 1 and mat1.shape[1] % 16 == 0 == mat2.shape[1] % 16
        assert scale_a.shape == (m, 1) and scale_b.shape == (1, mat2.shape[1])
        assert scale_a.is_contiguous() and scale_b.is_contiguous() and scale_a.dtype == scale_b.dtype == torch.float32
    a = Quantized(*quantize_rowwise(torch.randn(m, k), E4M3), "row")
    b = Quantized(*quantize_rowwise(torch.randn(n, k), E4M3), "row")
    _, _, _, real_scale_b = rowwise_scaled_mm_args(a, b)
    assert torch.equal(real_scale_b[0, :n], b.scale.reciprocal()[:, 0]) and (real_scale_b[0, n:] == 1).all()


def test_fine_grained_recipes_keep_no_state_and_checkpoint_their_recipe():
    """Rowwise and blockwise scales come from the tensor being cast: the layer's saved scaling state is the recipe,
    which loads back (a second model then trains with the same recipe's state)."""
    from fp8_lightning import BlockwiseScaling, convert_to_fp8, fp8_state_dict, load_fp8_state_dict

    for recipe in (RowwiseScaling(high_precision_wgrad=True), BlockwiseScaling(power_of_2_scales=False)):
        model = torch.nn.Sequential(torch.nn.Linear(32, 32))
        convert_to_fp8(model, recipe)
        with fp8_autocast():
            model(torch.randn(4, 32)).sum().backward()
        state = fp8_state_dict(model)
        assert state["0"]["scalings"] == [{"recipe": recipe.to_dict(), "operands": {}}]
        other = torch.nn.Sequential(torch.nn.Linear(32, 32))
        convert_to_fp8(other, recipe)
        load_fp8_state_dict(other, state)
        assert fp8_state_dict(other) == state


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fast_accum", [True, False])
def test_cuda_gemm_hands_fast_accumulation_to_scaled_mm(out_dtype, fast_accum):
    """Both of cuBLAS's rowwise routes (bf16 output with rowwise scales; other outputs through unit scales) get the
    GEMM's fast accumulation flag, recorded from the ``_scaled_mm`` call torch's CUDA checks accept."""
    from fp8_lightning.rowwise import rowwise_mm
    from tests.core.test_scaled_mm import RecordScaledMM

    with fake_cuda(), RecordScaledMM() as record:
        out = rowwise_mm(fake_operand((40, 64), (40, 1), "row"), fake_operand((24, 64), (24, 1), "row"), out_dtype,
                         fast_accum)  # fmt: skip
        assert out.device.type == "cuda" and out.shape == (40, 24) and out.dtype == out_dtype
    assert [call["use_fast_accum"] for call in record.calls] == [fast_accum]


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("fprop, grad", [(True, False), (False, True)])
def test_each_rowwise_gemm_gets_the_recipes_fast_accumulation(fprop, grad, traced, monkeypatch):
    """fprop, dgrad and wgrad of a rowwise layer step ask for the recipe's fast accumulation, eager and traced."""
    from fp8_lightning import fine_grained
    from fp8_lightning.traced import make_plan, traced_linear

    seen, rowwise_mm = [], fine_grained.rowwise_mm

    def recording_mm(a, b, out_dtype, fast_accum):
        seen.append(fast_accum)
        return rowwise_mm(a, b, out_dtype, fast_accum)

    monkeypatch.setattr(fine_grained, "rowwise_mm", recording_mm)
    recipe = RowwiseScaling(fprop_fast_accum=fprop, grad_fast_accum=grad)
    layer = FP8Linear.from_linear(torch.nn.Linear(32, 16), recipe)
    x = torch.randn(8, 32, requires_grad=True)
    if traced:
        plan = make_plan(recipe, x.device, torch.float32, False)
        y = traced_linear(x, layer.weight, layer.bias, plan, layer.fp8_scaling(recipe).operands, True)
    else:
        with fp8_autocast():
            y = layer(x)
    y.sum().backward()
    assert seen == [fprop, grad, grad]  # fprop, then the two backward GEMMs
