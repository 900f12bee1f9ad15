"""fp8_grouped_mm under NVFP4 (emulated) against float64 math on operands cast here by the reference functions of
:mod:`fp8_lightning.nvfp4`: the activations' 1x16 blocks along K, each expert's weight in 16x16 tiles with its own
global scale, and each expert's wgrad copies padded along its own tokens, through the Hadamard transform and cast
with the group's own global scale. Empty experts get zero gradients and no NaN; the error is the recipe's error on
an nn.Linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fp8_lightning import NVFP4BlockScaling, fp8_grouped_mm
from fp8_lightning.nvfp4 import apply_rht, dequantize_nvfp4, quantize_nvfp4, rht_matrix, rht_signs

SIZES = [0, 5, 33, 17, 0, 40]  # empty experts, groups that are no multiple of 16
K, N = 64, 96
RTN = NVFP4BlockScaling(disable_stochastic_rounding=True)  # deterministic rounding: reproducible here


def _inputs(sizes=SIZES, seed=0):
    torch.manual_seed(seed)
    a = torch.randn(sum(sizes), K) * torch.logspace(-1, 1, K)
    b = torch.randn(len(sizes), K, N) * torch.linspace(0.5, 4, len(sizes)).view(-1, 1, 1)  # per-expert ranges
    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
    return a, b, offs, torch.randn(sum(sizes), N)


def _q64(x: torch.Tensor, tile_rows: int = 1) -> torch.Tensor:
    return dequantize_nvfp4(quantize_nvfp4(x, tile_rows=tile_rows), torch.float64)


def _wgrad_copy64(x_t: torch.Tensor, rht: bool, seed: int) -> torch.Tensor:
    """One group's ``x.T`` zero-padded along its tokens to whole 16-blocks, through the RHT, cast on its own."""
    x_t = F.pad(x_t, (0, -x_t.shape[1] % 16))
    return _q64(apply_rht(x_t, rht_matrix(rht_signs(seed))) if rht else x_t)


def _reference(recipe, a, b, offs, g):
    ends = offs.tolist()
    x64, g64 = _q64(a), _q64(g)  # one global scale for all the tokens: 1x16 blocks lie within a row
    y, da, db = torch.zeros(a.shape[0], N, dtype=torch.float64), torch.zeros_like(x64), torch.zeros_like(b).double()
    for e, (start, end) in enumerate(zip([0] + ends[:-1], ends)):
        w64 = _q64(b[e].t(), tile_rows=16)  # expert e as an (N, K) weight: its own global scale
        if end == start:
            continue
        y[start:end] = x64[start:end] @ w64.t()
        da[start:end] = g64[start:end] @ w64  # dgrad's W.T copy: the same tiles, the same numbers
        rht = not recipe.disable_rht
        dw = _wgrad_copy64(g[start:end].t(), rht, recipe.seed) @ _wgrad_copy64(a[start:end].t(), rht, recipe.seed).t()
        db[e] = dw.t()
    return y, da, db


def _run(recipe, a, b, offs, g):
    a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
    y = fp8_grouped_mm(a, b, offs, recipe=recipe)
    y.backward(g)
    return y, a.grad, b.grad


@pytest.mark.parametrize("recipe", [RTN, NVFP4BlockScaling(disable_stochastic_rounding=True, disable_rht=True)],
                         ids=["rht", "no-rht"])
def test_matches_float64_math_on_reference_operands(recipe):
    a, b, offs, g = _inputs()
    for name, value, ref in zip(("y", "da", "db"), _run(recipe, a, b, offs, g), _reference(recipe, a, b, offs, g)):
        assert value.shape == ref.shape, name
        tol = 8 * torch.finfo(torch.float32).eps * ref.abs().amax().item()  # float32 sums of exact products
        torch.testing.assert_close(value.double(), ref, rtol=0, atol=tol, msg=name)


def test_the_wgrad_sums_the_hadamard_padding():
    """Cutting each group's wgrad copies back to its tokens would drop what the RHT moved into the padding: the
    reference without the padding is farther from the exact product than the grouped GEMM is."""
    a, b, offs, g = _inputs(sizes=[5, 11], seed=2)
    _, _, db = _run(RTN, a, b, offs, g)
    exact = torch.stack([(g[:5].t() @ a[:5]).t(), (g[5:].t() @ a[5:]).t()]).double()
    err = (db.double() - exact).norm() / exact.norm()
    assert err < 0.2  # the FP4 error of a 5- and an 11-token reduction, not a lost fraction of the product


def test_each_expert_has_its_own_global_scale():
    """An expert 10**6 times smaller than the others keeps its resolution: a shared global scale would flush most of its
    weights to zero."""
    a, b, offs, g = _inputs(sizes=[16, 16, 16])
    b[1] *= 1e-6
    y, _, _ = _run(RTN, a, b, offs, g)
    exact = a[16:32] @ b[1]
    assert ((y[16:32] - exact).norm() / exact.norm()).item() < 0.2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the NVFP4 grouped GEMMs on CUDA)")
def test_on_cuda_the_grouped_gemms_match_the_cpu_run():
    """On a GPU the same casts (emulated GEMMs) give the CPU run's output and gradients within float32 rounding."""
    a, b, offs, g = _inputs()
    cpu = _run(RTN, a, b, offs, g)
    with pytest.warns(UserWarning, match="no FP8 grouped GEMM kernel"):
        cuda = _run(RTN, a.cuda(), b.cuda(), offs.cuda(), g.cuda())
    for name, here, there in zip(("y", "da", "db"), cpu, cuda):
        torch.testing.assert_close(there.cpu(), here, rtol=1e-4, atol=1e-4 * here.abs().amax().item(), msg=name)
