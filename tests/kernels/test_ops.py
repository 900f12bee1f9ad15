"""The kernels as torch.library custom ops: fake implementations agree with the real ones, and torch.compile
traces calls to them without graph breaks (the real kernels run in the interpreter underneath)."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

from fp8_lightning.ops import triton_ops
from fp8_lightning.ops.registry import EAGER
from fp8_lightning.mx import quantize_mx_operand
from tests.kernels.references import assert_same_fp8

OPS = torch.ops.fp8_lightning
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# Schema, fake tensor and dispatch checks; the autograd checks do not apply to ops without gradients.
CHECKS = ("test_schema", "test_faketensor", "test_aot_dispatch_static")


def _cases():
    x = torch.randn(40, 64)
    a = quantize_mx_operand(torch.randn(16, 64), 32, "rceil", E4M3)
    b = quantize_mx_operand(torch.randn(24, 64), 32, "rceil", E5M2)
    return [
        (OPS.amax, (x,)),
        (OPS.cast, (x, torch.tensor(3.0), E4M3, True)),
        (OPS.cast_transpose, (x, torch.tensor(3.0), E5M2, True)),
        (OPS.tensorwise_cast, (x.bfloat16(), E4M3, 1e-12, False)),
        (OPS.tensorwise_operand_cast, (x, torch.tensor(3.0), torch.tensor(4), E5M2, 1e-12, True, False)),
        (OPS.tensorwise_operand_cast, (x, torch.tensor(3.0), torch.tensor(4), E4M3, 1e-12, False, True)),
        (OPS.delayed_operand_cast, (x.half(), torch.tensor(3.0), torch.tensor(2.5), torch.tensor(4), E4M3, True, False)),
        (OPS.delayed_operand_cast, (x[:, :40], torch.tensor(3.0), torch.tensor(2.5), torch.tensor(4), E5M2, False, True)),
        (OPS.mx_quantize, (x[:, :40], 32, "floor", E4M3, True, True)),  # ragged: padded outputs
        (OPS.mx_quantize, (x, 32, "rceil", E5M2, False, True)),
        (OPS.mx_gemm, (a.data, a.scale.view(torch.uint8), b.data, b.scale.view(torch.uint8), torch.bfloat16)),
        (OPS.fine_cast, (x[:, :40], E4M3, 1, 0, True, 1e-12, False)),  # rowwise: (40, 1) scales
        (OPS.fine_cast, (x.t(), E5M2, 128, 1, False, 0.0, False)),  # 128x1 of a strided view: column-major scales
        (OPS.fine_cast, (x, E4M3, 128, 128, True, 0.0, True)),  # 128x128 and W.T: padded rows of scales
    ]


@pytest.mark.parametrize("case", range(14))
def test_fake_implementations_match_the_kernels(case):
    op, args = _cases()[case]
    # The schema checker multiplies inputs to detect mutation, which float8 inputs (the GEMM's) do not support.
    checks = CHECKS[1:] if op is OPS.mx_gemm else CHECKS
    opcheck(op, args, test_utils=checks)


def test_torch_compile_traces_the_ops_in_one_graph():
    def delayed_then_mx(x, scale, w):
        data, x_amax = triton_ops.triton_cast(x, scale, E4M3)
        rows, cols = triton_ops.triton_mx_quantize(x, 32, "rceil", E4M3, columnwise=True)
        out = triton_ops.triton_mx_gemm(rows, w, torch.float32)
        return data, x_amax, rows.data, cols.scale, out

    x, scale = torch.randn(32, 64), torch.tensor(5.0)
    w = quantize_mx_operand(torch.randn(16, 64), 32, "rceil", E4M3)
    torch._dynamo.reset()
    compiled = torch.compile(delayed_then_mx, backend="aot_eager", fullgraph=True)  # fullgraph: no graph breaks
    for got, expected in zip(compiled(x, scale, w), delayed_then_mx(x, scale, w)):
        if got.dtype in (E4M3, E5M2):
            assert_same_fp8(got, expected)
        elif got.dtype == torch.float8_e8m0fnu:
            assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
        else:
            assert torch.equal(got, expected)


class _SeenOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_eager_calls_skip_the_op_dispatch_where_nothing_needs_to_see_it(monkeypatch):
    """Eager calls on plain tensors run the implementation directly (a custom op's dispatch costs more host time
    than a launch); under a dispatch mode (fake tensors, counters) and for tensor subclasses they go through the
    op, with the same result."""
    direct = []
    implementation = EAGER.amax
    monkeypatch.setattr(EAGER, "amax", lambda x: direct.append(x) or implementation(x))
    x = torch.randn(40, 64)
    plain = triton_ops.triton_amax(x)
    assert len(direct) == 1 and plain.item() == x.abs().max().item()
    with _SeenOps() as seen:
        watched = triton_ops.triton_amax(x)
    assert len(direct) == 1 and "fp8_lightning.amax" in seen.names and watched.item() == plain.item()
    parameter = torch.nn.Parameter(x.clone(), requires_grad=False)  # a subclass: the op's dispatch serves it
    assert triton_ops.triton_amax(parameter).item() == plain.item() and len(direct) == 1
