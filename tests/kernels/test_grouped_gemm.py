"""The grouped FP8 GEMM kernels against float64 math on the same FP8 operands, in Triton's interpreter.

The interpreter's ``tl.dot`` on FP8 operands is exact and accumulates in float32, so each output differs from the
float64 product of the codes times the two scales only by float32 summation and the final rounding: the tolerance
is a few float32 ulps of the sum of |products| (and one ulp of bf16, which the interpreter truncates to). Covered: ragged groups,
empty groups (first, middle, last), M=0, groups not multiples of 16, K not a multiple of the tile, weights stored
(E, K, N) and (E, N, K), rowwise scales and per-expert (tensorwise) scales, e4m3 x e5m2.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import requires_cuda_kernels

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SIZES = [0, 5, 33, 17, 0, 40, 1, 0]


def codes(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    limit = 448.0 if dtype == E4M3 else 57344.0
    return (torch.randn(*shape, generator=g) * 64).clamp(-limit, limit).to(dtype)


def scales(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.exp2(torch.randint(-12, 4, shape, generator=g).float()) * (1 + torch.rand(shape, generator=g))


def offsets(sizes):
    return torch.cumsum(torch.tensor(sizes, dtype=torch.int64), 0).to(torch.int32)


GPU_ACCUMULATION = 2.0**-12  # promoted into float32 every tile step (fast_accum=False, the kernels' default)


def check_close(got, want64, bound64, out_dtype, accumulation=64 * 2.0**-24):
    """|got - want| within float32 accumulation error (and the output dtype's rounding) of the float64 value. The
    interpreter converts float32 to bf16 by truncation, not to nearest: one bf16 ulp (2**-7 relative) is allowed.
    ``accumulation``: the allowed error over the sum of |terms| (a GPU's tensor cores add FP8 products in fewer
    bits than float32 between promotions)."""
    rel = {torch.float32: 0.0, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[out_dtype]
    tolerance = accumulation * bound64 + rel * want64.abs() + 1e-30
    error = (got.double() - want64).abs()
    assert torch.all(error <= tolerance), f"max error {(error - tolerance).max().item()} over tolerance"


def reference_2d3d(a, b, sa, sb, sizes):
    """float64: each group's rows times its expert's (K, N) weight, scaled per row and per (expert, column)."""
    out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64)
    bound = torch.zeros_like(out)
    start = 0
    for e, m in enumerate(sizes):
        x, w = a[start : start + m].double(), b[e].double()
        s = sa[start : start + m].double().reshape(-1, 1) * sb[e].double().reshape(1, -1)
        out[start : start + m] = (x @ w) * s
        bound[start : start + m] = (x.abs() @ w.abs()) * s.abs()
        start += m
    return out, bound


@pytest.mark.parametrize("storage", ["EKN", "ENK"])
@pytest.mark.parametrize("k", [64, 48])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_2d3d_rowwise_matches_float64(storage, k, out_dtype):
    from fp8_lightning.kernels.grouped_gemm import grouped_mm_2d3d

    experts, n = len(SIZES), 40
    a = codes((sum(SIZES), k), E4M3, 0)
    b = codes((experts, k, n), E4M3, 1)
    if storage == "ENK":  # the weight stored (E, N, K), read through a transposed view, not copied
        b = b.transpose(1, 2).contiguous().transpose(1, 2)
    sa, sb = scales((sum(SIZES),), 2), scales((experts, n), 3)
    got = grouped_mm_2d3d(a, b, sa, sb, offsets(SIZES), out_dtype)
    want, bound = reference_2d3d(a, b, sa, sb, SIZES)
    assert got.dtype == out_dtype and got.shape == want.shape
    check_close(got, want, bound, out_dtype)


def test_2d3d_per_expert_scales_and_mixed_formats():
    """Tensorwise/delayed operands: one scale for ``a`` and one per expert for ``b`` (index stride 0); an e5m2
    gradient times an e4m3 weight."""
    from fp8_lightning.kernels.grouped_gemm import grouped_mm_2d3d

    experts, k, n = len(SIZES), 32, 24
    a = codes((sum(SIZES), k), E5M2, 4)
    b = codes((experts, k, n), E4M3, 5)
    sa, sb = scales((1,), 6), scales((experts, 1), 7)
    got = grouped_mm_2d3d(a, b, sa, sb, offsets(SIZES), torch.float32)
    want, bound = reference_2d3d(a, b, sa.expand(sum(SIZES)), sb.expand(experts, n), SIZES)
    check_close(got, want, bound, torch.float32)


def test_2d3d_no_tokens_and_all_tokens_in_one_expert():
    from fp8_lightning.kernels.grouped_gemm import grouped_mm_2d3d

    b, sb = codes((3, 32, 16), E4M3, 8), scales((3, 16), 9)
    empty = grouped_mm_2d3d(codes((0, 32), E4M3, 0), b, scales((0,), 1), sb, offsets([0, 0, 0]), torch.float32)
    assert empty.shape == (0, 16)
    a, sa = codes((70, 32), E4M3, 10), scales((70,), 11)
    got = grouped_mm_2d3d(a, b, sa, sb, offsets([0, 70, 0]), torch.float32)
    want, bound = reference_2d3d(a, b, sa, sb, [0, 70, 0])
    check_close(got, want, bound, torch.float32)


def reference_2d2d(a, b, sa, sb, sizes):
    """float64: each group's (N, K) product over its own columns of ``a`` and rows of ``b``."""
    out = torch.zeros(len(sizes), a.shape[0], b.shape[1], dtype=torch.float64)
    bound = torch.zeros_like(out)
    start = 0
    for e, m in enumerate(sizes):
        x, y = a[:, start : start + m].double(), b[start : start + m].double()
        s = sa[e].double().reshape(-1, 1) * sb[e].double().reshape(1, -1)
        out[e], bound[e] = (x @ y) * s, (x.abs() @ y.abs()) * s.abs()
        start += m
    return out, bound


@pytest.mark.parametrize("per_expert", [False, True])
def test_2d2d_ragged_reduction_matches_float64(per_expert):
    """wgrad: ``a`` (N, M) row-major, ``b`` (M, K) a column-major view (the layout of the columnwise copies);
    groups of 0, 5, 33... tokens, so the reduction runs past no group's end and empty experts get zeros."""
    from fp8_lightning.kernels.grouped_gemm import grouped_mm_2d2d

    experts, n, k, m = len(SIZES), 24, 40, sum(SIZES)
    a = codes((n, m), E5M2, 12)
    b = codes((k, m), E4M3, 13).t()
    sa, sb = (scales((experts, 1), 14), scales((experts, 1), 15)) if per_expert else (
        scales((experts, n), 14), scales((experts, k), 15))  # fmt: skip
    got = grouped_mm_2d2d(a, b, sa, sb, offsets(SIZES), torch.float32)
    want, bound = reference_2d2d(a, b, sa.expand(experts, n), sb.expand(experts, k), SIZES)
    assert got.shape == (experts, n, k)
    check_close(got, want, bound, torch.float32)
    for e, size in enumerate(SIZES):
        if size == 0:
            assert torch.equal(got[e], torch.zeros(n, k))


def test_2d2d_no_tokens_gives_zeros():
    from fp8_lightning.kernels.grouped_gemm import grouped_mm_2d2d

    got = grouped_mm_2d2d(codes((8, 0), E4M3, 0), codes((0, 16), E4M3, 1), scales((2, 8), 2), scales((2, 16), 3),
                          offsets([0, 0]), torch.bfloat16)  # fmt: skip
    assert got.shape == (2, 8, 16) and torch.equal(got.float(), torch.zeros(2, 8, 16))


def test_the_rowwise_route_multiplies_the_recipes_operands_as_float64_does():
    """The Triton route of the rowwise recipe on the operands the recipe casts (stacked weights stored (E, N, K),
    padded columnwise copies), each of the three GEMMs against float64 math on those operands' exact values."""
    from fp8_lightning.groups import group_bounds
    from fp8_lightning.recipes import RowwiseScaling
    from fp8_lightning.triton_grouped import TritonRowwiseGroupedGemm

    def values(q):  # float64 codes times float64 inverse scales
        return q.data.double() * q.inverse_scale().double()

    sizes, k, n = [0, 7, 33, 0, 18], 48, 32
    g = torch.Generator().manual_seed(20)
    x, grad = torch.randn(sum(sizes), k, generator=g), torch.randn(sum(sizes), n, generator=g)
    weight = torch.randn(len(sizes), n, k, generator=g)
    offs = offsets(sizes)
    recipe, bounds = RowwiseScaling(), group_bounds(offs, sum(sizes), len(sizes))
    x_row, x_cols = recipe.grouped_operands("input", x, bounds, E4M3, True, None, True)
    g_row, g_cols = recipe.grouped_operands("grad_output", grad, bounds, E4M3, True, None, True)
    weights = recipe.grouped_weight_operands(weight, E4M3, [None] * len(sizes), True)
    route = TritonRowwiseGroupedGemm()
    y, dx = route.fprop(x_row, weights, offs, torch.float32), route.dgrad(g_row, weights, offs, torch.float32)
    dw = route.wgrad(g_cols, x_cols, torch.float32)
    xv, gv = values(x_row), values(g_row)
    for e, (start, end) in enumerate(bounds):
        w, w_t = (values(q) for q in weights[e])  # W_e (N, K) and W_e.T (K, N), each scaled its own way
        bound = xv[start:end].abs() @ w.abs().t()
        check_close(y[start:end], xv[start:end] @ w.t(), bound, torch.float32)
        check_close(dx[start:end], gv[start:end] @ w_t.t(), gv[start:end].abs() @ w_t.abs().t(), torch.float32)
        if start == end:
            assert torch.equal(dw[e], torch.zeros(n, k))
            continue
        gc, xc = values(g_cols[e]), values(x_cols[e])  # g_e.T (N, m), x_e.T (K, m)
        check_close(dw[e], gc @ xc.t(), gc.abs() @ xc.abs().t(), torch.float32)


@pytest.mark.parametrize("recipe_name", ["tensorwise", "delayed"])
def test_the_per_tensor_route_multiplies_the_recipes_operands_as_float64_does(recipe_name):
    """The Triton route of the per-tensor recipes (HYBRID: e5m2 gradients times e4m3 operands; one scale per tensor,
    one per expert's weight) on the operands the recipe casts, each GEMM against float64 math on their values."""
    from fp8_lightning.grouped.gemm import GroupedScaling
    from fp8_lightning.groups import group_bounds
    from fp8_lightning.recipes import recipe_from
    from fp8_lightning.triton_grouped import TritonPerTensorGroupedGemm

    def values(q):
        return q.data.double() * q.inverse_scale().double()

    sizes, k, n = [6, 0, 33, 17, 0], 48, 32
    g = torch.Generator().manual_seed(21)
    x, grad = torch.randn(sum(sizes), k, generator=g), torch.randn(sum(sizes), n, generator=g) * 1e-3
    weight = torch.randn(len(sizes), n, k, generator=g) * torch.arange(1.0, len(sizes) + 1).reshape(-1, 1, 1)
    offs = offsets(sizes)
    recipe, bounds = recipe_from(recipe_name), group_bounds(offs, sum(sizes), len(sizes))
    scaling = GroupedScaling(recipe, len(sizes))
    x_row, x_cols = recipe.grouped_operands("input", x, bounds, E4M3, True, scaling.operands["input"], True)
    g_row, g_cols = recipe.grouped_operands("grad_output", grad, bounds, E5M2, True, scaling.operands["grad_output"],
                                            True)  # fmt: skip
    weights = recipe.grouped_weight_operands(weight, E4M3, scaling.expert_states, True)
    assert g_row.data.dtype == E5M2 and len({w.inverse_scale().item() for w, _ in weights}) > 1  # per expert
    route = TritonPerTensorGroupedGemm()
    y, dx = route.fprop(x_row, weights, offs, torch.float32), route.dgrad(g_row, weights, offs, torch.float32)
    dw = route.wgrad(g_cols, x_cols, torch.float32)
    assert torch.equal(TritonPerTensorGroupedGemm().wgrad(g_cols, x_cols, torch.float32), dw)  # offs from the views
    xv, gv = values(x_row), values(g_row)
    for e, (start, end) in enumerate(bounds):
        w = values(weights[e][0])  # W_e (N, K)
        check_close(y[start:end], xv[start:end] @ w.t(), xv[start:end].abs() @ w.abs().t(), torch.float32)
        check_close(dx[start:end], gv[start:end] @ w, gv[start:end].abs() @ w.abs(), torch.float32)
        gs, xs = gv[start:end], xv[start:end]
        check_close(dw[e], gs.t() @ xs, gs.abs().t() @ xs.abs(), torch.float32)


@pytest.mark.gpu
@requires_cuda_kernels
@pytest.mark.parametrize("storage", ["EKN", "ENK"])
def test_compiled_kernels_on_cuda_match_float64(storage):
    """The compiled kernels on a GPU (autotuned tiles, K a multiple of 128 and not), both shapes, bf16 output."""
    from fp8_lightning.kernels.grouped_gemm import grouped_mm_2d2d, grouped_mm_2d3d

    sizes = SIZES + [300, 0, 129]
    for k in (256, 80):
        experts, n = len(sizes), 192
        a, b = codes((sum(sizes), k), E4M3, 30), codes((experts, k, n), E4M3, 31)
        sa, sb = scales((sum(sizes),), 32), scales((experts, n), 33)
        weight = b if storage == "EKN" else b.transpose(1, 2).contiguous().transpose(1, 2)
        got = grouped_mm_2d3d(a.cuda(), weight.cuda(), sa.cuda(), sb.cuda(), offsets(sizes).cuda(), torch.bfloat16)
        want, bound = reference_2d3d(a, b, sa, sb, sizes)
        check_close(got.cpu(), want, bound, torch.bfloat16, GPU_ACCUMULATION)
    x, y = codes((n, sum(sizes)), E4M3, 34), codes((k, sum(sizes)), E4M3, 35).t()
    sx, sy = scales((experts, n), 36), scales((experts, k), 37)
    got = grouped_mm_2d2d(x.cuda(), y.cuda(), sx.cuda(), sy.cuda(), offsets(sizes).cuda(), torch.bfloat16)
    want, bound = reference_2d2d(x, y, sx, sy, sizes)
    check_close(got.cpu(), want, bound, torch.bfloat16, GPU_ACCUMULATION)


@pytest.mark.parametrize("recipe_name", ["rowwise", "tensorwise"])
def test_fp8_grouped_mm_through_the_triton_route_equals_the_emulation(recipe_name, monkeypatch):
    """``fp8_grouped_mm`` forward + backward with the recipe's grouped GEMMs handed to the Triton route (as on a
    GPU; here in the interpreter) against the same call emulated (float32 GEMMs of the same FP8 operands' values):
    equal up to float32 summation order, empty experts' weight gradients exactly zero."""
    from fp8_lightning import fp8_grouped_mm
    from fp8_lightning.recipes import recipe_from
    from fp8_lightning.triton_grouped import TritonPerTensorGroupedGemm, TritonRowwiseGroupedGemm

    sizes, k, n = [0, 9, 33, 0, 20], 64, 48
    g = torch.Generator().manual_seed(40)
    a, b = torch.randn(sum(sizes), k, generator=g), torch.randn(len(sizes), k, n, generator=g) / 8
    grad = torch.randn(sum(sizes), n, generator=g)

    def run():
        x, w = a.clone().requires_grad_(), b.clone().requires_grad_()
        y = fp8_grouped_mm(x, w, offsets(sizes), recipe=recipe_from(recipe_name))
        y.backward(grad)
        return y.detach(), x.grad, w.grad

    emulated = run()
    route = TritonRowwiseGroupedGemm if recipe_name == "rowwise" else TritonPerTensorGroupedGemm
    monkeypatch.setattr(type(recipe_from(recipe_name)), "grouped_native", lambda self, device, experts: route())
    triton = run()
    for mine, theirs in zip(triton, emulated):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5 * theirs.abs().max().item())
    assert not triton[2][0].any() and not triton[2][3].any()
