"""How the core uses the kernels: CUDA only, same bits as its pure-torch code, off by environment variable,
optional at import time, and clear errors on explicit requests that cannot run.

The core's CUDA branch is exercised on CPU by pointing its dispatch hook (``dispatch.cuda_kernels``) at the kernels,
which then run in Triton's interpreter: the results must equal the untouched pure-torch path bit for bit.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp8_lightning.ops import dispatch
from fp8_lightning import FP8Linear, fp8_autocast, sync_scales
from fp8_lightning.ops import triton_ops
from fp8_lightning.kernels import availability
from fp8_lightning.recipes import DelayedScaling, MXFP8BlockScaling, TensorwiseScaling
from fp8_lightning.scaling import OperandScaling
from tests.kernels.references import assert_same_fp8
from tests.environment import set_env

REPO = Path(__file__).resolve().parents[2]
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.fixture
def kernel_calls(monkeypatch):
    """Route the core's CUDA branch to the kernels for CPU tensors; count the kernel calls by name."""
    calls: dict[str, int] = {}

    def counted(name):
        original = getattr(triton_ops, f"triton_{name}")

        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return original(*args, **kwargs)

        return wrapper

    for name in ("amax", "cast", "tensorwise_cast", "tensorwise_operand_cast", "delayed_operand_cast", "mx_quantize"):
        monkeypatch.setattr(triton_ops, f"triton_{name}", counted(name))

    def route(x):
        return triton_ops if triton_ops.supports_input(x) else None

    set_env(monkeypatch, FP8_LIGHTNING_DISABLE_CPU_CODEC="1")  # CUDA tensors never meet the CPU codec

    monkeypatch.setattr(dispatch, "cuda_kernels", route)
    return calls


def pure(fn, *args, **kwargs):
    """Run ``fn`` with the dispatch hook restored to its real (CPU: never the kernels) behaviour."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dispatch, "cuda_kernels", lambda x: None)
        return fn(*args, **kwargs)


def test_quantize_functions_dispatch_and_keep_their_bits(kernel_calls):
    x = torch.randn(64, 96) * 7
    assert dispatch.fast_amax(x).item() == pure(dispatch.fast_amax, x).item()
    scale = torch.tensor(11.0)
    assert_same_fp8(dispatch.fast_quantize_with_scale(x, scale, E5M2), pure(dispatch.fast_quantize_with_scale, x, scale, E5M2))
    data, s = dispatch.fast_quantize_tensorwise(x.bfloat16(), "E4M3")
    ref_data, ref_s = pure(dispatch.fast_quantize_tensorwise, x.bfloat16(), "E4M3")
    assert_same_fp8(data, ref_data)
    assert s.item() == ref_s.item()
    for source in (x.reshape(2, 32, 96), x.t()):  # leading dims, and a transposed view read in place
        data, sc = dispatch.fast_quantize_mxfp8(source, scale_rounding="floor")
        ref_data, ref_sc = pure(dispatch.fast_quantize_mxfp8, source, scale_rounding="floor")
        assert_same_fp8(data, ref_data)
        assert torch.equal(sc.view(torch.uint8), ref_sc.view(torch.uint8)) and sc.shape == ref_sc.shape
    assert kernel_calls == {"amax": 1, "cast": 1, "tensorwise_cast": 1, "mx_quantize": 2}
    # float64 stays on the pure-torch path (the kernels take float32/bf16/fp16).
    dispatch.fast_amax(x.double())
    assert kernel_calls["amax"] == 1


@pytest.mark.parametrize(
    "recipe", [DelayedScaling(amax_history_len=4, margin=1), TensorwiseScaling(), TensorwiseScaling(power_of_2_scales=True)]
)
def test_operand_scaling_uses_the_fused_cast_with_identical_state(kernel_calls, recipe):
    fused, reference = OperandScaling(recipe, E4M3), OperandScaling(recipe, E4M3)
    nan, inf = torch.randn(16, 64), torch.randn(16, 64)
    nan[3, 5], inf[0, 0] = float("nan"), float("inf")
    inputs = [torch.randn(16, 64) * 10.0**step for step in range(3)] + [torch.zeros(16, 64), nan, inf]
    inputs.append(torch.randn(16, 64).clamp(-1, 1).index_fill_(1, torch.tensor([7]), -1.7))  # amax 1.7
    big, big_nan = torch.randn(100, 128), torch.randn(100, 128)  # several programs; the amax in a later one
    big[90, 3], big_nan[0, 1] = 40.0, float("nan")
    inputs += [big, big_nan, big * 0.5]
    for i, x in enumerate(inputs):  # zero and non-finite tensors keep the last scale and are counted; NaN casts
        record = i != 2  # to NaN; one evaluation cast (no amax recorded)
        got, expected = fused.quantize(x, record, transpose=i % 2 == 0), pure(reference.quantize, x, record)
        assert_same_fp8(got.data, expected.data)
        if i % 2 == 0 and (i > 0 or not fused.delayed):  # the transposed copy written by the same pass (not by
            assert_same_fp8(got.cache.transposed, expected.data.t().contiguous())  # delayed scaling's just-in-time cast)
            assert got.t().data.is_contiguous() and got.t().cache.transposed is got.data
        assert torch.equal(got.scale, expected.scale) and torch.equal(got.inverse_scale(), expected.scale.reciprocal())
        for name in OperandScaling._TENSORS:  # (NaN amaxes may differ in their payload bits)
            torch.testing.assert_close(getattr(fused, name), getattr(reference, name), rtol=0, atol=0, equal_nan=True)
        fused.update()
        reference.update()
    # the evaluation cast counts nothing (evaluation leaves the state as training left it)
    assert fused.casts == reference.casts == len(inputs) - 1 and fused.nonfinite_count.item() == 3
    if isinstance(recipe, DelayedScaling):  # the first cast scales just in time (amax pass + cast), later ones
        assert kernel_calls == {"amax": 1, "cast": 1, "delayed_operand_cast": len(inputs) - 1}  # book in the cast
    else:  # two passes, the bookkeeping inside the cast kernel
        assert kernel_calls == {"tensorwise_operand_cast": len(inputs)}


class _Ops(TorchDispatchMode):
    """The tensor operations run inside the block, by name (each is a kernel launch on a GPU)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


VIEWS = {"detach", "t", "view", "transpose", "_unsafe_view", "reshape", "slice", "alias", "_reshape_alias"}


@pytest.mark.parametrize("recipe, op", [(TensorwiseScaling(), "tensorwise_operand_cast"),
                                        (DelayedScaling(), "delayed_operand_cast")])  # fmt: skip
def test_a_cast_on_cuda_is_one_op_with_no_scalar_bookkeeping_around_it(kernel_calls, recipe, op):
    """A scaling state's cast must not add operations around its kernels (they used to run four (delayed) to ten
    (tensorwise): amax cleaning, counting, folding into the pending amax, the scale formula, keeping the last
    scale)."""
    state, x = OperandScaling(recipe, E4M3), torch.randn(16, 64)
    state.quantize(x)  # delayed scaling's first cast is scaled just in time
    state.update()
    with _Ops() as ops:
        state.quantize(x)
    assert [n for n in ops.names if n not in VIEWS] == [op]


@pytest.mark.parametrize("recipe, cast", [(TensorwiseScaling(), "tensorwise_operand_cast"),
                                          (DelayedScaling(), "delayed_operand_cast")])  # fmt: skip
def test_layer_step_on_cuda_runs_only_its_casts_and_gemms(kernel_calls, monkeypatch, recipe, cast):
    """A per-tensor FP8 layer's forward and backward on the CUDA branch (scaled GEMMs): three casts (which also
    write the transposed copies and the inverse scales the backward GEMMs take), three GEMMs, the bias add and its
    gradient; the gradients' accumulation is autograd's."""
    set_env(monkeypatch, FP8_LIGHTNING_GEMM="scaled_mm")  # torch._scaled_mm, as on CUDA
    layer = FP8Linear.from_linear(torch.nn.Linear(64, 32), recipe)
    x = torch.randn(48, 64, requires_grad=True)
    grad_y = torch.randn(48, 32)

    def step():
        with torch.no_grad():
            layer.weight.mul_(1.0)  # a new optimizer step: the weight is cast again
        with fp8_autocast():
            layer(x).backward(grad_y)

    for _ in range(2):  # past delayed scaling's first, just-in-time scaled casts
        step()
        sync_scales(layer)
    with _Ops() as ops:
        step()
    counts = collections.Counter(n for n in ops.names if n not in VIEWS)
    assert counts == {"mul_": 1, cast: 3, "_scaled_mm": 3, "add": 1, "sum": 1, "add_": 3}, counts


@pytest.mark.parametrize("recipe", [DelayedScaling(), TensorwiseScaling(), MXFP8BlockScaling()])
def test_fp8_linear_training_step_is_unchanged_by_the_kernels(kernel_calls, recipe):
    def step():
        torch.manual_seed(0)
        layer = FP8Linear.from_linear(torch.nn.Linear(64, 32), recipe)
        x = torch.randn(40, 64, requires_grad=True)  # 40 rows: MX columnwise copies are padded to 64
        with fp8_autocast():
            layer(x).square().mean().backward()
        return layer.weight.grad, x.grad

    (gw, gx), (ref_gw, ref_gx) = step(), pure(step)
    assert torch.equal(gw, ref_gw) and torch.equal(gx, ref_gx)
    assert sum(kernel_calls.values()) >= 3


def test_core_functions_compile_into_one_graph_with_the_kernels(kernel_calls):
    def casts(x):
        return dispatch.fast_quantize_tensorwise(x), dispatch.fast_quantize_mxfp8(x), dispatch.fast_amax(x)

    x = torch.randn(32, 64)
    torch._dynamo.reset()
    (data, scale), (mx_data, mx_scale), x_amax = torch.compile(casts, backend="aot_eager", fullgraph=True)(x)
    assert kernel_calls["tensorwise_cast"] == kernel_calls["mx_quantize"] == kernel_calls["amax"] == 1
    ref = pure(casts, x)
    assert_same_fp8(data, ref[0][0])
    assert_same_fp8(mx_data, ref[1][0])
    assert scale.item() == ref[0][1].item() and x_amax.item() == ref[2].item()


def test_dispatch_decision_is_a_compile_time_constant(monkeypatch):
    monkeypatch.setattr(availability, "_cuda_usable", lambda index: True)
    set_env(monkeypatch, **{availability.DISABLE_ENV: None})
    torch._dynamo.reset()
    fn = torch.compile(lambda x: x + (1 if availability.cuda_kernels_enabled(0) else 2), backend="aot_eager",
                       fullgraph=True)
    assert fn(torch.zeros(2)).tolist() == [1.0, 1.0]


def test_cpu_tensors_never_reach_the_kernels(monkeypatch):
    assert os.environ.get("TRITON_INTERPRET") == "1"  # even with the kernels runnable on CPU
    assert dispatch.cuda_kernels(torch.randn(4)) is None
    monkeypatch.setattr(triton_ops, "triton_amax", lambda x: pytest.fail("the CPU path called a kernel"))
    dispatch.fast_amax(torch.randn(8))


def test_kernels_usable_honours_device_and_disable_variable(monkeypatch):
    fake_cuda = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    monkeypatch.setattr(availability, "_cuda_usable", lambda index: True)
    set_env(monkeypatch, **{availability.DISABLE_ENV: None})
    assert availability.kernels_usable(fake_cuda)
    set_env(monkeypatch, **{availability.DISABLE_ENV: "1"})
    assert not availability.kernels_usable(fake_cuda)
    set_env(monkeypatch, **{availability.DISABLE_ENV: "0"})
    monkeypatch.setattr(availability, "_cuda_usable", lambda index: False)
    assert not availability.kernels_usable(fake_cuda)


def test_explicit_request_that_cannot_run_names_the_reason(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="run on CUDA devices; got a cpu tensor"):
        triton_ops.triton_amax(torch.randn(4))
    ok, reason = availability.device_status("cpu")
    assert not ok and "TRITON_INTERPRET" in reason


def _run(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=full_env, capture_output=True, text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_library_imports_and_runs_without_triton():
    result = _run(
        """
        import sys

        class NoTriton:
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError("triton is not installed")

        sys.meta_path.insert(0, NoTriton())
        import torch
        import fp8_lightning
        from fp8_lightning.kernels import availability
        from fp8_lightning.ops import triton_ops
        from fp8_lightning.mx import quantize_mxfp8
        from fp8_lightning.quantize import quantize_tensorwise
        quantize_tensorwise(torch.randn(8, 32))
        quantize_mxfp8(torch.randn(8, 32))
        assert not availability.triton_status()[0] and "triton" not in sys.modules
        try:
            triton_ops.triton_amax(torch.randn(4))
        except RuntimeError as err:
            print("ERROR:", err)
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ERROR: fp8_lightning.kernels.per_tensor kernels cannot run: Triton is not importable" in result.stdout


@pytest.mark.slow
def test_interpreter_setting_does_not_leak_to_other_tests(tmp_path):
    """A kernel test followed by a test from another folder, in one session: the latter sees no TRITON_INTERPRET."""
    probe = tmp_path / "test_probe.py"
    probe.write_text("import os\n\ndef test_probe():\n    assert 'TRITON_INTERPRET' not in os.environ\n")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(REPO),
         "tests/kernels/test_per_tensor.py::test_cast_without_amax_reports_zero", str(probe)],
        cwd=REPO, env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0 and "2 passed" in result.stdout, result.stdout[-3000:] + result.stderr[-2000:]


def test_explicit_rounding_is_ignored_on_a_gpu_with_one_warning(monkeypatch):
    from fp8_lightning.kernels import availability

    monkeypatch.setattr(availability, "interpreting", lambda: False)
    availability._warn_explicit_rounding_ignored.cache_clear()
    set_env(monkeypatch, FP8_LIGHTNING_TRITON_EXPLICIT_ROUNDING="1")
    with pytest.warns(UserWarning, match="ignored on a GPU"):
        assert availability.explicit_rounding() is False
    monkeypatch.setattr(availability, "interpreting", lambda: True)
    assert availability.explicit_rounding() is True  # the interpreter needs it
