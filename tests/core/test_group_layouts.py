"""The padded token layout of the grouped GEMMs and the protocol of the grouped operand containers.

The layout (each group of tokens placed at a multiple of ``align``, zeros between, an empty group taking one aligned
slot) is built once on the host (:func:`host_token_layout`, from the bounds) and once on the device
(:func:`token_layout`, from ``offs``, with no read of it on the host: it runs on meta tensors, and on CUDA under
torch's sync debug mode). Both are held against a plain Python loop over the groups.

The emulated grouped GEMMs ask the containers two things: the columns' values for the weight gradient with the ends
and bounds the product reduces over (:meth:`GroupOperands.wgrad_values`), and the experts' weight values as the
GEMMs multiply them (:meth:`ExpertOperands.gemm_values`). Both are held against the per-group and per-expert operands
dequantized one by one; a plain list (the recipe protocol's default) answers None and the GEMM takes the per-group
route, whose gradients are held against the container route and a float64 product.
"""

from __future__ import annotations

import pytest
import torch

from fp8_lightning import fp8_grouped_mm
from fp8_lightning.grouped.gemm import GroupedScaling
from fp8_lightning.groups import (
    device_layout,
    expert_gemm_values,
    group_bounds,
    host_token_layout,
    padded_rows,
    token_layout,
    wgrad_values,
)
from fp8_lightning.recipes import recipe_from
from fp8_lightning.recipes.base import Recipe

ROUTES = [[0, 0, 0], [5], [0, 17, 17, 50], [16, 32, 33, 33], [1, 2, 3, 200], [128, 128, 300, 301]]
ALIGNS = [1, 16, 32, 128]
SIZES = [0, 40, 3, 0, 70]  # tokens per expert: empty experts, first and in the middle
E, N, K = len(SIZES), 64, 128  # whole blocks for every recipe (MX 32, NVFP4 16)


def _loop(ends: list[int], align: int):
    """(starts, counts, sizes, padded ends, each row's group, each row's place) by a loop over the groups."""
    starts, counts, sizes, out_ends, group, dest = [], [], [], [], [], []
    start, out = 0, 0
    for g, end in enumerate(ends):
        count = end - start
        size = max(-(-count // align), 1) * align
        starts.append(start), counts.append(count), sizes.append(size), out_ends.append(out + size)
        group += [g] * count
        dest += list(range(out, out + count))
        start, out = end, out + size
    return starts, counts, sizes, out_ends, group, dest


@pytest.mark.parametrize("align", ALIGNS)
@pytest.mark.parametrize("ends", ROUTES, ids=str)
def test_device_and_host_layouts_match_a_loop_over_the_groups(ends, align):
    starts, counts, sizes, out_ends, group, dest = _loop(ends, align)
    layout = token_layout(torch.tensor(ends, dtype=torch.int32), align, ends[-1])
    assert [t.tolist() for t in layout] == [starts, counts, sizes, out_ends, group, dest]
    assert all(t.dtype == torch.int64 for t in layout)
    without_rows = token_layout(torch.tensor(ends, dtype=torch.int32), align)
    assert without_rows.group is None and without_rows.dest is None and without_rows.ends.tolist() == out_ends
    host = host_token_layout(list(zip([0, *ends[:-1]], ends)), align)
    assert (host.sizes, host.padded, host.starts) == (counts, sizes, [e - s for e, s in zip(out_ends, sizes)])


def test_the_device_layout_never_reads_offs_on_the_host():
    """On the meta device a read of the values (``.tolist()``, ``.item()``, a Python branch on a tensor) raises."""
    layout = token_layout(torch.empty(7, dtype=torch.int32, device="meta"), 32, 250)
    assert [tuple(t.shape) for t in layout] == [(7,)] * 4 + [(250,)] * 2
    assert all(t.device.type == "meta" for t in layout)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the device-sync check of the layout")
def test_on_a_gpu_the_layout_is_built_without_a_device_sync():
    """torch's sync debug mode raises on a host-device sync (a ``.tolist()``, ``.item()`` or data-dependent shape)."""
    ends = [0, 17, 17, 50]
    offs = torch.tensor(ends, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layout = token_layout(offs, 16, ends[-1])
        starts, rows, out_starts, out_ends = device_layout(offs, 16)
        dest, _ = padded_rows(offs, ends[-1], 16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [t.tolist() for t in layout] == list(_loop(ends, 16))
    assert dest.tolist() == layout.dest.tolist() and out_ends.tolist() == layout.ends.tolist()


def _inputs(seed: int = 0):
    torch.manual_seed(seed)
    x = torch.randn(sum(SIZES), K) * torch.logspace(-2, 1, K)
    offs = torch.cumsum(torch.tensor(SIZES), 0).to(torch.int32)
    return x, offs, group_bounds(offs, x.shape[0], E)


@pytest.mark.parametrize("name", ["tensorwise", "delayed", "rowwise", "blockwise", "mxfp8"])
def test_columns_give_every_groups_values_in_token_order_with_the_tokens_groups(name):
    recipe = recipe_from(name)
    x, offs, bounds = _inputs()
    dtype = recipe.fp8_format.forward_dtype
    state = GroupedScaling(recipe, E).operands.get("input")
    columns = recipe.grouped_operands("input", x, bounds, dtype, True, state, True)[1]
    values, wgrad_offs, wgrad_bounds = wgrad_values(columns, offs, bounds)
    assert wgrad_offs is offs and wgrad_bounds is bounds
    assert torch.equal(values, _side_by_side(columns, bounds))  # each group's own operand, one by one
    alone = Recipe.grouped_operands(recipe, "input", x, bounds, dtype, True, state, True)[1]  # group by group
    if not recipe.per_tensor:  # one scale for the whole tensor, not per group
        assert torch.equal(values, _side_by_side(alone, bounds))
    assert wgrad_values(alone, offs, bounds) is None  # a plain list: the per-group route


def _side_by_side(columns, bounds) -> torch.Tensor:
    parts = [q.kind.dequantize(q, torch.float32)[:, : end - start] for q, (start, end) in zip(columns, bounds) if q]
    return torch.cat(parts, dim=1)


def test_nvfp4_columns_give_the_padded_layout_with_its_ends():
    """The Hadamard transform spreads a group's tokens into its padding: the product reduces over the padded groups."""
    recipe = recipe_from("nvfp4")
    x, offs, bounds = _inputs(1)
    columns = recipe.grouped_operands("input", x, bounds, torch.float8_e4m3fn, True, None, True)[1]
    values, wgrad_offs, wgrad_bounds = wgrad_values(columns, offs, bounds)
    _, _, sizes, out_ends, _, _ = _loop(offs.tolist(), 16)
    assert wgrad_offs.tolist() == out_ends and list(wgrad_bounds) == list(zip([0, *out_ends[:-1]], out_ends))
    assert values.shape == (K, out_ends[-1])
    for q, (start, end) in zip(columns, wgrad_bounds):  # each group's own operand at its padded place
        if q is not None:
            assert torch.equal(values[:, start:end], q.kind.dequantize(q, torch.float32))


@pytest.mark.parametrize("name", ["tensorwise", "delayed", "rowwise", "blockwise", "mxfp8", "nvfp4"])
def test_weights_give_the_gemms_values_of_each_experts_operands(name):
    recipe = recipe_from(name)
    scaling = GroupedScaling(recipe, E)
    torch.manual_seed(3)
    w = torch.randn(E, N, K) * torch.logspace(-3, 1, E).view(E, 1, 1)
    operands = recipe.grouped_weight_operands(w, scaling.forward_dtype, scaling.expert_states, True)
    fprop, dgrad = expert_gemm_values(operands, False), expert_gemm_values(operands, True)
    assert fprop.is_contiguous() and dgrad.is_contiguous()
    assert torch.equal(fprop, torch.stack([q.kind.dequantize(q, torch.float32).t() for q, _ in operands]))  # (E,K,N)
    assert torch.equal(dgrad, torch.stack([q.kind.dequantize(q, torch.float32).t() for _, q in operands]))  # (E,N,K)
    assert expert_gemm_values(list(operands), True) is None  # a plain list: dequantized expert by expert


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "mxfp8"])
def test_the_per_group_route_gives_the_gradients_of_the_containers(name, monkeypatch):
    """The same operands handed over as plain lists (a recipe that keeps the protocol's default form) take the
    per-group route: the same gradients, bit for bit, and the float64 product of the operands' values."""
    recipe = recipe_from(name)
    x, offs, _ = _inputs(4)
    w = torch.randn(E, N, K) * 0.1
    grad_y = torch.randn(x.shape[0], N)
    seen = []

    def run():
        a, weight = x.clone().requires_grad_(), w.clone().requires_grad_()
        fp8_grouped_mm(a, weight.transpose(1, 2), offs, recipe=recipe).backward(grad_y)
        return a.grad, weight.grad

    cls = type(recipe)
    grouped_operands, grouped_weight_operands = cls.grouped_operands, cls.grouped_weight_operands
    containers = run()

    def as_lists(self, role, *args):
        row, columns = grouped_operands(self, role, *args)
        seen.append((role, columns))
        return row, None if columns is None else list(columns)

    monkeypatch.setattr(cls, "grouped_operands", as_lists)
    monkeypatch.setattr(cls, "grouped_weight_operands", lambda self, *args: list(grouped_weight_operands(self, *args)))
    lists = run()
    assert torch.equal(containers[0], lists[0]) and torch.equal(containers[1], lists[1])
    columns = dict(seen)
    for e, (start, end) in enumerate(zip([0, *offs.tolist()[:-1]], offs.tolist())):
        g_q, x_q = columns["grad_output"][e], columns["input"][e]
        if g_q is None:
            assert not lists[1][e].any()
            continue
        g_v, x_v = (q.kind.dequantize(q, torch.float32).double()[:, : end - start] for q in (g_q, x_q))
        torch.testing.assert_close(lists[1][e].double(), g_v @ x_v.t(), rtol=1e-5, atol=1e-5)
