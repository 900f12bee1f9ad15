"""fp8_grouped_mm: every recipe's grouped GEMMs against float64 math on the operands it quantized, its error against
the same recipe on nn.Linear, ragged and empty groups, bad input, and torchao's emulated MXFP8 grouped GEMM."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fp8_lightning import (
    FP8Linear, MXFP8BlockScaling, NVFP4BlockScaling, RowwiseScaling, TensorwiseScaling, fp8_autocast, fp8_grouped_mm,
)
from fp8_lightning.grouped.gemm import GroupedScaling, group_bounds
from tests.conftest import requires_cuda_fp8
from tests.helpers.layers import EVERY_RECIPE

SIZES = [0, 5, 33, 17, 0, 40]  # empty experts, groups that are no multiple of 16 or 32
K, N = 64, 96


def _ids(recipe):
    return type(recipe).__name__


def _inputs(sizes=SIZES, k=K, n=N, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    m = sum(sizes)
    a = (torch.randn(m, k) * torch.logspace(-1, 1, k)).to(dtype)  # columns of different ranges
    b = (torch.randn(len(sizes), k, n) * torch.linspace(0.5, 4, len(sizes)).view(-1, 1, 1)).to(dtype)
    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
    return a, b, offs, torch.randn(m, n).to(dtype)


def _values64(q, width: int) -> torch.Tensor:
    """An operand's values in float64: codes over each element's scale multiplier, padding cut off."""
    return q.data[..., :width].double() / q.kind.scale_multiplier(q, width).double()


def _reference(recipe, a, b, offs, g):
    """(y, da, db) in float64 from the operands the recipe's grouped casts make (fresh state, as a fresh call)."""
    bounds = group_bounds(offs, a.shape[0], b.shape[0])
    s = GroupedScaling(recipe, b.shape[0])
    fwd, bwd = s.forward_dtype, s.backward_dtype
    x, x_cols = recipe.grouped_operands("input", a, bounds, fwd, True, s.operands.get("input"), True)
    w = recipe.grouped_weight_operands(b.transpose(1, 2), fwd, s.expert_states, True)
    gq, g_cols = recipe.grouped_operands("grad_output", g, bounds, bwd, True, s.operands.get("grad_output"), True)
    x64, g64 = _values64(x, a.shape[1]), _values64(gq, b.shape[2])
    y, da, db = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64), torch.zeros_like(x64), torch.zeros_like(b, dtype=torch.float64)
    for e, (start, end) in enumerate(bounds):
        if end == start:
            continue
        y[start:end] = x64[start:end] @ _values64(w[e][0], a.shape[1]).t()
        da[start:end] = g64[start:end] @ _values64(w[e][1], b.shape[2]).t()
        db[e] = (_values64(g_cols[e], end - start) @ _values64(x_cols[e], end - start).t()).t()
    return y, da, db


def _run(recipe, a, b, offs, g, **kwargs):
    a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
    y = fp8_grouped_mm(a, b, offs, recipe=recipe, **kwargs)
    y.backward(g)
    return y, a.grad, b.grad


@pytest.mark.parametrize("recipe", EVERY_RECIPE, ids=_ids)
def test_matches_float64_math_on_its_own_operands(recipe):
    a, b, offs, g = _inputs()
    got = _run(recipe, a, b, offs, g)
    for name, value, ref in zip(("y", "da", "db"), got, _reference(recipe, a, b, offs, g)):
        assert value.dtype == torch.float32 and value.shape == ref.shape, name
        # float32 accumulation of exact products: a few units in the last place of the largest partial sums
        tol = 4 * torch.finfo(torch.float32).eps * ref.abs().amax().item()
        torch.testing.assert_close(value.double(), ref, rtol=0, atol=tol, msg=f"{name} under {_ids(recipe)}")


@pytest.mark.parametrize("recipe", EVERY_RECIPE, ids=_ids)
def test_error_is_that_of_the_recipe_on_nn_linear(recipe):
    """Each expert as an nn.Linear over its own tokens, under the same recipe: the grouped GEMMs' relative error to
    the high-precision product is of the same size (scales shared across experts for per-tensor activations)."""
    a, b, offs, g = _inputs(sizes=[48, 80, 0, 64], seed=1)
    y, da, db = _run(recipe, a, b, offs, g)
    a_hp, b_hp = a.clone().requires_grad_(), b.clone().requires_grad_()
    y_hp = torch._grouped_mm(a_hp, b_hp, offs)
    y_hp.backward(g)
    lin_y, lin_da, lin_db = [], [], torch.zeros_like(b)
    for e, (start, end) in enumerate(group_bounds(offs, a.shape[0], b.shape[0])):
        if end == start:
            continue
        layer = FP8Linear.from_linear(nn.Linear(K, N, bias=False), recipe)
        with torch.no_grad():
            layer.weight.copy_(b[e].t())
        x = a[start:end].clone().requires_grad_()
        with fp8_autocast():
            out = layer(x)
        out.backward(g[start:end])
        lin_y.append(out.detach())
        lin_da.append(x.grad)
        lin_db[e] = layer.weight.grad.t()

    def rel(x, ref):
        return ((x - ref).norm() / ref.norm()).item()

    pairs = {
        "y": (rel(y, y_hp), rel(torch.cat(lin_y), y_hp)),
        "da": (rel(da, a_hp.grad), rel(torch.cat(lin_da), a_hp.grad)),
        "db": (rel(db, b_hp.grad), rel(lin_db, b_hp.grad)),
    }
    for name, (grouped, linear) in pairs.items():
        assert 0 < grouped < 0.1, (name, grouped)
        assert grouped < 1.5 * linear + 1e-3, f"{name}: grouped error {grouped:.4f} vs nn.Linear {linear:.4f}"


@pytest.mark.parametrize("recipe", [*EVERY_RECIPE, NVFP4BlockScaling(disable_stochastic_rounding=True),
                                    NVFP4BlockScaling()], ids=[*map(_ids, EVERY_RECIPE), "nvfp4_rtn", "nvfp4_stochastic"])
def test_empty_experts_get_zero_gradients_and_no_nan(recipe):
    a, b, offs, g = _inputs(sizes=[0, 7, 0, 0, 25, 0])
    y, da, db = _run(recipe, a, b, offs, g)
    assert all(torch.isfinite(t).all() for t in (y, da, db))
    for e in (0, 2, 3, 5):
        assert torch.equal(db[e], torch.zeros_like(db[e]))
    assert db[1].abs().sum() > 0 and db[4].abs().sum() > 0


@pytest.mark.parametrize("recipe", EVERY_RECIPE, ids=_ids)
def test_an_empty_batch_gives_an_empty_output_and_zero_gradients(recipe):
    a, b, offs, _ = _inputs(sizes=[0, 0, 0])
    a, b = a.requires_grad_(), b.requires_grad_()
    y = fp8_grouped_mm(a, b, offs, recipe=recipe)
    assert y.shape == (0, N)
    y.sum().backward()
    assert a.grad.shape == (0, K) and torch.equal(b.grad, torch.zeros_like(b))


def test_output_dtype_and_bf16_inputs():
    a, b, offs, g = _inputs(dtype=torch.bfloat16)
    y, da, db = _run(TensorwiseScaling(), a, b, offs, g, out_dtype=torch.float32)
    assert (y.dtype, da.dtype, db.dtype) == (torch.float32, torch.bfloat16, torch.bfloat16)


def test_mxfp8_matches_torchao_emulated_grouped_gemm():
    """torchao's MXFP8 grouped GEMM (KernelPreference.EMULATED, RCEIL), forward and both gradients, with ragged and
    empty groups: the same bits in bf16."""
    moe = pytest.importorskip("torchao.prototype.moe_training")
    preference = pytest.importorskip("torchao.quantization.quantize_.common.kernel_preference").KernelPreference
    torch.manual_seed(3)
    sizes = [0, 33, 17, 46, 0]
    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
    a = torch.randn(sum(sizes), K, dtype=torch.bfloat16)
    w = torch.randn(len(sizes), N, K, dtype=torch.bfloat16)  # (E, N, K): torchao takes B_t = w.transpose(-2, -1)
    g = torch.randn(sum(sizes), N, dtype=torch.bfloat16)
    results = []
    for run in ("torchao", "ours"):
        x, weight = a.clone().requires_grad_(), w.clone().requires_grad_()
        if run == "torchao":
            y = moe._to_mxfp8_then_scaled_grouped_mm(
                x, weight.transpose(-2, -1), offs, out_dtype=torch.bfloat16, kernel_preference=preference.EMULATED
            )
        else:
            y = fp8_grouped_mm(x, weight.transpose(-2, -1), offs, recipe=MXFP8BlockScaling(), out_dtype=torch.bfloat16)
        y.backward(g)
        results.append((y, x.grad, weight.grad))
    for name, theirs, ours in zip(("y", "da", "dW"), *results):
        assert torch.equal(ours, theirs), name  # the same bits in bf16


@pytest.mark.parametrize(
    "offs, match",
    [
        (torch.tensor([2, 5, 8]), "int32"),
        (torch.tensor([5, 2, 8], dtype=torch.int32), "non-decreasing"),
        (torch.tensor([2, 5, 7], dtype=torch.int32), "ends at 7 but a has 8 rows"),
        (torch.tensor([2, 8], dtype=torch.int32), "one cumulative end per expert"),
        (torch.tensor([2, 5, 8], dtype=torch.int32, device="meta"), "meta device, which holds no values"),
    ],
)
def test_bad_offs_are_refused_with_the_fix(offs, match):
    a, b = torch.randn(8, 32), torch.randn(3, 32, 32)
    with pytest.raises((TypeError, ValueError), match=match):
        fp8_grouped_mm(a, b, offs, recipe="tensorwise")


def test_bad_shapes_are_refused_with_the_fix():
    offs = torch.tensor([4, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="3-D floating-point .E, K, N."):
        fp8_grouped_mm(torch.randn(8, 32), torch.randn(32, 32), offs)
    with pytest.raises(ValueError, match="K=32 must equal b's K=48"):
        fp8_grouped_mm(torch.randn(8, 32), torch.randn(2, 48, 32), offs)
    with pytest.raises(ValueError, match="K=48, N=64 cannot run under MXFP8BlockScaling.*divisible by 32.*Pad"):
        fp8_grouped_mm(torch.randn(8, 48), torch.randn(2, 48, 64), offs, recipe="mxfp8")


@pytest.mark.parametrize("recipe", EVERY_RECIPE, ids=_ids)
def test_backward_twice_and_double_backward(recipe):
    """retain_graph=True: the second backward gives the first one's gradients again (the FP8 copies travel as saved
    tensors; it was a shape error); a third, after a backward that freed them, gets torch's own refusal;
    create_graph=True: no second derivative, said at once (not gradients that silently carry no graph)."""
    a, b, offs, g = _inputs()
    a, b = a.requires_grad_(), b.requires_grad_()
    y = fp8_grouped_mm(a, b, offs, recipe=recipe)
    (y * g).sum().backward(retain_graph=True)
    first = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    (y * g).sum().backward()
    if recipe.name != "nvfp4":  # NVFP4 draws new stochastic-rounding noise for each cast of the gradient
        assert torch.equal(a.grad, first[0]) and torch.equal(b.grad, first[1])
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        (y * g).sum().backward()
    with pytest.raises(RuntimeError, match="fp8_grouped_mm has no second derivative.*create_graph=True"):
        torch.autograd.grad((fp8_grouped_mm(a, b, offs) * g).sum(), a, create_graph=True)


@pytest.mark.parametrize("recipe", EVERY_RECIPE, ids=_ids)
def test_the_input_s_fp8_copies_travel_only_as_saved_tensors(recipe):
    """What backward needs of the tokens goes through save_for_backward, which a backward frees and activation
    checkpointing drops and recomputes: the context keeps a structure without tensors (the weights' operands are
    the step's cached cast)."""
    a, b, offs, _ = _inputs()
    y = fp8_grouped_mm(a.requires_grad_(), b.requires_grad_(), offs, recipe=recipe)
    node = y.grad_fn
    while type(node).__name__ != "FP8GroupedMMFunctionBackward":
        node = node.next_functions[0][0]
    found = []

    def walk(obj):
        if torch.is_tensor(obj):
            found.append(obj)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item)
        elif hasattr(obj, "__dict__") and not isinstance(obj, str):
            for value in vars(obj).values():
                walk(value)

    walk(node.saved[0])
    assert not found and len(node.saved_tensors) > 0


def test_saved_structures_keep_their_attributes_and_modules():
    """The structure saved for backward comes back whole: a list subclass's own attributes (GroupBounds.offs, a
    tensor) return, a module is kept as it is (its parameters are not saved tensors)."""
    from fp8_lightning.grouped.gemm import _fill, _hollow
    from fp8_lightning.groups import GroupBounds

    offs = torch.tensor([2, 5], dtype=torch.int32)
    module = nn.Linear(2, 2)
    tensors = []
    hollow = _hollow({"bounds": GroupBounds([(0, 2), (2, 5)], offs), "module": module}, tensors)
    assert len(tensors) == 1 and not torch.is_tensor(hollow["bounds"].offs)
    back = _fill(hollow, tuple(tensors))
    assert list(back["bounds"]) == [(0, 2), (2, 5)] and back["bounds"].offs is offs and back["module"] is module


def test_a_non_floating_output_dtype_is_refused():
    a, b, offs, _ = _inputs()
    for dtype in (torch.int32, torch.float8_e4m3fn):
        with pytest.raises(ValueError, match=f"out_dtype={dtype} is not allowed; allowed: torch.float32"):
            fp8_grouped_mm(a, b, offs, out_dtype=dtype)


@pytest.mark.parametrize("recipe", EVERY_RECIPE + [RowwiseScaling(high_precision_wgrad=True)], ids=_ids)
def test_a_recipe_s_stacked_weight_cast_has_the_bits_of_casting_each_expert(recipe):
    """Recipes that cast all experts' weights at once (MXFP8, rowwise) make the operands of casting each expert on
    its own (the protocol's default)."""
    from fp8_lightning.recipes import Recipe

    torch.manual_seed(4)
    weight = torch.randn(5, 96, 64) * torch.logspace(-2, 2, 5).view(-1, 1, 1)  # (E, N, K), experts of other ranges
    fwd = GroupedScaling(recipe, 5).forward_dtype
    stacked = recipe.grouped_weight_operands(weight, fwd, GroupedScaling(recipe, 5).expert_states, True)
    single = Recipe.grouped_weight_operands(recipe, weight, fwd, GroupedScaling(recipe, 5).expert_states, True)
    for e, ((row, col), (row_1, col_1)) in enumerate(zip(stacked, single)):
        assert torch.equal(_values64(row, 64), _values64(row_1, 64)), e
        assert torch.equal(_values64(col, 96), _values64(col_1, 96)), e



@pytest.mark.gpu
@requires_cuda_fp8
@pytest.mark.parametrize("recipe", EVERY_RECIPE, ids=_ids)
def test_on_cuda_the_grouped_gemms_match_the_cpu_run(recipe, monkeypatch):
    """On a GPU the grouped GEMMs run emulated on the CUDA casts, with one warning: the output and both gradients
    match the CPU run within float32 rounding of the products."""
    from fp8_lightning.grouped import gemm

    if recipe.grouped_native(torch.device("cuda"), len(SIZES)) is not None:
        pytest.skip("the native grouped kernel serves this recipe here (tests/core/test_grouped_native.py checks it)")
    monkeypatch.setattr(gemm, "_WARNED", set())
    a, b, offs, g = _inputs()
    cpu = _run(recipe, a, b, offs, g)
    with pytest.warns(UserWarning, match="no FP8 grouped GEMM kernel|grouped kernel cannot run"):
        cuda = _run(recipe, a.cuda(), b.cuda(), offs.cuda(), g.cuda())
    for name, here, there in zip(("y", "da", "db"), cpu, cuda):
        torch.testing.assert_close(there.cpu(), here, rtol=1e-4, atol=1e-4 * here.abs().amax().item(), msg=name)
