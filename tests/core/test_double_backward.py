"""FP8 linear layers refuse a differentiable gradient (``create_graph=True``) at once, with an error that says why.

The layer's backward GEMMs multiply FP8 copies made outside autograd, so gradients taken with ``create_graph=True``
would carry no graph and a second derivative through the layer would silently be zero. For every recipe, for
``nn.Linear`` and transformers' ``Conv1D``, on the eager step and on the traced step (run eagerly), the first
``torch.autograd.grad(..., create_graph=True)`` raises. First-order gradients (``autograd.grad`` without
``create_graph``, ``backward()`` inside ``torch.enable_grad()``) are unaffected, and the advised escape (the layer in
high precision) gives the second derivative a float64 computation gives. Under ``torch.compile`` torch's compiled
backward refuses double backward itself (checked here too, so a silent zero cannot come back unnoticed).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fp8_lightning import convert_to_fp8, fp8_autocast
from fp8_lightning.recipes import RECIPES
from tests.conftest import requires_cuda_fp8

KINDS = ["linear", "conv1d"]


def _layer(kind: str, recipe: str) -> nn.Module:
    """A converted 128 -> 64 layer of ``kind`` (a Sequential, so conversion swaps the child in place)."""
    torch.manual_seed(0)
    if kind == "linear":
        inner = nn.Linear(128, 64)
    else:
        conv1d = pytest.importorskip("transformers.pytorch_utils", reason="needs transformers (dev extras)").Conv1D
        inner = conv1d(64, 128)  # nf (out) = 64, nx (in) = 128
        with torch.no_grad():
            inner.bias.normal_()
    model = nn.Sequential(inner)
    report = convert_to_fp8(model, recipe)
    assert report.converted == ["0"], report
    return model


def _weight(model: nn.Module) -> torch.Tensor:
    return model[0].weight


def _forward(model: nn.Module, x: torch.Tensor, traced: bool) -> torch.Tensor:
    layer = model[0]
    if traced:  # the compiled path's layer step (fp8_lightning.traced), here run eagerly
        return layer._traced_forward(x, layer.fp8_recipe, x.dtype, False)
    return model(x)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_create_graph_is_refused_at_once(recipe, kind, traced):
    model = _layer(kind, recipe)
    x = torch.randn(32, 128, requires_grad=True)
    with fp8_autocast():
        loss = _forward(model, x, traced).square().mean()
    with pytest.raises(RuntimeError, match=r"create_graph=True") as info:
        torch.autograd.grad(loss, x, create_graph=True)
    message = str(info.value)
    assert "FP8 has no second derivative" in message  # why
    assert "fp8_autocast(enabled=False)" in message and "layers=" in message  # what to do
    with fp8_autocast():  # the weight alone (a gradient penalty on the weight) is refused too
        loss = _forward(model, x.detach(), traced).square().mean()
    with pytest.raises(RuntimeError, match=r"create_graph=True"):
        torch.autograd.grad(loss, _weight(model), create_graph=True)


def _float64_grads(model: nn.Module, x: torch.Tensor, kind: str):
    """d(mean(y^2))/dx and /dW in float64 from the layer's high-precision parameters (an independent reference)."""
    w = _weight(model).detach().double().requires_grad_()
    xd = x.detach().double().requires_grad_()
    w_nk = w if kind == "linear" else w.t()  # Conv1D stores (in, out)
    y = F.linear(xd, w_nk, model[0].bias.detach().double())
    return torch.autograd.grad(y.square().mean(), (xd, w))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_first_order_autograd_grad_still_works(recipe, kind):
    model = _layer(kind, recipe)
    torch.manual_seed(1)
    x = torch.randn(32, 128, requires_grad=True)
    with fp8_autocast():
        loss = model(x).square().mean()
    gx, gw = torch.autograd.grad(loss, (x, _weight(model)), create_graph=False)
    assert gx.grad_fn is None and gw.grad_fn is None
    ref_x, ref_w = _float64_grads(model, x, kind)
    bound = 0.3 if recipe == "nvfp4" else 0.1  # FP8 (or FP4) rounding of the operands
    for got, ref in ((gx, ref_x), (gw, ref_w)):
        rel = ((got.double() - ref).norm() / ref.norm()).item()
        assert 0 < rel < bound, rel  # and not zero: the FP8 path ran
    with torch.enable_grad(), fp8_autocast():  # Lightning's training step: backward() with grad mode on
        model(x).square().mean().backward()
    for got, ref, first in ((x.grad, ref_x, gx), (_weight(model).grad, ref_w, gw)):
        assert ((got.double() - ref).norm() / ref.norm()).item() < bound
        if recipe != "nvfp4":  # NVFP4 rounds gradients stochastically, with a counter that moves every backward
            assert torch.equal(got, first)


@pytest.mark.parametrize("kind", KINDS)
def test_the_advised_high_precision_escape_gives_the_true_second_derivative(kind):
    """A gradient penalty ||d loss / dx||^2 differentiated by the weight, with the layer under
    fp8_autocast(enabled=False), equals the float64 computation; the layer policy's high precision too."""
    model = _layer(kind, "tensorwise")
    torch.manual_seed(2)
    x = torch.randn(16, 128, requires_grad=True)

    def penalty_grad(m, xs, w):
        (gx,) = torch.autograd.grad(m(xs).square().mean(), xs, create_graph=True)
        return torch.autograd.grad(gx.square().sum(), w)[0]

    with fp8_autocast(enabled=False):
        ours = penalty_grad(model, x, _weight(model))
    w = _weight(model).detach().double().requires_grad_()
    bias = model[0].bias.detach().double()
    ref = penalty_grad(lambda t: F.linear(t, w if kind == "linear" else w.t(), bias), x.detach().double()
                       .requires_grad_(), w)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-4, atol=1e-7)
    assert ref.abs().max() > 0
    torch.manual_seed(0)
    kept = nn.Sequential(nn.Linear(128, 64))
    report = convert_to_fp8(kept, "tensorwise", layers={"0": None})
    assert report.converted == [] and type(kept[0]) is nn.Linear
    with fp8_autocast():
        assert penalty_grad(kept, x, kept[0].weight).abs().max() > 0


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])  # one that updates state in backward, one that does not
def test_a_compiled_step_refuses_double_backward_too(recipe):
    """torch.compile traces the layer's backward with grad disabled (the check adds nothing to its graph); a
    differentiable gradient through the compiled step is then refused by torch's compiled backward (at the first
    autograd.grad, or at the second derivative), never returned as a silent zero. First-order gradients compile."""
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 64))
    convert_to_fp8(model, recipe)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(32, 128, requires_grad=True)
    with fp8_autocast():
        (gx,) = torch.autograd.grad(compiled(x).square().mean(), x)
    assert gx.abs().max() > 0
    with pytest.raises(RuntimeError, match="double backward|create_graph"):
        with fp8_autocast():
            loss = compiled(x).square().mean()
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
        torch.autograd.grad(gx.square().sum(), model[0].weight)


@pytest.mark.gpu
@requires_cuda_fp8
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise"])
def test_on_cuda_the_backward_thread_refuses_and_first_order_runs(recipe):
    """On a GPU autograd runs the backward on its device thread, which takes create_graph's grad mode too."""
    model = _layer("linear", recipe).cuda()
    x = torch.randn(32, 128, device="cuda", requires_grad=True)
    with fp8_autocast():
        loss = model(x).square().mean()
    with pytest.raises(RuntimeError, match=r"create_graph=True"):
        torch.autograd.grad(loss, x, create_graph=True)
    with fp8_autocast():
        loss = model(x).square().mean()
    gx, gw = torch.autograd.grad(loss, (x, _weight(model)))
    ref_x, ref_w = _float64_grads(model, x, "linear")
    for got, ref in ((gx, ref_x), (gw, ref_w)):
        assert 0 < ((got.double() - ref).norm() / ref.norm()).item() < 0.1
