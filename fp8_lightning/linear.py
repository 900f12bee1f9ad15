"""FP8Linear: an ``nn.Linear`` whose three GEMMs run on FP8 operands.

With ``x`` of shape (M, K), ``W`` of shape (N, K) and the output gradient ``g`` of shape (M, N)::

    fprop   y  = x @ W.T        x: E4M3, W: E4M3                      reduction over K
    dgrad   dx = g @ W          g: E5M2 (HYBRID) or E4M3, W: E4M3     reduction over N
    wgrad   dW = g.T @ x        g.T and x.T, both quantized along M   reduction over M

Every GEMM is an "NT" GEMM ``a @ b.T`` with K last in both operands (see :mod:`fp8_lightning.gemm`).
Per-tensor recipes transpose the FP8 bytes for dgrad/wgrad (a transpose does not change a per-tensor scale);
MXFP8 quantizes the columnwise copies from the high-precision tensor, because block scales follow the
reduction dimension.

Only FP8 copies of ``x`` and ``W`` are saved for backward (about half the bytes of a bf16 layer). The bias, the
output and everything outside the GEMMs stay in high precision (the autocast dtype, or the input dtype).
Within one optimizer step the FP8 weight is cast once and reused across micro-batches: the cache is keyed on
the parameter's version counter, which every in-place optimizer update bumps, and on a checksum of its bits, which
catches edits through ``weight.data`` (on a GPU, where the comparison would stall the host, a reuse casts again).

The design in full: ``docs/design/notes.md``, section ``fp8_lightning.linear``.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from fp8_lightning.autocast import autocast_state
from fp8_lightning.gemm import check_device, fp8_mm
from fp8_lightning.layer_scaling import LayerScaling
from fp8_lightning.layer_step import FP8LinearFunction
from fp8_lightning.quantize import OperandCache, OperandKind, Quantized
from fp8_lightning.recipes import Recipe, RecipeLike, recipe_from
from fp8_lightning.recompute import close_forwards, close_on_backward, forget_forwards, forward_setting
from fp8_lightning.scaling import bind_layer_name, records_amax
from fp8_lightning.traced import make_plan, traced_linear

# Set on a layer (or experts module) a weight of which FSDP2 gathers in FP8 (enable_fp8_all_gather): a plain
# attribute, which torch.compile reads, unlike the methods of the gathered weight a parameter wraps in a graph; such a
# module runs its eager step between graphs.
GATHERED_IN_FP8 = "fp8_weight_gathered_in_fp8"

Observer = Callable[[nn.Module, str, torch.Tensor, Quantized], None]


def shape_unsupported_reason(in_features: int, out_features: int, recipe: Recipe) -> str | None:
    """Why a (out, in) weight cannot run under ``recipe``, or None (the recipe's shape rule)."""
    return recipe.shape_unsupported_reason(in_features, out_features)


class _SavedOperand(NamedTuple):
    """What backward needs of a saved FP8 operand besides its data and scale tensors (saved with
    ``save_for_backward``): its kind, the part of its cache worth keeping (:meth:`OperandCache.for_backward`), and,
    for the weight cache's own columnwise object, the object itself (what dgrad derives from it, its float32 form
    or cuBLAS's swizzled scales, is then made once per optimizer step, not per micro-batch)."""

    kind: OperandKind
    cache: OperandCache
    operand: Quantized | None = None  # the weight cache's own columnwise object, kept whole

    def rebuild(self, data: torch.Tensor, scale: torch.Tensor) -> Quantized:
        if self.operand is not None:
            return self.operand
        return Quantized(data, scale, self.kind, self.cache)


class EagerStep:
    """The eager step of :class:`~fp8_lightning.layer_step.FP8LinearFunction`: the operands the layer's casts made
    (with their caches: float32 forms, inverse scales, transposed copies), the library's GEMM, and the output
    gradient cast by the layer's scaling state (and shown to its observer)."""

    __slots__ = ("layer_ref", "scaling", "emulate", "out_dtype", "fprop_fast_accum", "grad_fast_accum", "operands")

    def __init__(self, layer, scaling: LayerScaling, emulate: bool, out_dtype: torch.dtype, operands: tuple):
        self.scaling, self.emulate, self.out_dtype = scaling, emulate, out_dtype
        self.layer_ref = weakref.ref(layer)  # a graph kept alive keeps no layer alive
        recipe = scaling.recipe
        self.fprop_fast_accum, self.grad_fast_accum = recipe.fprop_fast_accum, recipe.grad_fast_accum
        # (x, x.T, W, W.T, the weight cast's columnwise copy or None, the FSDP2-gathered weight to save or None)
        self.operands = operands

    def forward_operands(self, tensors: tuple):
        return (*self.operands[:4], ())

    def gemm(self, a: Quantized, b: Quantized, out_dtype: torch.dtype, bias, fast_accum: bool) -> torch.Tensor:
        return fp8_mm(a, b, out_dtype, self.emulate, bias, fast_accum)

    def pack(self, x_t: Quantized, w_t: Quantized | None):
        # The cached FP8 weight's columnwise object travels whole (see _SavedOperand); the rest is rebuilt.
        w_cached, regathered = self.operands[4:]
        w_cached = w_cached if w_t is w_cached else None
        self.operands = None  # backward reads the saved tensors only (activation checkpointing can then drop them)
        x_saved = _SavedOperand(x_t.kind, x_t.cache.for_backward(keep_f32=False))
        if regathered is not None:  # FSDP2 frees and re-fills the gathered weight: backward makes W.T from it again
            return (x_t.data, x_t.scale, regathered), (x_saved, None)
        meta = (x_saved, _SavedOperand(w_t.kind, w_t.cache.for_backward(keep_f32=True), w_cached))
        return (x_t.data, x_t.scale, w_t.data, w_t.scale), meta

    def unpack(self, meta, saved: tuple):
        if meta[1] is None:  # the gathered weight itself was saved (see pack)
            x_data, x_scale, weight, *grad_state = saved
            return meta[0].rebuild(x_data, x_scale), weight.fp8_dgrad_operand(self.scaling), grad_state
        x_data, x_scale, w_data, w_scale, *grad_state = saved
        return meta[0].rebuild(x_data, x_scale), meta[1].rebuild(w_data, w_scale), grad_state

    def grad_operands(self, g: torch.Tensor, grad_state, columnwise: bool):
        layer = self.layer_ref()
        if layer is not None:
            close_forwards(layer)  # the backward reached the layer: its logged forwards are done with
        scaling = self.scaling
        g_row, g_col = scaling.cast("grad_output", g, record=True, columnwise=columnwise)
        observer = None if layer is None else layer.__dict__.get("fp8_observer")
        if observer is not None:
            observer(layer, "grad_output", g, g_row)
        return g_row, (scaling.recipe.transposed(g_row, g_col) if columnwise else None)


class FP8Linear(nn.Linear):
    """``nn.Linear`` with FP8 GEMMs inside :func:`~fp8_lightning.autocast.fp8_autocast`.

    Build it by converting an existing layer (:meth:`from_linear` or
    :func:`~fp8_lightning.convert.convert_to_fp8`), which keeps the very same module and parameters.
    """

    fp8_recipe: Recipe
    fp8_emulate: bool
    fp8_observer: Observer | None
    fp8_disabled_reason: str | None

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: RecipeLike = None, emulate: bool = False) -> "FP8Linear":
        """Turn ``linear`` into an FP8Linear in place (same object, same parameters) and return it. ``recipe``: a
        recipe, its name or a dict (``DelayedScaling()`` by default)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"FP8Linear.from_linear expects an nn.Linear; got {type(linear).__name__}.")
        if type(linear) is not nn.Linear and not isinstance(linear, FP8Linear):
            raise TypeError(
                f"{type(linear).__name__} subclasses nn.Linear; converting it would drop its own forward. "
                "Exclude it with a module filter."
            )
        return cls._adopt(linear, recipe_from(recipe), emulate)

    @classmethod
    def _adopt(cls, linear: nn.Module, recipe: Recipe, emulate: bool) -> "FP8Linear":
        """Swap the class of an already checked layer and give it the FP8 attributes (kept when present)."""
        linear.__class__ = cls
        linear.fp8_recipe = recipe
        linear.fp8_emulate = emulate
        linear.fp8_observer = getattr(linear, "fp8_observer", None)
        linear.fp8_disabled_reason = getattr(linear, "fp8_disabled_reason", None)
        linear._fp8_scalings = getattr(linear, "_fp8_scalings", {})
        linear._fp8_warned = getattr(linear, "_fp8_warned", set())
        linear.fp8_scaling(recipe)  # made now, outside any graph a compiled forward traces
        return linear

    def to_linear(self) -> nn.Linear:
        """Undo the conversion in place: the module becomes a plain ``nn.Linear`` again."""
        for attr in ("fp8_recipe", "fp8_emulate", "fp8_observer", "fp8_disabled_reason", "_fp8_scalings", "_fp8_warned",
                     "fp8_converted_by_plugin"):
            self.__dict__.pop(attr, None)
        forget_forwards(self)
        self.__class__ = nn.Linear
        return self

    @property
    def fp8_gemm_weight(self) -> torch.Tensor:
        """The weight as the GEMMs take it, (out_features, in_features): the parameter itself here; a transposed
        view for layers that store it (in, out) (:class:`~fp8_lightning.conv1d.FP8Conv1D`)."""
        return self.weight

    def fp8_scaling(self, recipe: Recipe | None = None) -> LayerScaling:
        """The layer's scaling state for ``recipe`` (its own recipe by default), created on first use."""
        recipe = recipe or self.fp8_recipe
        if recipe not in self._fp8_scalings:
            self._fp8_scalings[recipe] = LayerScaling(recipe)
            self._fp8_scalings[recipe].move_to(self.weight.device)
            bind_layer_name(self._fp8_scalings[recipe].operands, self.__dict__.get("fp8_layer_name"))
        return self._fp8_scalings[recipe]

    def _apply(self, fn, recurse: bool = True):
        """``.to()``, ``.cuda()``, ``to_empty()``: the scaling states follow the weight to its device, which the
        compiled layer step needs (it updates them in place, on the device of the tensors it casts)."""
        super()._apply(fn, recurse)
        for scaling in self.__dict__.get("_fp8_scalings", {}).values():
            scaling.move_to(self.weight.device)
        return self

    def fp8_scalings(self) -> list[tuple[Recipe, LayerScaling]]:
        """Every recipe this layer has scaling state for, with the state, in a deterministic order (the same on
        every rank): what checkpoints and the once-per-step scale update walk."""
        return sorted(self._fp8_scalings.items(), key=lambda item: repr(item[0]))

    @property
    def fp8_weight_casts(self) -> int:
        """How many times the weight was cast to FP8 (once per optimizer step when training)."""
        return sum(s.weight_casts for s in self._fp8_scalings.values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parallel = self.__dict__.get("fp8_tensor_parallel")  # set by the FP8 tensor-parallel styles
        if parallel is not None:  # the layer's shards: local GEMMs between the style's collectives
            return parallel.forward(self, x)
        return self.fp8_forward(x, self.fp8_gemm_weight, self.bias)

    def fp8_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T + bias`` with this layer's FP8 GEMMs, scaling state and fallbacks: the whole forward of a
        plain layer, and the local step of a tensor-parallel one (``weight`` and ``bias`` are then its shards)."""
        recipe, replay = self.fp8_setting(x, weight)
        if recipe is None:
            return close_on_backward(self, F.linear(x, weight, bias))
        device_type = "cpu" if x.is_cpu else x.device.type  # is_cpu: a flag; .device builds an object
        autocasting = torch.is_autocast_enabled(device_type)
        out_dtype = torch.get_autocast_dtype(device_type) if autocasting else x.dtype
        if not torch.compiler.is_compiling():  # eager: no compiler wrapper to pass through
            return self._eager_forward(x, recipe, out_dtype, autocasting, weight, bias, replay)
        if self._traceable():
            return self._traced_forward(x, recipe, out_dtype, autocasting, weight, bias)
        return self._eager_island(x, recipe, out_dtype, autocasting, weight, bias)

    def fp8_runs(self, x: torch.Tensor, weight: torch.Tensor) -> Recipe | None:
        """The recipe a call on ``x`` would run its GEMMs in FP8 under now, or None for high precision (a query:
        the forward itself asks :meth:`fp8_setting`, which also logs the call for activation checkpointing)."""
        return self._recipe_under(autocast_state(), x, weight)

    def fp8_setting(self, x: torch.Tensor, weight: torch.Tensor) -> tuple[Recipe | None, bool]:
        """(:meth:`fp8_runs`, whether this call is an activation-checkpoint recompute that replays the setting of
        its forward: :mod:`fp8_lightning.recompute`)."""
        state, replay = forward_setting(self, self.weight)
        return self._recipe_under(state, x, weight), replay

    def _recipe_under(self, state, x: torch.Tensor, weight: torch.Tensor) -> Recipe | None:
        recipe = state.recipe or self.fp8_recipe
        if not state.enabled or self.fp8_disabled_reason is not None or self._runtime_fallback(x, weight, recipe):
            return None
        return recipe

    def _traceable(self) -> bool:
        """Whether the traced step serves this call: not while an observer watches each cast (the stats monitor,
        the guard) nor for weights all-gathered in FP8 (they arrive cast): those run the eager path as an island."""
        return (self.fp8_observer is None and GATHERED_IN_FP8 not in self.__dict__
                and not hasattr(self.weight, "fp8_weight_operands") and "fp8_tensor_parallel" not in self.__dict__)

    def _traced_forward(
        self, x: torch.Tensor, recipe: Recipe, out_dtype: torch.dtype, autocasting: bool, weight=None, bias=None
    ):
        """The layer step as one graph (:mod:`fp8_lightning.traced`)."""
        weight, bias = (self.fp8_gemm_weight, self.bias) if weight is None else (weight, bias)
        check_device(x.device, self.fp8_emulate)
        scaling = self._fp8_scalings[recipe]  # made when the layer was converted (or by an eager call)
        plan = make_plan(recipe, x.device, out_dtype, self.fp8_emulate)
        with torch.autocast(x.device.type, enabled=False) if autocasting else contextlib.nullcontext():
            x2d = x.reshape(-1, x.shape[-1])
            y = traced_linear(x2d, weight, bias, plan, scaling.operands, records_amax(self.training))
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def _eager_forward(
        self, x: torch.Tensor, recipe: Recipe, out_dtype: torch.dtype, autocasting: bool, weight=None, bias=None,
        replay: bool = False,
    ):
        if not x.is_cpu:  # a CPU always runs FP8 GEMMs
            check_device(x.device, self.fp8_emulate)
        scaling = self._fp8_scalings.get(recipe) or self.fp8_scaling(recipe)
        weight, bias = (self.fp8_gemm_weight, self.bias) if weight is None else (weight, bias)
        record = records_amax(self.training) and not replay  # a replay books nothing (fp8_lightning.recompute)
        if record and scaling.step_boundary_passed(weight, self.weight) and scaling.booked:
            scaling.update()  # no one called update_scales() after the optimizer step: advance locally
        x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        operands = self._eager_operands(x, x2d, weight, scaling, record, replay)
        step = EagerStep(self, scaling, self.fp8_emulate, out_dtype, operands)
        if autocasting:  # the FP8 path picks its own dtypes: autocast stays out of it
            with torch.autocast(x.device.type, enabled=False):
                y = FP8LinearFunction.apply(x2d, weight, bias, step)
        else:
            y = FP8LinearFunction.apply(x2d, weight, bias, step)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])

    def _eager_operands(
        self, x_in, x2d: torch.Tensor, weight: torch.Tensor, scaling: LayerScaling, record: bool, replay: bool = False
    ):
        """(x, x.T, W, W.T, W's columnwise copy, the FP8-gathered weight to save or None) for the eager step: the
        input cast now (or as it arrived, cast before an FP8 all-gather: ``x_in.fp8_operands``), the weight from the
        step's cache. A replay shows nothing to the observer (the forward it repeats did)."""
        recipe = scaling.recipe
        arrived = getattr(x_in, "fp8_operands", None)  # {recipe: (x, x.T)} of a sequence-parallel FP8 all-gather
        if arrived is not None and recipe in arrived:
            x, x_col = arrived[recipe]
        else:
            x, x_col = scaling.cast("input", x2d.detach(), record, columnwise=True, columnwise_f32=False)
        # FSDP2 marks the modules it manages; it refills their gathered weights in place at every forward
        fsdp_managed = self.__dict__.get("_is_fsdp_managed_module", False)
        w, w_col = scaling.weight_operands(weight, record, fsdp_managed, self.weight, replay)
        observer = self.__dict__.get("fp8_observer")  # read where set: a module's missing-attribute path is slow
        if observer is not None and not replay:
            observer(self, "input", x2d, x)
            observer(self, "weight", weight, w)
        # a weight FSDP2 gathered in FP8 is saved itself, not W.T: its buffer is freed on reshard after forward and
        # re-filled (same bytes) before backward, which makes W.T again from it (nothing gathered held in between)
        regathered = getattr(weight, "fp8_regathered_for_backward", None)
        if regathered is not None and regathered(scaling):
            return x, recipe.transposed(x, x_col), w, None, None, weight
        return x, recipe.transposed(x, x_col), w, recipe.transposed(w, w_col), w_col, None

    # Under torch.compile a layer the traced step cannot serve runs eagerly between graphs.
    _eager_island = torch.compiler.disable(_eager_forward)

    def _runtime_fallback(self, x: torch.Tensor, weight: torch.Tensor, recipe: Recipe) -> bool:
        if not x.is_floating_point():
            raise TypeError(
                f"FP8Linear got an input of dtype {x.dtype}; FP8 GEMMs need floating-point input. "
                "Convert the input with .float() (or embed integer ids with nn.Embedding first)."
            )
        in_features, out_features = weight.shape[1], weight.shape[0]  # a tensor-parallel layer's shard
        if x.dim() == 0 or x.shape[-1] != in_features:
            raise ValueError(
                f"{type(self).__name__}(in_features={self.in_features}, out_features={self.out_features}) got an "
                f"input of shape {tuple(x.shape)}; its last dimension must be in_features={self.in_features}"
                f"{'' if in_features == self.in_features else f' split over tensor-parallel ranks: {in_features}'}. "
                "Reshape the input, or check which layer it was meant for."
            )
        if x.numel() == 0:  # no tokens (an empty micro-batch): nothing to cast; the plain GEMM gives the empty
            return True  # output and exact zero weight and bias gradients
        reason = shape_unsupported_reason(in_features, out_features, recipe)
        if reason is not None:
            self.fp8_warn_once(f"FP8Linear({in_features}, {out_features}) runs in high precision: {reason}.")
        return reason is not None

    def fp8_warn_once(self, message: str) -> None:
        """Warn ``message`` the first time this layer meets it (a runtime fallback repeats at every call)."""
        if message not in self._fp8_warned:
            self._fp8_warned.add(message)
            warnings.warn(message)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={type(self.fp8_recipe).__name__}"
