"""The tensor operations of one grouped GEMM step (forward and backward) do not grow with the number of experts.

On a GPU each tensor operation is a kernel launch whose host cost does not depend on its size: a step whose casts
loop over the experts pays it once per expert. Counted with a ``TorchDispatchMode`` on CPU (deterministic), for the
recipes whose grouped casts are batched: the count of a step at 4 experts must equal the count at 16 (a structural
check, not a timing). Group sizes are skewed and include empty experts; the weight changes between steps as an
optimizer changes it, so it is cast again.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp8_lightning import fp8_grouped_mm
from fp8_lightning.grouped.gemm import GroupedScaling
from fp8_lightning.recipes import recipe_from

K, N = 64, 64  # MXFP8's 32-blocks fit


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
    weight = torch.randn(experts, N, K).requires_grad_()
    a, grad_y = torch.randn(sum(sizes), K), torch.randn(sum(sizes), N)
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


@pytest.mark.parametrize("recipe_name", ["tensorwise", "delayed", "rowwise", "blockwise"])
def test_grouped_step_operations_do_not_grow_with_experts(recipe_name):
    few, many = _step_ops(recipe_name, 4), _step_ops(recipe_name, 16)
    assert sum(few.values()) == sum(many.values()), (
        f"{recipe_name}: {sum(few.values())} operations at 4 experts, {sum(many.values())} at 16; "
        f"grown: {dict(many - few)}"
    )
    assert few["_grouped_mm"] == 3  # fprop, dgrad and wgrad: one grouped GEMM each (emulated on CPU)


def test_the_count_sees_a_per_expert_loop():
    """The same count tells a per-expert cast apart: MXFP8's weights are still cast expert by expert."""
    few, many = _step_ops("mxfp8", 4), _step_ops("mxfp8", 16)
    assert sum(many.values()) > sum(few.values())
