"""The grouped casts that cast every expert (or group) at once: the bits of casting each one on its own, and a
number of tensor operations per step that does not grow with the number of experts.

Tensorwise and delayed scaling cast the stacked experts' weights with one scale per expert; blockwise casts them with
each expert padded to whole 128x128 blocks, and every group's wgrad copy from the groups padded to 128-token tiles;
MXFP8's emulated wgrad takes every group's values from one dequantization of its padded layout (NVFP4's batched casts
are held to its per-expert / per-group casts in ``test_nvfp4_grouped_batched.py``).
Each is held against the per-expert / per-group cast of the recipe protocol's default
(:meth:`Recipe.grouped_weight_operands`, :meth:`Recipe.grouped_operands`): codes, scales, the dequantized values the
emulated GEMMs take, and, for the per-tensor recipes, every expert's scaling state over several steps (first use,
delayed scales, an all-zero expert, non-finite values). On CUDA (marked ``gpu``) the per-expert casts run the Triton
cast kernels and the batched ones torch's operations: the same bits there too.

On a GPU each tensor operation is a kernel launch whose host cost does not depend on its size: a step whose casts
loop over the experts pays it once per expert. The operations of a grouped GEMM step (forward, backward, the weight
changed between steps as an optimizer changes it) are counted with a ``TorchDispatchMode`` on CPU (deterministic):
at 4 and at 16 experts, with skewed groups and empty experts, the counts must be equal (a structural check, not a
timing).
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp8_lightning import fp8_grouped_mm
from fp8_lightning.grouped.gemm import GroupedScaling
from fp8_lightning.groups import group_bounds
from fp8_lightning.recipes import recipe_from
from fp8_lightning.recipes.base import Recipe
from tests.conftest import requires_cuda_fp8

E, N, K = 5, 80, 144  # N and K no multiple of 128: blocks cut at the edge
SIZES = [0, 130, 3, 0, 257]  # empty groups, groups of more than one 128-token tile


def _bits(q) -> torch.Tensor:
    return q.data.contiguous().view(torch.uint8)


def _equal(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)  # bit for bit, NaN where NaN


def _same(q1, q2) -> None:
    assert torch.equal(_bits(q1), _bits(q2))
    _equal(q1.scale.float(), q2.scale.float())
    _equal(q1.kind.dequantize(q1, torch.float32), q2.kind.dequantize(q2, torch.float32))


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda_fp8])]


def _weights(device: str, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    w = torch.randn(E, N, K) * torch.logspace(-3, 2, E).view(E, 1, 1)  # experts of very different ranges
    w = w.to(device)
    w[2] = 0.0  # an all-zero expert keeps its previous scale
    return w


def _state(state) -> dict:
    return {} if state is None else state.state_dict()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["tensorwise", "delayed", "blockwise"])
def test_stacked_weight_casts_match_per_expert_casts(name, device):
    recipe = recipe_from(name)
    stacked, single = GroupedScaling(recipe, E), GroupedScaling(recipe, E)
    w = _weights(device)
    for step in range(3):
        if step == 2:
            w[3, 0, 0] = float("nan")  # counted as a non-finite amax, kept out of the history
        ours = recipe.grouped_weight_operands(w, stacked.forward_dtype, stacked.expert_states, True)
        theirs = Recipe.grouped_weight_operands(recipe, w, single.forward_dtype, single.expert_states, True)
        assert len(ours) == len(theirs) == E
        for (w1, t1), (w2, t2) in zip(ours, theirs):
            _same(w1, w2)
            _same(t1, t2)
        if hasattr(ours, "values"):
            _equal(ours.values(), torch.stack([w2.kind.dequantize(w2, torch.float32) for w2, _ in theirs]))
            expected = torch.stack([t2.kind.dequantize(t2, torch.float32).t() for _, t2 in theirs])
            _equal(ours.transposed_values(), expected)
        for s1, s2 in zip(stacked.expert_states, single.expert_states):
            one, other = _state(s1), _state(s2)
            assert one.keys() == other.keys()
            for key, value in one.items():
                if torch.is_tensor(value):
                    _equal(value, other[key])
                else:
                    assert value == other[key], key
        stacked.update()
        single.update()
        w = w * 1.7


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["rowwise", "blockwise"])
def test_grouped_column_copies_match_per_group_casts(name, device):
    recipe = recipe_from(name)
    torch.manual_seed(1)
    x = (torch.randn(sum(SIZES), K) * torch.logspace(-2, 2, K)).to(device)
    offs = torch.cumsum(torch.tensor(SIZES), 0).to(torch.int32).to(device)
    bounds = group_bounds(offs, x.shape[0], E)
    dtype = recipe.fp8_format.forward_dtype
    state = GroupedScaling(recipe, E).operands.get("input")
    ours = recipe.grouped_operands("input", x, bounds, dtype, True, state, True)[1]
    theirs = Recipe.grouped_operands(recipe, "input", x, bounds, dtype, True, state, True)[1]
    for q1, q2, (start, end) in zip(ours, theirs, bounds):
        assert (q1 is None) == (q2 is None) == (start == end)
        if q1 is not None:
            assert torch.equal(q1.kind.dequantize(q1, torch.float32), q2.kind.dequantize(q2, torch.float32))
    parts = [q.kind.dequantize(q, torch.float32) for q in theirs if q is not None]
    assert torch.equal(ours.token_values(), torch.cat(parts, dim=1))


@pytest.mark.parametrize("name", ["tensorwise", "delayed", "rowwise", "blockwise", "mxfp8"])
def test_stacked_weight_values_match_each_experts_operands(name):
    """The emulated GEMMs take every expert's weight values from one dequantization of the stacked casts: the values
    of each expert's W_e and W_e.T operands, dequantized one by one."""
    recipe = recipe_from(name)
    scaling = GroupedScaling(recipe, E)
    w = _weights("cpu")[:, :64, :128]  # MXFP8's 32-blocks fit
    operands = recipe.grouped_weight_operands(w, scaling.forward_dtype, scaling.expert_states, True)
    assert hasattr(operands, "values"), f"{name}: the experts' weights are not cast stacked"
    _equal(operands.values(), torch.stack([q.kind.dequantize(q, torch.float32) for q, _ in operands]))
    expected = torch.stack([q.kind.dequantize(q, torch.float32).t() for _, q in operands])
    _equal(operands.transposed_values(), expected)


# ---------------------------------------------------------------------------------------------------------
# Operations per step
# ---------------------------------------------------------------------------------------------------------

STEP_K, STEP_N = 64, 64  # MXFP8's 32-blocks fit


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _sizes(experts: int) -> list[int]:
    """Expert 0 takes 40 tokens, every fourth from the second none, the rest 1 to 13 (the benchmark's skew)."""
    return [40 if e == 0 else 0 if e % 4 == 1 else 1 + (7 * e) % 13 for e in range(experts)]


def _step_ops(recipe_name: str, experts: int) -> collections.Counter:
    torch.manual_seed(0)
    sizes = _sizes(experts)
    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
    weight = torch.randn(experts, STEP_N, STEP_K).requires_grad_()
    a, grad_y = torch.randn(sum(sizes), STEP_K), torch.randn(sum(sizes), STEP_N)
    a[0, 0] = grad_y[0, 0] = 8.0  # the largest magnitude positive at every size (the CPU amax negates a negative one)
    a.requires_grad_()
    scaling = GroupedScaling(recipe_from(recipe_name), experts)

    def step():
        with torch.no_grad():
            weight.mul_(1.01)  # the optimizer's change: the weight is cast again
        fp8_grouped_mm(a, weight.transpose(1, 2), offs, scaling=scaling).backward(grad_y)

    for _ in range(2):  # past delayed scaling's first, just-in-time casts
        step()
        scaling.update()
    with _Count() as counted:
        step()
    return counted.ops


@pytest.mark.parametrize("recipe_name", ["tensorwise", "delayed", "rowwise", "blockwise", "mxfp8", "nvfp4"])
def test_grouped_step_operations_do_not_grow_with_experts(recipe_name):
    few, many = _step_ops(recipe_name, 4), _step_ops(recipe_name, 16)
    assert sum(few.values()) == sum(many.values()), (
        f"{recipe_name}: {sum(few.values())} operations at 4 experts, {sum(many.values())} at 16; "
        f"grown: {dict(many - few)}"
    )
    assert few["_grouped_mm"] == 3  # fprop, dgrad and wgrad: one grouped GEMM each (emulated on CPU)


def test_the_count_sees_a_per_expert_loop(monkeypatch):
    """The same count tells a per-expert cast apart: NVFP4 with its weights cast expert by expert (the recipe
    protocol's default) grows with the experts."""
    monkeypatch.setattr(type(recipe_from("nvfp4")), "grouped_weight_operands", Recipe.grouped_weight_operands)
    few, many = _step_ops("nvfp4", 4), _step_ops("nvfp4", 16)
    assert sum(many.values()) > sum(few.values())


def test_mx_wgrad_values_match_per_group_casts():
    """MXFP8's emulated wgrad takes every group's values from one dequantization of the padded layout: those of each
    group's own columnwise cast (the recipe protocol's default), cut to the group's tokens."""
    recipe = recipe_from("mxfp8")
    torch.manual_seed(2)
    x = torch.randn(sum(SIZES), 64) * torch.logspace(-2, 2, 64)
    offs = torch.cumsum(torch.tensor(SIZES), 0).to(torch.int32)
    bounds = group_bounds(offs, x.shape[0], E)
    dtype = recipe.fp8_format.forward_dtype
    ours = recipe.grouped_operands("input", x, bounds, dtype, True, None, True)[1]
    theirs = Recipe.grouped_operands(recipe, "input", x, bounds, dtype, True, None, True)[1]
    parts = [q.kind.dequantize(q, torch.float32)[:, : end - start]
             for q, (start, end) in zip(theirs, bounds) if q is not None]  # fmt: skip
    _equal(ours.token_values(), torch.cat(parts, dim=1))
