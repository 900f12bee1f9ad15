"""NVFP4's batched grouped casts against the per-expert and per-group casts they replace, kept here as the reference:
each expert's weight cast on its own (its own amax and global scale, 16x16 tiles or 1x16 blocks), and each group's
wgrad copy cast on its own (its tokens transposed, zero-padded to whole 16-blocks, through the RHT, its own global
scale, stochastic rounding keyed ``mix_seed(seed, rank, counter, group)``). Every code, block multiplier and GEMM
scale (E4M3 block scales and the float32 global scale cuBLAS reads) must be bit-identical, over several steps, with
empty groups and groups that are not whole blocks, the stochastic-rounding counter advancing as before; the emulated
weight gradient is held to float64 products of the reference operands.
"""

from __future__ import annotations

import pytest
import torch

from fp8_lightning import fp8_grouped_mm
from fp8_lightning.grouped.gemm import GroupedScaling
from fp8_lightning.groups import group_bounds
from fp8_lightning.nvfp4 import mix_seed
from fp8_lightning.recipes.nvfp4 import _COLUMN, NVFP4BlockScaling, NVFP4LayerState, _rank
from tests.conftest import requires_cuda_fp8

E, N, K = 5, 32, 48
SIZES = [0, 21, 16, 0, 35]  # empty groups, a whole block, groups ending inside a block
# on CUDA the per-expert / per-group reference casts run the Triton NVFP4 cast, the batched ones torch's operations
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda_fp8])]


def _reference_columns(recipe, role, x, bounds, state, record):
    """The per-group casts (the code the batched cast replaced): the row copy, then each group on its own."""
    row, _ = recipe._copies(role, x, state.signs, state.sr_casts, record)
    stochastic = role == "grad_output" and not recipe.disable_stochastic_rounding
    columns = []
    for group, (start, end) in enumerate(bounds):
        if start == end:
            columns.append(None)
            continue
        key = mix_seed(recipe.seed, _rank(), state.sr_casts, group) if stochastic else None
        columns.append(recipe._activation_copy(recipe._wgrad_form(x[start:end].t(), state.signs), key, _COLUMN))
    return row, columns


def _reference_weights(recipe, weight):
    """Each expert cast on its own."""
    pairs = []
    for expert in weight:
        row, column = recipe._copies("weight", expert, None, None, True)
        pairs.append((row, column()))
    return pairs


def _same(ours, theirs) -> None:
    assert torch.equal(ours.data.contiguous(), theirs.data.contiguous())  # packed codes, bit for bit
    assert torch.equal(ours.scale.view(torch.int32), theirs.scale.view(torch.int32))  # block multipliers
    assert torch.equal(ours.cache.native, theirs.cache.native)  # global scale bytes and E4M3 block scales


def _tokens(step: int) -> torch.Tensor:
    torch.manual_seed(100 + step)
    scales = torch.logspace(-3, 2, E).repeat_interleave(torch.tensor(SIZES), 0).unsqueeze(1)
    return (torch.randn(sum(SIZES), K) * scales).to(torch.bfloat16)  # each group of its own range


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rht", [True, False])
@pytest.mark.parametrize("stochastic", [True, False])
def test_group_columns_match_per_group_casts(rht, stochastic, device):
    recipe = NVFP4BlockScaling(disable_rht=not rht, disable_stochastic_rounding=not stochastic, seed=7)
    ours_state, ref_state = NVFP4LayerState(recipe, device), NVFP4LayerState(recipe, device)
    offs = torch.cumsum(torch.tensor(SIZES), 0).to(torch.int32).to(device)
    for step in range(3):
        x = _tokens(step).to(device)
        bounds = group_bounds(offs, x.shape[0], E)
        for role in ("input", "grad_output"):
            row, columns = recipe.grouped_operands(role, x, bounds, None, True, ours_state, True)
            ref_row, ref_columns = _reference_columns(recipe, role, x, bounds, ref_state, True)
            _same(row, ref_row)
            assert len(columns) == E
            for q, ref, size in zip(columns, ref_columns, SIZES):
                assert (q is None) == (ref is None) == (size == 0)
                if q is not None:
                    _same(q, ref)
            assert torch.equal(ours_state.sr_casts, ref_state.sr_casts)
            # the whole layout's values: each group's reference values at its padded place, zeros elsewhere
            values, at = columns.padded_values(), 0
            for ref, (start, end) in zip(ref_columns, columns.bounds):
                part = values[:, start:end]
                if ref is None:
                    assert not part.any()
                else:
                    assert torch.equal(part, ref.kind.dequantize(ref, torch.float32))
                at = end
            assert at == values.shape[1]
    assert ours_state.sr_casts.item() == (3 if stochastic else 0)
    assert ours_state.state_dict()["sr_casts"] == ref_state.state_dict()["sr_casts"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiles", [True, False])
def test_stacked_weights_match_per_expert_casts(tiles, device):
    recipe = NVFP4BlockScaling(fp4_2d_weights=tiles)
    torch.manual_seed(3)
    weight = (torch.randn(E, N, K) * torch.logspace(-4, 3, E).view(E, 1, 1)).to(device)
    weight[2] = 0.0  # an all-zero expert: global scale 1
    for step in range(2):
        ours = recipe.grouped_weight_operands(weight, None, [None] * E, True)
        theirs = _reference_weights(recipe, weight)
        assert len(ours) == E
        for (w, w_t), (ref, ref_t) in zip(ours, theirs):
            _same(w, ref)
            _same(w_t, ref_t)
        expected = torch.stack([ref.kind.dequantize(ref, torch.float32) for ref, _ in theirs])
        assert torch.equal(ours.values(), expected)
        expected_t = torch.stack([ref_t.kind.dequantize(ref_t, torch.float32).t() for _, ref_t in theirs])
        assert torch.equal(ours.transposed_values(), expected_t)
        weight = (weight * 1.9).to(torch.bfloat16)


def test_weight_gradient_matches_float64_products_of_the_reference_operands():
    """fp8_grouped_mm's emulated wgrad (one product over the padded layout) against float64 products of each group's
    reference copies, the stochastic keys at the counter the step used."""
    recipe = NVFP4BlockScaling(seed=5)
    scaling = GroupedScaling(recipe, E)
    torch.manual_seed(9)
    weight = torch.randn(E, N, K, requires_grad=True)
    x = _tokens(0).float().requires_grad_()
    offs = torch.cumsum(torch.tensor(SIZES), 0).to(torch.int32)
    grad_y = torch.randn(x.shape[0], N)
    ref_state = NVFP4LayerState(recipe)
    ref_state.load_state_dict(scaling.operands["input"].state_dict())
    fp8_grouped_mm(x, weight.transpose(1, 2), offs, scaling=scaling).backward(grad_y)
    bounds = group_bounds(offs, x.shape[0], E)
    _, x_cols = _reference_columns(recipe, "input", x.detach(), bounds, ref_state, True)
    _, g_cols = _reference_columns(recipe, "grad_output", grad_y, bounds, ref_state, True)
    for e in range(E):
        if x_cols[e] is None:
            assert not weight.grad[e].any()
            continue
        g = g_cols[e].kind.dequantize(g_cols[e], torch.float64)
        xv = x_cols[e].kind.dequantize(x_cols[e], torch.float64)
        bound = 2 * g.shape[1] * torch.finfo(torch.float32).eps * (g.abs() @ xv.abs().t())  # float32 summation
        assert ((weight.grad[e].double() - g @ xv.t()).abs() <= bound).all()
