"""torchao as a second implementation: its FP8 casts give our bits, and its FP8 linear layers our results.

torchao.float8 (tensorwise dynamic scaling, E4M3 forward / E5M2 gradients, like ``TensorwiseScaling()``) and
torchao's MX prototype (``to_mx``, the OCP "floor" and cuBLAS "rceil" scale rules, and the emulated MXFP8 training
GEMMs of its ``mx_mm``) were written independently of this project. The casts must agree bit for bit (scales and
codes), on the pure-torch path and, where built, the C codec. The layers' GEMMs then multiply the same FP8 operands
and may differ only by float32 accumulation order: both results must lie within the float32 summation bound of the
float64 product of the dequantized operands (computed from torchao's casts).
"""

from __future__ import annotations

import copy

import pytest
import torch

from fp8_lightning import FP8Linear, MXFP8BlockScaling, TensorwiseScaling, fp8_autocast
from fp8_lightning.ops.dispatch import fast_amax, fast_quantize_mx_operands, fast_quantize_mxfp8, fast_quantize_tensorwise, fast_quantize_with_scale
from fp8_lightning.quantize import tensorwise_scale

pytest.importorskip("torchao.float8", reason="torchao.float8 (the peer) is not installed: pip install -e '.[peer]'")
from torchao.float8 import convert_to_float8_training  # noqa: E402
from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated  # noqa: E402
from torchao.prototype.moe_training.mxfp8_linear import mx_mm  # noqa: E402
from torchao.prototype.mx_formats.config import (  # noqa: E402
    MXFP8Dim0CastKernelChoice,
    MXFP8Dim1CastKernelChoice,
    ScaleCalculationMode,
)
from torchao.prototype.mx_formats.mx_tensor import to_mx  # noqa: E402
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference  # noqa: E402
from tests.environment import set_env

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
U = 2.0**-24  # float32 unit roundoff


@pytest.fixture(autouse=True, params=["C codec", "pure torch"])
def cpu_path(request, monkeypatch):
    set_env(monkeypatch, FP8_LIGHTNING_DISABLE_CPU_CODEC="1" if request.param == "pure torch" else "0")


def _inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    wide = torch.randn(64, 256, generator=gen) * torch.logspace(-20, 20, 64).unsqueeze(1)  # a binade range per row
    wide[3, :32] = 0.0  # an all-zero block
    peaked = torch.randn(96, 64, generator=gen).clamp(-1, 1)
    peaked[5, 7] = -1.7  # an amax whose scale reciprocal(amax) * fp8_max would get one unit in the last place off
    return [torch.randn(96, 64, generator=gen) * 3, wide, wide.bfloat16(), peaked, torch.zeros(8, 32)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("power_of_2", [False, True])
def test_tensorwise_scale_and_codes_equal_torchaos(dtype, power_of_2):
    for x in _inputs():
        peer_scale = tensor_to_scale(x, dtype, round_scales_to_power_of_2=power_of_2)
        peer_data = to_fp8_saturated(x.float() * peer_scale, dtype)
        scale = tensorwise_scale(fast_amax(x), dtype, power_of_2=power_of_2)
        assert scale.view(torch.int32) == peer_scale.view(torch.int32), (x.dtype, scale.item(), peer_scale.item())
        assert torch.equal(_bits(fast_quantize_with_scale(x, scale, dtype)), _bits(peer_data))
        if not power_of_2:
            data, s = fast_quantize_tensorwise(x, dtype)
            assert torch.equal(s, peer_scale) and torch.equal(_bits(data), _bits(peer_data))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_mx_blocks_equal_torchaos_to_mx(dtype, rounding):
    for x in _inputs():
        peer_scale, peer_data = to_mx(x, dtype, 32, ScaleCalculationMode(rounding))
        data, scale = fast_quantize_mxfp8(x, block_size=32, scale_rounding=rounding, fp8_format=dtype)
        assert torch.equal(_bits(data), _bits(peer_data)) and torch.equal(_bits(scale), _bits(peer_scale))
        # the columnwise copy (blocks down the columns, the operand of x.T) is torchao's cast of x.T, zero-padded
        row, col = fast_quantize_mx_operands(x, 32, rounding, dtype)
        x_t = torch.nn.functional.pad(x.t(), (0, -x.shape[0] % 32)).contiguous()
        col_scale, col_data = to_mx(x_t, dtype, 32, ScaleCalculationMode(rounding))
        assert torch.equal(_bits(row.data), _bits(peer_data))
        assert torch.equal(_bits(col.data), _bits(col_data))
        assert torch.equal(_bits(col.scale), _bits(col_scale))


def _within_float32_sum_bound(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``got`` is a float32 ``a @ b.T`` of exactly representable operands: each entry within (K + 1) u of the
    float64 sum of |products| from the exact float64 product (K additions, one rounding of the result)."""
    a, b = a.double(), b.double()
    exact, magnitude = a @ b.t(), a.abs() @ b.abs().t()
    err = (got.double() - exact).abs()
    assert (err <= (a.shape[1] + 1) * U * magnitude).all(), (err / magnitude.clamp(min=1e-300)).max().item()


def test_fp8_linear_matches_torchaos_float8_linear():
    torch.manual_seed(0)
    base = torch.nn.Linear(256, 128, bias=False)
    peer = torch.nn.Sequential(copy.deepcopy(base))
    convert_to_float8_training(peer)
    ours = FP8Linear.from_linear(copy.deepcopy(base), TensorwiseScaling())
    x, grad_y = torch.randn(64, 256) * 3, torch.randn(64, 128) * 1e-3
    x_peer, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_peer = peer(x_peer)
    y_peer.backward(grad_y)
    with fp8_autocast():
        y_ours = ours(x_ours)
    y_ours.backward(grad_y)

    def dequantized(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # torchao's cast, in float64
        scale = tensor_to_scale(t, dtype).double()
        return to_fp8_saturated(t.float() * scale.float(), dtype).double() / scale

    xq, wq, gq = dequantized(x, E4M3), dequantized(base.weight.detach(), E4M3), dequantized(grad_y, E5M2)
    for got in (y_peer, y_ours):
        _within_float32_sum_bound(got, xq, wq)
    for got in (x_peer.grad, x_ours.grad):
        _within_float32_sum_bound(got, gq, wq.t())
    for got in (peer[0].weight.grad, ours.weight.grad):
        _within_float32_sum_bound(got, gq.t(), xq.t())


def _mx_dequantized(t: torch.Tensor, dtype: torch.dtype, rounding: str) -> torch.Tensor:
    """torchao's MX cast of ``t`` (blocks of 32 along its last dimension), dequantized in float64."""
    scale, data = to_mx(t.contiguous(), dtype, 32, ScaleCalculationMode(rounding))
    return data.double() * scale.double().repeat_interleave(32, dim=-1)


@pytest.mark.parametrize("rounding, fmt", [("rceil", "E4M3"), ("floor", "HYBRID")])
def test_mxfp8_linear_matches_torchaos_mx_training_gemms(rounding, fmt):
    """torchao's ``mx_mm`` (emulated GEMMs, torch casts) against ``MXFP8BlockScaling``: each of the three GEMMs
    blocked along its own reduction dimension. 40 tokens: our columnwise copies pad the token dimension with zeros
    to whole blocks, which torchao (whole blocks only) gets as zero rows appended to x and the output gradient."""
    torch.manual_seed(0)
    weight = torch.randn(64, 96) * 0.1
    tokens, padded = 40, 64
    x, grad_y = torch.randn(tokens, 96) * 3, torch.randn(tokens, 64) * 1e-3
    x_pad = torch.nn.functional.pad(x, (0, 0, 0, padded - tokens))
    g_pad = torch.nn.functional.pad(grad_y, (0, 0, 0, padded - tokens))
    grad_dtype = E5M2 if fmt == "HYBRID" else E4M3

    x_peer, w_peer = x_pad.clone().requires_grad_(), weight.clone().requires_grad_()
    y_peer = mx_mm.apply(x_peer, w_peer, E4M3, E4M3, grad_dtype, 32, KernelPreference.EMULATED,
                         MXFP8Dim0CastKernelChoice.TORCH, MXFP8Dim1CastKernelChoice.TORCH,
                         ScaleCalculationMode(rounding), False)  # fmt: skip
    y_peer.backward(g_pad)

    layer = torch.nn.Linear(96, 64, bias=False)
    layer.weight.data.copy_(weight)
    ours = FP8Linear.from_linear(layer, MXFP8BlockScaling(fp8_format=fmt, scale_rounding=rounding))
    x_ours = x.clone().requires_grad_()
    with fp8_autocast():
        y_ours = ours(x_ours)
    y_ours.backward(grad_y)

    fprop = (_mx_dequantized(x, E4M3, rounding), _mx_dequantized(weight, E4M3, rounding))
    dgrad = (_mx_dequantized(grad_y, grad_dtype, rounding), _mx_dequantized(weight.t(), E4M3, rounding))
    wgrad = (_mx_dequantized(g_pad.t(), grad_dtype, rounding), _mx_dequantized(x_pad.t(), E4M3, rounding))
    for y in (y_peer[:tokens], y_ours):
        _within_float32_sum_bound(y, *fprop)
    for dx in (x_peer.grad[:tokens], x_ours.grad):
        _within_float32_sum_bound(dx, *dgrad)
    for dw in (w_peer.grad, ours.weight.grad):
        _within_float32_sum_bound(dw, *wgrad)
