"""``torch.compile(experts, fullgraph=True)`` with every recipe: one graph, never recompiled, the eager bits.

The FP8 experts trace into the graph (:mod:`fp8_lightning.grouped.traced`): the groups enter it as the device tensor
``offs``, never read by the graph on the host, so a step whose tokens are routed differently runs the same graph.
The counters prove one frame is compiled for ``STEPS`` training steps whose routing changes every step (an empty
expert, a full one), with no graph break, and the losses, the input and weight gradients and the scaling state
(delayed scaling's amax histories and scales) equal an eager run bit for bit under ``aot_eager`` (the same ops);
inductor compiles one graph too. NVFP4 cannot be traced and ``fullgraph=True`` says why.
"""

import re

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from fp8_lightning import (
    BlockwiseScaling,
    DelayedScaling,
    MXFP8BlockScaling,
    RowwiseScaling,
    TensorwiseScaling,
    convert_to_fp8,
    fp8_autocast,
    sync_scales,
)
from fp8_lightning.grouped import experts as experts_module
from fp8_lightning.grouped.experts import GroupedExperts
from tests.conftest import requires_cuda_fp8

RECIPES = [
    DelayedScaling(), TensorwiseScaling(), MXFP8BlockScaling(), RowwiseScaling(),
    RowwiseScaling(high_precision_wgrad=True), BlockwiseScaling(),
]
STEPS = 4
# torch < 2.12 runs the FP8 experts eagerly between graphs (experts_module._TRACE_REFUSED); fullgraph=True then refuses
# with that reason (test_before_torch_2_12_experts_refuse_fullgraph_and_run_eagerly_between_graphs)
traced_experts = pytest.mark.skipif(experts_module._TRACE_REFUSED is not None, reason=str(experts_module._TRACE_REFUSED))
ROUTES = [(3, 3, 10, 24), (0, 8, 8, 24), (24, 24, 24, 24), (5, 12, 20, 24)]  # cumulative ends of 4 experts' groups


def _id(recipe) -> str:
    return recipe.name + ("_hp_wgrad" if getattr(recipe, "high_precision_wgrad", False) else "")


def _state(module) -> list[torch.Tensor]:
    out = []
    for _, scaling in module.fp8_scalings():
        for operand in scaling.operands.values():
            out += [v for v in operand.state_dict().values() if torch.is_tensor(v)]
    return out


def _train(recipe, backend: str | None, device: str = "cpu"):
    """Losses, gradients of the inputs and weights, compiled frames after each step, graph breaks, final state."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    experts = GroupedExperts(dim=32, hidden_dim=64, num_experts=4).to(device)
    convert_to_fp8(experts, recipe, profitability=False)  # FP8 numerics even where the gate would keep bf16
    optimizer = torch.optim.SGD(experts.parameters(), lr=0.1)
    counter = CompileCounterWithBackend(backend) if backend else None
    forward = torch.compile(experts, backend=counter, fullgraph=True) if counter else experts
    g = torch.Generator().manual_seed(1)
    losses, grads, frames = [], [], []
    for step in range(STEPS):
        x = torch.randn(24, 32, generator=g).to(device).requires_grad_()
        with fp8_autocast():
            y = forward(x, torch.tensor(ROUTES[step], dtype=torch.int32, device=device))
        loss = (y.float() ** 2).mean()
        loss.backward()
        losses.append(loss.item())
        grads += [x.grad.clone()] + [p.grad.clone() for p in experts.parameters()]
        optimizer.step()
        optimizer.zero_grad()
        sync_scales(experts)
        frames.append(counter.frame_count if counter else 0)
    return losses, grads, frames, sum(counters["graph_break"].values()), _state(experts)


@traced_experts
@pytest.mark.parametrize("recipe", RECIPES, ids=_id)
def test_fullgraph_compiles_one_graph_once_and_matches_eager_bit_for_bit(recipe):
    eager_losses, eager_grads, _, _, eager_state = _train(recipe, backend=None)
    losses, grads, frames, breaks, state = _train(recipe, backend="aot_eager")
    assert frames == [1] * STEPS, f"compiled frames after each step: {frames}"
    assert breaks == 0
    assert losses == eager_losses
    assert all(torch.equal(a, b) for a, b in zip(grads, eager_grads))
    assert len(state) == len(eager_state) and all(torch.equal(a, b) for a, b in zip(state, eager_state))
    assert losses[-1] < losses[0]


@traced_experts
@pytest.mark.parametrize("recipe", [TensorwiseScaling(), MXFP8BlockScaling()], ids=_id)
def test_inductor_compiles_once_and_stays_close_to_eager(recipe):
    """Inductor may fuse the code around the ops differently from eager (measured: equal losses on this CPU)."""
    eager_losses, *_ = _train(recipe, backend=None)
    losses, _, frames, breaks, _ = _train(recipe, backend="inductor")
    assert frames == [1] * STEPS and breaks == 0, (frames, breaks)
    assert losses == pytest.approx(eager_losses, rel=1e-3)


@pytest.mark.gpu
@requires_cuda_fp8
@pytest.mark.parametrize("recipe", RECIPES, ids=_id)
@pytest.mark.filterwarnings("ignore:fp8_grouped_mm on cuda")
def test_on_cuda_fullgraph_compiles_one_graph_with_the_eager_bits(recipe):
    """On a GPU the custom ops read the group bounds inside (CUDA's grouped GEMM takes bf16 only); the graph is
    still one, and the step computes what the eager (emulated) step does."""
    if recipe.grouped_native(torch.device("cuda"), 4) is not None:
        pytest.skip("a native grouped kernel serves this recipe here: the compiled step emulates it instead")
    if experts_module._TRACE_REFUSED is not None:
        pytest.skip(experts_module._TRACE_REFUSED)
    eager_losses, eager_grads, _, _, eager_state = _train(recipe, backend=None, device="cuda")
    losses, grads, frames, breaks, state = _train(recipe, backend="aot_eager", device="cuda")
    assert frames == [1] * STEPS and breaks == 0
    assert losses == eager_losses
    assert all(torch.equal(a, b) for a, b in zip(grads, eager_grads))
    assert all(torch.equal(a, b) for a, b in zip(state, eager_state))


@pytest.mark.parametrize("route", ROUTES + [(0, 0, 0, 24), (1, 2, 3, 24)])
def test_padded_rows_places_each_group_on_whole_blocks(route):
    """The device-side layout of the traced MX and blockwise wgrad casts, against a host loop over the groups."""
    from fp8_lightning.groups import padded_rows

    index, length = padded_rows(torch.tensor(route, dtype=torch.int32), 24, 8)
    expected, start, out = [], 0, 0
    for end in route:
        expected += list(range(out, out + end - start))
        out += max(-(-(end - start) // 8), 1) * 8  # whole blocks; an empty group takes one
        start = end
    assert index.tolist() == expected and length == 24 + 4 * 8 >= out


@traced_experts
@pytest.mark.parametrize("recipe", [RowwiseScaling(), MXFP8BlockScaling()], ids=_id)
def test_a_recipe_without_device_side_columns_runs_the_eager_casts_in_one_op(recipe, monkeypatch):
    """``Recipe.traced_grouped_columns`` returning None (a recipe defined elsewhere): the per-group casts run inside
    ``grouped_column_values``, still one graph with the eager bits."""
    monkeypatch.setattr(type(recipe), "traced_grouped_columns", lambda self, x, offs, dtype, role: None)
    eager_losses, eager_grads, *_ = _train(recipe, backend=None)
    losses, grads, frames, breaks, _ = _train(recipe, backend="aot_eager")
    assert frames == [1] * STEPS and breaks == 0
    assert losses == eager_losses and all(torch.equal(a, b) for a, b in zip(grads, eager_grads))


@traced_experts
def test_compiled_experts_still_pickle():
    import io

    experts = GroupedExperts(dim=32, hidden_dim=64, num_experts=4)
    convert_to_fp8(experts, DelayedScaling())
    torch._dynamo.reset()
    with fp8_autocast():
        torch.compile(experts, backend="aot_eager", fullgraph=True)(torch.randn(24, 32), torch.tensor(ROUTES[0]).int())
    buffer = io.BytesIO()
    torch.save(experts, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(loaded.w1, experts.w1) and type(loaded) is type(experts)


@traced_experts
def test_delayed_state_moves_in_the_compiled_step():
    *_, first = _train(DelayedScaling(amax_history_len=4), backend="aot_eager")
    histories = [t for t in first if t.shape == (4,)]
    assert histories and all((h[:STEPS - 1] > 0).all() for h in histories)


@traced_experts
@pytest.mark.parametrize("recipe", [TensorwiseScaling(), MXFP8BlockScaling()], ids=_id)
def test_transformers_experts_compile_into_one_graph(recipe):
    """transformers' fused experts (routing, biases-free Qwen3-MoE) called as the decoder layer calls them."""
    pytest.importorskip("transformers", reason="needs transformers (dev extras)")
    from tests.helpers.moe import tiny_moe

    outputs = []
    for backend in (None, "aot_eager"):
        torch._dynamo.reset()
        counters.clear()
        model = tiny_moe("qwen3_moe")
        convert_to_fp8(model, recipe)
        experts = model.model.layers[0].mlp.experts
        counter = CompileCounterWithBackend(backend) if backend else None
        run = torch.compile(experts, backend=counter, fullgraph=True) if counter else experts
        g = torch.Generator().manual_seed(3)
        x = torch.randn(20, 64, generator=g, requires_grad=True)
        index, weights = torch.randint(0, 8, (20, 2), generator=g), torch.rand(20, 2, generator=g)
        with fp8_autocast():
            y = run(x, index, weights)
        y.square().sum().backward()
        outputs.append((y.detach(), x.grad, experts.down_proj.grad))
        if counter:
            assert counter.frame_count == 1 and sum(counters["graph_break"].values()) == 0
    assert all(torch.equal(a, b) for a, b in zip(*outputs))


def _refused_fullgraph(recipe, reason: str):
    """Converted experts whose fullgraph compile stops with ``reason``; returns (experts, x, offs) for further use."""
    experts = GroupedExperts(dim=32, hidden_dim=64, num_experts=4)
    convert_to_fp8(experts, recipe)
    torch._dynamo.reset()
    x, offs = torch.randn(24, 32), torch.tensor(ROUTES[0], dtype=torch.int32)
    with pytest.raises(Exception, match=reason):
        with fp8_autocast():
            torch.compile(experts, backend="aot_eager", fullgraph=True)(x, offs)
    return experts, x, offs


def test_before_torch_2_12_experts_refuse_fullgraph_and_run_eagerly_between_graphs(monkeypatch):
    """Where the traced expert step is refused (torch < 2.12), fullgraph=True says why, and a plain compile runs the
    experts eagerly between graphs with the eager bits."""
    monkeypatch.setattr(experts_module, "_TRACE_REFUSED", "torch 2.11: refused for this test")
    experts_module.fp8_grouped_island(experts_module._TRACE_REFUSED)  # as the module makes its own at import
    experts, x, offs = _refused_fullgraph(TensorwiseScaling(), "torch 2.11: refused for this test")
    torch._dynamo.reset()
    with fp8_autocast():
        eager = experts(x, offs)
        compiled = torch.compile(experts, backend="aot_eager")(x, offs)
    assert torch.equal(compiled, eager)


def test_nvfp4_experts_refuse_fullgraph_with_the_reason():
    from fp8_lightning.recipes import NVFP4BlockScaling

    reason = experts_module._TRACE_REFUSED or "NVFP4 experts: each group's weight-gradient cast draws"
    _refused_fullgraph(NVFP4BlockScaling(), re.escape(reason))
