"""Every GEMM an :class:`~fp8_lightning.linear.FP8Linear` step issues, recorded on fake CUDA tensors under a simulated
device, with no GPU.

How: the layer runs its real code (eager, or the traced step that ``torch.compile`` captures) inside torch's
``FakeTensorMode`` with ``device="cuda"`` tensors (shapes, strides and dtypes, no memory), while the device queries
the library asks (``torch.cuda.is_available``, ``get_device_capability``, ``torch.version.cuda``, whether torch has
``torch.nn.functional.scaled_mm``, whether the Triton kernels run) answer for the simulated device. The torch entry
points and the Triton MX GEMM are wrapped so that each call's operands are recorded before torch's own meta function
checks them; a GEMM that calls none of them was emulated (or computed in high precision).

The traced step runs as ``torch.compile`` traces it (``torch.compiler.is_compiling()`` answers True), its GEMM op
expanded to the implementation the compiled graph calls at run time, on the layouts its cast ops declare.

Fake-tensor gaps of a torch built without CUDA are bridged while a simulation runs: ``Tensor.to(device)``,
``Tensor.contiguous()``, ``Tensor.copy_``, ``torch.tensor(..., device=)`` and basic indexing of a fake CUDA tensor
(their Python bindings take a CUDA device guard, which such a build lacks) take the equivalent dispatcher ops, and
the autograd engine (whose graph nodes also ask for one) is left out: the layer's autograd Function's forward and
backward are called directly. Per-tensor scaling states are simulated after their first step (initialized), since a
first cast reads its amax on the host, which a fake tensor cannot give. The library's per-device constant caches are
restored after each run, so no fake tensor outlives it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Iterator
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from fp8_lightning import blockwise, gemm, mx, traced
from fp8_lightning.autocast import fp8_autocast
from fp8_lightning.kernels import availability
from fp8_lightning.layer_step import FP8LinearFunction
from fp8_lightning.linear import EagerStep, FP8Linear
from fp8_lightning.ops import dispatch
from fp8_lightning.ops.registry import HOT_OPS
from fp8_lightning.traced import TracedPlan

from fp8_lightning.cuda_contract.rules import Facts, Target

GEMM_ROLES = ("fprop", "dgrad", "wgrad")
MODES = ("eager", "traced")
V1_API, V2_API, TRITON_API = "torch._scaled_mm", "torch.nn.functional.scaled_mm", "triton mx_gemm"


@dataclasses.dataclass
class Call:
    """One call of a GEMM entry point: its name and its arguments (tensors as :class:`Facts`), and the error
    torch's meta function raised on them, if any."""

    api: str
    args: dict
    meta_error: str | None = None


@dataclasses.dataclass
class GemmRecord:
    """One of the layer's GEMMs: its role, the step that issued it, ``a @ b.T`` shapes and the calls it made."""

    role: str
    mode: str
    a: Facts
    b: Facts
    out_dtype: torch.dtype
    calls: list[Call] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)


class _Context:
    """What the layer's autograd Function reads and writes of its ``ctx``."""

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors


class _Recorder:
    def __init__(self, mode: str):
        self.mode, self.gemms, self.steps = mode, [], []

    def apply(self, x2d, weight, bias, step, *tensors):
        """``FP8LinearFunction.apply`` without the autograd engine (which a torch built without CUDA cannot run on
        fake CUDA tensors): its forward now, its backward kept for :meth:`backward`."""
        ctx = _Context()
        ctx.needs_input_grad = (True, True, bias is not None, False) + (False,) * len(tensors)
        y = FP8LinearFunction.forward(ctx, x2d, weight, bias, step, *tensors)
        self.steps.append((ctx, y))
        return y

    def backward(self) -> None:
        for ctx, y in self.steps:
            FP8LinearFunction.backward(ctx, torch.empty_like(y))

    def open(self, a_data: torch.Tensor, b_data: torch.Tensor, out_dtype: torch.dtype) -> None:
        role = GEMM_ROLES[len(self.gemms)] if len(self.gemms) < len(GEMM_ROLES) else f"gemm{len(self.gemms)}"
        self.gemms.append(GemmRecord(role, self.mode, Facts.of(a_data), Facts.of(b_data), out_dtype))

    def call(self, api: str, args: dict) -> Call:
        call = Call(api, {k: Facts.of(v) if torch.is_tensor(v) else v for k, v in args.items()})
        if self.gemms:
            self.gemms[-1].calls.append(call)
        return call


def _to(original):
    def to(self, *args, **kwargs):
        if isinstance(self, FakeTensor) and (args or "device" in kwargs):
            device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
            if device is not None:
                device = torch.device(device)
                same = device.type == self.device.type and dtype in (None, self.dtype)
                if same and memory_format is None:
                    return self
                return torch.ops.aten._to_copy.default(self, dtype=dtype or self.dtype, device=device)
        return original(self, *args, **kwargs)

    return to


def _contiguous(original):
    def contiguous(self, memory_format=torch.contiguous_format):
        if isinstance(self, FakeTensor):
            return self if self.is_contiguous(memory_format=memory_format) else self.clone(memory_format=memory_format)
        return original(self, memory_format=memory_format)

    return contiguous


def _tensor(original):
    def tensor(data, *args, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":  # a fake tensor has no values to copy
            like = original(data, *args, **kwargs)
            return torch.empty(like.shape, dtype=like.dtype, device=device)
        return original(data, *args, device=device, **kwargs)

    return tensor


def _copy(original):
    def copy_(self, src, non_blocking=False):
        if isinstance(self, FakeTensor):
            return torch.ops.aten.copy_.default(self, src, non_blocking)
        return original(self, src, non_blocking)

    return copy_


def _basic_index(t: torch.Tensor, index):
    """``t[index]`` for integers, slices and None through dispatcher ops (views), or None for other indices."""
    out, dim = t, 0
    for item in index if isinstance(index, tuple) else (index,):
        if isinstance(item, int):
            out = out.select(dim, item)
        elif isinstance(item, slice) and item.step in (None, 1):
            out = torch.ops.aten.slice.Tensor(out, dim, item.start, item.stop, 1)
            dim += 1
        elif item is None:
            out = out.unsqueeze(dim)
            dim += 1
        else:
            return None
    return out


def _getitem(original):
    def getitem(self, index):
        view = _basic_index(self, index) if isinstance(self, FakeTensor) else None
        return original(self, index) if view is None else view

    return getitem


def _setitem(original):
    def setitem(self, index, value):
        view = _basic_index(self, index) if isinstance(self, FakeTensor) else None
        if view is None:
            original(self, index, value)
        else:
            view.copy_(value) if torch.is_tensor(value) else view.fill_(value)

    return setitem


def _wrap_gemm_calls(recorder: _Recorder, stack: contextlib.ExitStack) -> None:
    v1, v2 = torch._scaled_mm, torch.nn.functional.scaled_mm
    triton_mx_gemm = gemm.triton_mx_gemm

    def checked(api, original, out_shape, args, kwargs, named):
        call = recorder.call(api, named)
        try:
            return original(*args, **kwargs)
        except Exception as err:  # torch's meta function refused the call: recorded, the step goes on
            call.meta_error = f"{type(err).__name__}: {err}"
            mat = named["mat1"] if "mat1" in named else named["mat_a"]
            return torch.empty(out_shape, dtype=named.get("out_dtype") or torch.bfloat16, device=mat.device)

    def scaled_mm_v1(mat1, mat2, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,
                     use_fast_accum=False):
        named = dict(mat1=mat1, mat2=mat2, scale_a=scale_a, scale_b=scale_b, bias=bias, scale_result=scale_result,
                     out_dtype=out_dtype or mat1.dtype, use_fast_accum=use_fast_accum)
        args = (mat1, mat2, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum)
        return checked(V1_API, v1, (mat1.shape[0], mat2.shape[1]), args, {}, named)

    def scaled_mm_v2(mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, swizzle_a=None, swizzle_b=None,
                     bias=None, output_dtype=torch.bfloat16, contraction_dim=(), use_fast_accum=False):
        named = dict(mat_a=mat_a, mat_b=mat_b, scale_a=scale_a, scale_recipe_a=scale_recipe_a, scale_b=scale_b,
                     scale_recipe_b=scale_recipe_b, swizzle_a=swizzle_a, swizzle_b=swizzle_b, bias=bias,
                     out_dtype=output_dtype, use_fast_accum=use_fast_accum)
        args = (mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, swizzle_a, swizzle_b, bias,
                output_dtype, contraction_dim, use_fast_accum)
        return checked(V2_API, v2, (mat_a.shape[0], mat_b.shape[1]), args, {}, named)

    def mx_gemm(a, b, out_dtype=torch.bfloat16):
        recorder.call(TRITON_API, dict(a=a.data, a_scale=a.scale, b=b.data, b_scale=b.scale, out_dtype=out_dtype))
        return triton_mx_gemm(a, b, out_dtype)

    stack.enter_context(mock.patch.object(torch, "_scaled_mm", scaled_mm_v1))
    stack.enter_context(mock.patch.object(torch.nn.functional, "scaled_mm", scaled_mm_v2))
    stack.enter_context(mock.patch.object(gemm, "triton_mx_gemm", mx_gemm))


def _wrap_steps(recorder: _Recorder, stack: contextlib.ExitStack) -> None:
    eager_gemm, traced_gemm = EagerStep.gemm, TracedPlan.gemm

    def eager_step_gemm(self, a, b, out_dtype, bias, fast_accum):
        recorder.open(a.data, b.data, out_dtype)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = eager_gemm(self, a, b, out_dtype, bias, fast_accum)
        recorder.gemms[-1].warnings.extend(str(w.message) for w in caught)
        return out

    def traced_step_gemm(self, a, b, out_dtype, bias, fast_accum):
        recorder.open(a[0], b[0], out_dtype)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = traced_gemm(self, a, b, out_dtype, bias, fast_accum)
        recorder.gemms[-1].warnings.extend(str(w.message) for w in caught)
        return out

    stack.enter_context(mock.patch.object(FP8LinearFunction, "apply", recorder.apply))
    stack.enter_context(mock.patch.object(EagerStep, "gemm", eager_step_gemm))
    stack.enter_context(mock.patch.object(TracedPlan, "gemm", traced_step_gemm))
    # The traced GEMM op runs its implementation at run time on the tensors its cast ops made: run that here.
    stack.enter_context(mock.patch.object(traced, "scaled_gemm", HOT_OPS["scaled_gemm"].impl))


@contextlib.contextmanager
def simulated_device(target: Target, triton: bool = True) -> Iterator[FakeTensorMode]:
    """Fake CUDA tensors and a device that answers as ``target`` (capability, CUDA version, torch's API); the Triton
    kernels count as usable where ``triton`` and the capability allows them (sm_89+)."""
    major, minor = target.capability
    kernels_on = triton and not availability.disabled_by_env() and target.capability >= availability.MIN_CAPABILITY
    cuda = None if target.cuda is None else f"{target.cuda[0]}.{target.cuda[1]}"
    with contextlib.ExitStack() as stack:
        patches = [
            (torch.cuda, "is_available", lambda: True),
            (torch.cuda, "get_device_capability", lambda device=None: (major, minor)),
            (torch.cuda, "get_device_name", lambda device=None: f"simulated {target.arch}"),
            (torch.version, "cuda", cuda),
            (blockwise, "has_scaled_mm_v2", lambda: target.has_scaled_mm_v2),
            (blockwise, "_WARNED", set()),  # each simulation warns its fallbacks afresh
            (availability, "cuda_kernels_enabled", lambda index=None: kernels_on),
            (torch.Tensor, "to", _to(torch.Tensor.to)),
            (torch.Tensor, "contiguous", _contiguous(torch.Tensor.contiguous)),
            (torch.Tensor, "copy_", _copy(torch.Tensor.copy_)),
            (torch, "tensor", _tensor(torch.tensor)),
            (torch.Tensor, "__getitem__", _getitem(torch.Tensor.__getitem__)),
            (torch.Tensor, "__setitem__", _setitem(torch.Tensor.__setitem__)),
        ]
        for owner, name, value in patches:
            stack.enter_context(mock.patch.object(owner, name, value))
        for cache in (mx._SMALLEST_SUBNORMALS, mx._E8M0_TABLES, dispatch._DECODE_TABLES):  # per-device constants
            stack.enter_context(mock.patch.dict(cache))
        yield stack.enter_context(FakeTensorMode(allow_non_fake_inputs=False))


def run_layer(
    target: Target, recipe, m: int, k: int, n: int, mode: str = "eager", dtype: torch.dtype = torch.bfloat16,
    bias: bool = True, triton: bool = True,
) -> list[GemmRecord]:
    """The GEMMs of one training step (forward and backward) of a ``k -> n`` :class:`FP8Linear` under ``recipe`` on
    ``m`` tokens of ``dtype``, on the simulated ``target``, in ``mode`` ("eager" or "traced")."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid; allowed: {', '.join(MODES)}.")
    recorder = _Recorder(mode)
    with contextlib.ExitStack() as stack:
        stack.enter_context(simulated_device(target, triton))
        _wrap_gemm_calls(recorder, stack)
        _wrap_steps(recorder, stack)
        stack.enter_context(torch.no_grad())  # the Function's backward is called directly (see _Recorder.apply)
        layer = torch.nn.Linear(k, n, bias=bias, device="meta", dtype=dtype)
        layer.weight = torch.nn.Parameter(torch.empty(n, k, device="cuda", dtype=dtype), requires_grad=False)
        if bias:
            layer.bias = torch.nn.Parameter(torch.empty(n, device="cuda", dtype=dtype), requires_grad=False)
        FP8Linear.from_linear(layer, recipe)
        for _, scaling in layer.fp8_scalings():
            for state in scaling.operands.values():
                state.initialized = True  # the steady state: see the module docstring
        x = torch.empty(m, k, device="cuda", dtype=dtype)
        if mode == "traced":
            stack.enter_context(mock.patch.object(torch.compiler, "is_compiling", lambda: True))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a layer's own warnings (shapes it keeps in high precision)
            with fp8_autocast():
                layer(x)
            recorder.backward()
    return recorder.gemms
