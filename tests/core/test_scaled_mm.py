"""The per-tensor GEMM as cuBLAS gets it: ``torch._scaled_mm`` with the bias in its epilogue, fast accumulation per
GEMM, and layouts that pass torch's CUDA checks, eager and traced.

There is no GPU here, so every ``_scaled_mm`` call of a layer step runs on CPU (``FP8_LIGHTNING_GEMM=scaled_mm``,
with the transposed copies written contiguous as the CUDA cast kernels write them) and is recorded; each recorded
call is then replayed on fake CUDA tensors of the same shapes, strides and dtypes, where torch's meta
implementation applies the CUDA rules (row-major ``a``, column-major ``b``, dimensions divisible by 16, bias and
output dtypes).
"""

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from fp8_lightning import DelayedScaling, FP8Linear, MXFP8BlockScaling, TensorwiseScaling, fp8_autocast
from fp8_lightning.gemm import scaled_mm
from fp8_lightning.traced import make_plan, traced_linear
from tests.environment import set_env

SCALED_MM = torch.ops.aten._scaled_mm.default
RECIPES = [TensorwiseScaling(), DelayedScaling()]


class RecordScaledMM(TorchDispatchMode):
    """Runs every op and records each ``aten._scaled_mm`` call's tensor layouts and options."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is SCALED_MM:  # every argument by its schema name, defaults included
            named = {a.name: a.default_value for a in func._schema.arguments if a.has_default_value()}
            named.update(zip([a.name for a in func._schema.arguments], args), **kwargs)
            self.calls.append(named)
        return func(*args, **kwargs)


def _on_fake_cuda(t):
    """A fake CUDA tensor of ``t``'s shape, strides and dtype (other arguments as they are); inside FakeTensorMode."""
    if not torch.is_tensor(t):
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")


def replay_on_fake_cuda(calls) -> list[torch.Size]:
    """Each recorded call again on fake CUDA tensors (torch's CUDA checks raise on a layout cuBLAS refuses)."""
    shapes = []
    with FakeTensorMode():
        for named in calls:
            out = SCALED_MM(**{k: _on_fake_cuda(v) for k, v in named.items()})
            assert out.device.type == "cuda"
            shapes.append(out.shape)
    return shapes


def _small_integers(rows: int, cols: int) -> torch.Tensor:
    """FP8 operands whose products and sums are exact in float32 (so the only rounding is the output's)."""
    return torch.randint(-8, 9, (rows, cols)).float().to(torch.float8_e4m3fn)


def test_the_bias_is_rounded_once_with_the_product_in_bf16():
    a, b = _small_integers(12, 32), _small_integers(24, 32)
    inv_a, inv_b = torch.tensor(0.25), torch.tensor(2.0 ** -7)  # powers of two: exact
    bias = torch.randn(24) * 3
    exact = (a.double() @ b.double().t()) * (0.25 * 2.0 ** -7) + bias.bfloat16().double()
    with RecordScaledMM() as record:
        out = scaled_mm(a, inv_a, b, inv_b, torch.bfloat16, bias)
    assert out.dtype == torch.bfloat16 and torch.equal(out, exact.bfloat16())
    assert record.calls[0]["bias"] is not None  # in the epilogue, not added after
    out32 = scaled_mm(a, inv_a, b, inv_b, torch.float32, bias)  # _scaled_mm refuses a bias with float32 output
    assert torch.equal(out32, ((a.double() @ b.double().t()) * (0.25 * 2.0 ** -7)).float() + bias)


def test_ragged_shapes_are_padded_to_what_cublas_takes():
    a, b = _small_integers(10, 40), _small_integers(24, 40)  # K = 40 and N = 24 are not multiples of 16
    with RecordScaledMM() as record:
        out = scaled_mm(a, torch.tensor(1.0), b, torch.tensor(1.0), torch.bfloat16, torch.zeros(24))
    assert out.shape == (10, 24) and torch.equal(out, (a.double() @ b.double().t()).bfloat16())
    assert replay_on_fake_cuda(record.calls) == [torch.Size([10, 32])]  # N padded to 32, cut after


def _layer_step(recipe, traced: bool, dtype=torch.bfloat16):
    """One forward and backward of a layer (K=48, N=32) on M=10 tokens, which wgrad reduces over (padded to 16),
    with every _scaled_mm call recorded."""
    torch.manual_seed(0)
    layer = FP8Linear.from_linear(torch.nn.Linear(48, 32), recipe)
    x = torch.randn(10, 48, requires_grad=True)
    with RecordScaledMM() as record:
        if traced:
            plan = make_plan(recipe, torch.device("cpu"), dtype, False)._replace(transpose=True)  # as on CUDA
            y = traced_linear(x, layer.weight, layer.bias, plan, layer.fp8_scaling(recipe).operands, True)
        else:
            with fp8_autocast(), torch.autocast("cpu", dtype=dtype):
                y = layer(x)
        y.float().square().sum().backward()
    return record.calls, (y, x.grad, layer.weight.grad, layer.bias.grad)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_a_layer_step_gives_cublas_three_valid_gemms_with_fast_accumulation_in_fprop_only(recipe, traced, monkeypatch):
    set_env(monkeypatch, FP8_LIGHTNING_GEMM="scaled_mm")
    calls, _ = _layer_step(recipe, traced)
    assert len(calls) == 3  # fprop, dgrad, wgrad
    assert [call["use_fast_accum"] for call in calls] == [True, False, False]
    assert calls[0]["bias"] is not None and calls[0]["bias"].dtype == torch.bfloat16
    assert replay_on_fake_cuda(calls) == [torch.Size([10, 32]), torch.Size([10, 48]), torch.Size([32, 48])]


def test_fast_accumulation_follows_the_recipe(monkeypatch):
    set_env(monkeypatch, FP8_LIGHTNING_GEMM="scaled_mm")
    calls, _ = _layer_step(TensorwiseScaling(fprop_fast_accum=False, grad_fast_accum=True), traced=False)
    assert [call["use_fast_accum"] for call in calls] == [False, True, True]
    with pytest.raises(ValueError, match="grad_fast_accum='yes' is invalid; allowed: True or False"):
        TensorwiseScaling(grad_fast_accum="yes")


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_the_traced_step_computes_the_eager_steps_bits(recipe, monkeypatch):
    set_env(monkeypatch, FP8_LIGHTNING_GEMM="scaled_mm")
    _, eager = _layer_step(recipe, traced=False)
    _, traced = _layer_step(recipe, traced=True)
    for got, want in zip(traced, eager):
        assert torch.equal(got, want)


def test_compiled_graphs_hold_scaled_mm_itself(monkeypatch):
    """Under torch.compile the per-tensor GEMMs are aten._scaled_mm nodes (no custom op around them): one in the
    forward graph, two in the backward graph."""
    set_env(monkeypatch, FP8_LIGHTNING_GEMM="scaled_mm")
    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            return make_boxed_func(gm.forward)

        return compiler

    torch._dynamo.reset()
    layer = FP8Linear.from_linear(torch.nn.Linear(64, 32), TensorwiseScaling())
    compiled = torch.compile(layer, backend=aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw")),
                             fullgraph=True)
    with fp8_autocast():
        compiled(torch.randn(16, 64, requires_grad=True)).sum().backward()

    def ops(name):
        return [str(n.target) for n in graphs[name].graph.nodes if n.op == "call_function"]

    assert ops("fw").count("aten._scaled_mm.default") == 1 and ops("bw").count("aten._scaled_mm.default") == 2
    assert not any("fp8_lightning.scaled_gemm" in op for op in ops("fw") + ops("bw"))


def test_the_traced_plan_and_the_eager_gemm_agree_on_when_scaled_mm_runs(monkeypatch):
    """A GPU without FP8 GEMMs (emulation asked for) multiplies in the emulation in both paths, never _scaled_mm."""
    from fp8_lightning import gemm

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(gemm, "fp8_gemm_support", lambda device: (torch.device(device).type == "cuda", "stood in"))
    assert make_plan(TensorwiseScaling(), cuda, torch.bfloat16, False).scaled_mm
    assert not make_plan(TensorwiseScaling(), cuda, torch.bfloat16, True).scaled_mm
    monkeypatch.setattr(gemm, "fp8_gemm_support", lambda device: (False, "compute capability 8.0"))
    assert not make_plan(TensorwiseScaling(), cuda, torch.bfloat16, False).scaled_mm
    assert not gemm.per_tensor_scaled_mm(cuda) and not gemm.per_tensor_scaled_mm("cpu")
    set_env(monkeypatch, FP8_LIGHTNING_GEMM="scaled_mm")
    assert make_plan(TensorwiseScaling(), torch.device("cpu"), torch.bfloat16, False).scaled_mm
    assert not make_plan(MXFP8BlockScaling(), torch.device("cpu"), torch.bfloat16, False).scaled_mm
