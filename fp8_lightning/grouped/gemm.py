"""The grouped FP8 GEMM of mixtures of experts: ``fp8_grouped_mm(a, b, offs)``, differentiable in ``a`` and ``b``.

It follows ``torch._grouped_mm``'s 2-D x 3-D convention: ``a`` (M, K) holds the tokens sorted by expert, ``b``
(E, K, N) the experts' weights, and ``offs`` (int32, E) the cumulative end row of each expert's group. With ``W_e =
b[e].T`` (N, K) the weight of expert ``e`` as a linear layer holds it, and ``x_e``, ``g_e`` its rows of ``a`` and of
the output gradient::

    fprop   y_e  = x_e @ W_e.T      grouped over tokens, reduction over K
    dgrad   dx_e = g_e @ W_e        grouped over tokens, reduction over N (each expert's transposed weight)
    wgrad   dW_e = g_e.T @ x_e      one GEMM per expert over its own tokens: the reduction dimension is ragged

All three multiply FP8 operands cast by the recipe (:meth:`~fp8_lightning.recipes.base.Recipe.grouped_operands`,
:meth:`~fp8_lightning.recipes.base.Recipe.grouped_weight_operands`): scales never cross an expert boundary, a weight's
scales cover one expert, and the wgrad copies are quantized along each expert's tokens (MX blocks padded per group).

Where the recipe has a native grouped kernel for the device (:meth:`~fp8_lightning.recipes.base.Recipe.grouped_native`:
rowwise on sm_90, ``torch._scaled_grouped_mm``) each GEMM is one grouped launch. Elsewhere the products are computed
from the operands' exact values (codes times scales) in float32, as one ``torch._grouped_mm`` per GEMM where the
device runs it in float32 (the CPU), else one float32 GEMM per non-empty group: FP8 numerics, emulated; on CUDA the
first call warns once that no FP8 grouped kernel runs.
"""

from __future__ import annotations

import collections
import itertools
import warnings
from typing import Callable

import torch
import torch.nn.functional as F

from fp8_lightning.groups import GroupBounds, expert_gemm_values, group_bounds, wgrad_values
from fp8_lightning.layer_scaling import LayerScaling
from fp8_lightning.ops.dispatch import dequantize_operand
from fp8_lightning.quantize import Quantized
from fp8_lightning.recipes import Recipe, RecipeLike, recipe_from

_WARNED: set[str] = set()


class GroupedScaling(LayerScaling):
    """Scaling state of one grouped GEMM for one recipe: the input's and the output gradient's states shared by every
    expert, one weight state per expert, and the per-step FP8 weight cache (keyed as a linear layer keys it)."""

    def __init__(self, recipe: Recipe, experts: int):
        super().__init__(recipe)
        self.experts = experts
        self.expert_states = [
            recipe.operand_states(self.forward_dtype, self.backward_dtype).get("weight") for _ in range(experts)
        ]
        shared = {role: state for role, state in self.operands.items() if role != "weight"}
        per_expert = {f"weight.{e}": s for e, s in enumerate(self.expert_states) if s is not None}
        self.operands = {**shared, **per_expert}
        self.gemms = collections.Counter()  # grouped FP8 GEMMs run, by kind ("fprop", "dgrad", "wgrad")

    def weight_operands(self, weight: torch.Tensor, record: bool, regathered: bool = False, replay: bool = False):
        """Each expert's (W_e, W_e.T) operands: in training cast once per weight version and scale generation (and
        again after an edit through ``weight.data``), in evaluation cast afresh (see
        :class:`~fp8_lightning.layer_scaling.LayerScaling`)."""
        provided = getattr(weight, "fp8_expert_operands", None)  # already FP8 (gathered in FP8 by FSDP2)
        if provided is not None:
            return provided(self, record)
        if regathered:
            self._weight_cache = None
        if replay and (forward := self.forward_cast(weight, self._generations())) is not None:
            return forward  # a checkpoint recompute: the cast of the forward it repeats
        if not record:
            return self.recipe.grouped_weight_operands(weight.detach(), self.forward_dtype, self.expert_states, False)
        return self.cached_weight(
            weight,
            self._generations(),
            lambda: self.recipe.grouped_weight_operands(weight.detach(), self.forward_dtype, self.expert_states, True),
        )

    def _generations(self) -> tuple:
        """The experts' weight-scale generations: a new one means new scales, so a new cast."""
        return tuple(s.generation for s in self.expert_states if s is not None)


def check_grouped_shapes(a: torch.Tensor, b: torch.Tensor, recipe: Recipe) -> tuple[int, int, int]:
    """(E, K, N) of ``a`` (M, K) and ``b`` (E, K, N), checked against each other and the recipe's shape rule."""
    if not (torch.is_tensor(a) and a.dim() == 2 and a.is_floating_point()):
        what = f"shape {tuple(a.shape)}, dtype {a.dtype}" if torch.is_tensor(a) else type(a).__name__
        raise ValueError(f"fp8_grouped_mm: a must be a 2-D floating-point (M, K) tensor of tokens; got {what}.")
    if not (torch.is_tensor(b) and b.dim() == 3 and b.is_floating_point()):
        what = f"shape {tuple(b.shape)}" if torch.is_tensor(b) else type(b).__name__
        raise ValueError(
            f"fp8_grouped_mm: b must be a 3-D floating-point (E, K, N) tensor of expert weights; got {what}. A fused "
            "weight stored (E, N, K) (transformers' gate_up_proj, down_proj) is passed as weight.transpose(-2, -1)."
        )
    experts, k, n = b.shape
    if a.shape[1] != k:
        raise ValueError(
            f"fp8_grouped_mm: a is {tuple(a.shape)} and b is {tuple(b.shape)}: a's K={a.shape[1]} must equal b's "
            f"K={k} (b is (E, K, N); transpose its last two dimensions if it is stored (E, N, K))."
        )
    reason = recipe.shape_unsupported_reason(k, n, names=("K", "N"))
    if reason is not None:
        raise ValueError(
            f"fp8_grouped_mm: experts of K={k}, N={n} cannot run under {type(recipe).__name__}: {reason}. Pad the "
            "expert dimensions to that multiple, or run these experts in high precision (torch._grouped_mm)."
        )
    return experts, k, n


def grouped_product(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, bounds: list[tuple[int, int]]):
    """``torch._grouped_mm(a, b, offs)`` in float32: 2-D x 3-D (one GEMM per group of rows) or 2-D x 2-D (``a``
    (K, M) and ``b`` (M, N) reduced over each group's columns of ``a``, giving (E, K, N)). The CPU runs it as one
    call; elsewhere (CUDA's grouped kernels take bf16 only) one GEMM per non-empty group."""
    if a.is_cpu:
        if b.dim() == 2:  # the kernel wants 16-byte strides: pad the token dimension with zeros past the last group
            pad = -a.shape[1] % 4
            a, b = F.pad(a, (0, pad)), F.pad(b, (0, 0, 0, pad)).contiguous()
        return torch._grouped_mm(a.contiguous(), b, offs)
    if b.dim() == 3:
        out = a.new_zeros(a.shape[0], b.shape[2])
        for e, (start, end) in enumerate(bounds):
            if end > start:
                out[start:end] = a[start:end] @ b[e]
        return out
    out = a.new_zeros(len(bounds), a.shape[0], b.shape[1])
    for e, (start, end) in enumerate(bounds):
        if end > start:
            out[e] = a[:, start:end] @ b[start:end]
    return out


def _values(q: Quantized, width: int | None = None) -> torch.Tensor:
    """An operand's float32 values (codes times scales), cut to ``width`` columns (MX copies pad K to whole blocks)."""
    values = dequantize_operand(q, torch.float32)
    return values if width is None else values[:, :width]


def _weight_values(w_operands, transposed: bool) -> torch.Tensor:
    """The experts' float32 weight values as the emulated GEMMs take them: (E, K, N) from each W_e operand for fprop,
    (E, N, K) from each W_e.T operand for dgrad; in one pass where the operands come from casts of all the experts
    (:meth:`~fp8_lightning.groups.ExpertOperands.gemm_values`), else (a list of pairs) one dequantization per
    expert."""
    stacked = expert_gemm_values(w_operands, transposed)
    if stacked is not None:
        return stacked
    return torch.stack([_values(pair[1 if transposed else 0]).t() for pair in w_operands])


class GroupedStep:
    """What one call needs besides its tensors: the recipe's state, the groups and the output dtype."""

    __slots__ = ("scaling", "bounds", "offs", "out_dtype", "record", "regathered", "observer", "native", "replay")

    def __init__(self, scaling: GroupedScaling, bounds, offs: torch.Tensor, out_dtype: torch.dtype, record: bool,
                 regathered: bool = False, observer: Callable | None = None, native=None,
                 replay: bool = False):  # fmt: skip
        self.scaling, self.bounds, self.offs, self.out_dtype, self.record = scaling, bounds, offs, out_dtype, record
        self.regathered, self.observer, self.replay = regathered, observer, replay
        self.native = native  # the recipe's grouped kernels (Recipe.grouped_native), or None: emulated


class _Slot(int):
    """Where a tensor stood in a structure whose tensors travel through ``save_for_backward``."""


def _plain_object(obj) -> bool:
    """An instance of a plain Python class (a dataclass, a container of operands): not a tensor, type, module, or
    value of a built-in type (a str subclass such as an operand kind)."""
    return (hasattr(obj, "__dict__") and type(obj).__new__ is object.__new__
            and not isinstance(obj, (type, torch.nn.Module)))


def _hollow(obj, tensors: list):
    """A copy of ``obj`` (lists, tuples, dicts, objects with a ``__dict__``, dataclasses) with each tensor moved to
    ``tensors`` and replaced by its :class:`_Slot`; other values are kept as they are."""
    if torch.is_tensor(obj):
        tensors.append(obj)
        return _Slot(len(tensors) - 1)
    if isinstance(obj, (list, tuple)):
        items = [_hollow(item, tensors) for item in obj]
        copy = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        if hasattr(obj, "__dict__"):  # a subclass with attributes of its own (GroupBounds.offs)
            copy.__dict__.update({key: _hollow(value, tensors) for key, value in vars(obj).items()})
        return copy
    if isinstance(obj, dict):
        return {key: _hollow(value, tensors) for key, value in obj.items()}
    if _plain_object(obj):
        copy = object.__new__(type(obj))
        copy.__dict__.update({key: _hollow(value, tensors) for key, value in vars(obj).items()})
        return copy
    return obj


def _fill(obj, tensors: tuple):
    """:func:`_hollow` undone, in a new copy (the hollow one stays hollow: it holds no tensor after backward)."""
    if isinstance(obj, _Slot):
        return tensors[obj]
    if isinstance(obj, (list, tuple)):
        items = [_fill(item, tensors) for item in obj]
        copy = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        if hasattr(obj, "__dict__"):
            copy.__dict__.update({key: _fill(value, tensors) for key, value in vars(obj).items()})
        return copy
    if isinstance(obj, dict):
        return {key: _fill(value, tensors) for key, value in obj.items()}
    if _plain_object(obj):
        copy = object.__new__(type(obj))
        copy.__dict__.update({key: _fill(value, tensors) for key, value in vars(obj).items()})
        return copy
    return obj


GROUPED_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class FP8GroupedMMFunction(torch.autograd.Function):
    """``y = grouped(a @ W_e.T)`` from FP8 operands; ``weight`` is (E, N, K), each ``weight[e]`` a linear layer's
    (out, in) weight. Saves the FP8 columnwise copies of ``a`` and the weights' transposed operands."""

    @staticmethod
    def forward(ctx, a, weight, step: GroupedStep):
        scaling, bounds, offs = step.scaling, step.bounds, step.offs
        recipe = scaling.recipe
        ctx.step, ctx.dtypes, ctx.weight_shape = step, (a.dtype, weight.dtype), weight.shape
        if a.shape[0] == 0:  # an empty batch: nothing to cast; zero gradients
            ctx.saved = None
            return a.new_zeros(0, weight.shape[1], dtype=step.out_dtype)
        needs_w = ctx.needs_input_grad[1]
        x_row, x_columns = recipe.grouped_operands(
            "input", a.detach(), bounds, scaling.forward_dtype, needs_w, scaling.operands.get("input"), step.record
        )
        w_operands = scaling.weight_operands(weight, step.record, step.regathered, step.replay)
        if step.observer is not None:
            step.observer("input", a, x_row)
            for e, (w, _) in enumerate(w_operands):
                step.observer(f"weight[{e}]", weight[e], w)
        # ------------------------------------------------ fprop ------------------------------------------------
        if step.native is not None:
            y = step.native.fprop(x_row, w_operands, offs, step.out_dtype)
        else:
            w_kn = _weight_values(w_operands, transposed=False)  # (E, K, N)
            y = grouped_product(_values(x_row), w_kn, offs, bounds)
        scaling.gemms["fprop"] += not step.replay  # a checkpoint recompute counts nothing (its forward did)
        # the input's columnwise copies (activation memory) travel as saved tensors, which activation checkpointing
        # drops and recomputes and a backward frees; the weights' operands are the step's cached cast, except for a
        # weight FSDP2 gathered in FP8: it is saved itself (its buffer is freed on reshard and re-filled before
        # backward), and backward makes its operands again from it
        tensors = []
        regathered = getattr(weight, "fp8_regathered_for_backward", None)
        w_saved = _hollow(weight, tensors) if regathered is not None and regathered(scaling) else w_operands
        ctx.saved = (_hollow(x_columns, tensors), w_saved)
        ctx.save_for_backward(*tensors)
        return y.to(step.out_dtype)

    @staticmethod
    def backward(ctx, grad_y):
        step, (a_dtype, w_dtype) = ctx.step, ctx.dtypes
        needs_a, needs_w = ctx.needs_input_grad[:2]
        if torch.is_grad_enabled():  # create_graph=True: the gradients would silently carry no graph
            raise RuntimeError(
                "fp8_grouped_mm has no second derivative: its backward GEMMs run on FP8 copies outside autograd, so "
                "create_graph=True (double backward, gradient penalties) cannot differentiate them. Run these "
                "experts in high precision (torch._grouped_mm) for that computation."
            )
        if ctx.saved is None:  # an empty batch
            grad_w = grad_y.new_zeros(ctx.weight_shape, dtype=w_dtype) if needs_w else None
            return grad_y.new_zeros(0, ctx.weight_shape[2], dtype=a_dtype), grad_w, None
        scaling, bounds, offs = step.scaling, step.bounds, step.offs
        hollow_columns, w_operands = ctx.saved
        saved = ctx.saved_tensors  # read once: under activation checkpointing each read unpacks (a second one fails)
        x_columns = _fill(hollow_columns, saved)  # torch refuses a second backward once they are freed
        if isinstance(w_operands, _Slot):  # the weight FSDP2 gathered again for backward
            w_operands = saved[w_operands].fp8_expert_operands(scaling, False) if needs_a else None
        native = step.native
        g_row, g_columns = scaling.recipe.grouped_operands(
            "grad_output", grad_y.contiguous(), bounds, scaling.backward_dtype, needs_w,
            scaling.operands.get("grad_output"), True,
        )
        if step.observer is not None:
            step.observer("grad_output", grad_y, g_row)
        grad_a = grad_w = None
        # ------------------------------------------------ dgrad ------------------------------------------------
        if needs_a:
            if native is not None:
                grad_a = native.dgrad(g_row, w_operands, offs, a_dtype)
            else:
                w_nk = _weight_values(w_operands, transposed=True)  # (E, N, K): W_e as right operand
                grad_a = grouped_product(_values(g_row), w_nk, offs, bounds).to(a_dtype)
            scaling.gemms["dgrad"] += 1
        # ------------------------------------------------ wgrad ------------------------------------------------
        if needs_w and native is not None:
            grad_w = native.wgrad(g_columns, x_columns, w_dtype)  # (E, N, K), zero for empty experts
        elif needs_w and (whole := wgrad_values(g_columns, offs, bounds)) is not None:  # every group in one pass
            g_t, wgrad_offs, wgrad_bounds = whole  # (N, L) with the groups' ends along L
            x_t = wgrad_values(x_columns, offs, bounds)[0]  # (K, L)
            grad_w = grouped_product(g_t, x_t.t(), wgrad_offs, wgrad_bounds).to(w_dtype)
        elif needs_w:  # lists of per-group operands: each group's values, cut to its rows unless padding counts
            g_values = [None if q is None else _values(q) for q in g_columns]
            x_values = [None if q is None else _values(q) for q in x_columns]
            padded = scaling.recipe.wgrad_sums_padding
            widths = [0 if g is None else g.shape[1] if padded else end - start
                      for g, (start, end) in zip(g_values, bounds)]  # fmt: skip
            g_t = torch.cat([v[:, :w] for v, w in zip(g_values, widths) if v is not None], dim=1)  # (N, M')
            x_t = torch.cat([v[:, :w] for v, w in zip(x_values, widths) if v is not None], dim=1)  # (K, M')
            ends = list(itertools.accumulate(widths))
            wgrad_offs = torch.tensor(ends, dtype=torch.int32, device=g_t.device) if padded else offs
            wgrad_bounds = GroupBounds(zip([0, *ends], ends)) if padded else bounds
            grad_w = grouped_product(g_t, x_t.t(), wgrad_offs, wgrad_bounds).to(w_dtype)  # (E, N, K), 0 if empty
        if needs_w:
            scaling.gemms["wgrad"] += 1
        return grad_a, grad_w, None


def warn_once(device: torch.device, reason: str | None = None) -> None:
    """One warning per process, device type and reason where the grouped GEMM runs emulated on an accelerator;
    ``reason``: the recipe's (:meth:`~fp8_lightning.recipes.base.Recipe.grouped_fallback_reason`), if it gives one."""
    key = device.type if reason is None else f"{device.type}: {reason}"
    if device.type != "cpu" and key not in _WARNED:
        _WARNED.add(key)
        why = f"its grouped kernel cannot run: {reason}" if reason else "no FP8 grouped GEMM kernel runs here yet"
        warnings.warn(
            f"fp8_grouped_mm on {device.type}: {why}; the grouped GEMMs multiply the FP8 operands' exact values in "
            "float32 (FP8 numerics, high-precision speed)."
        )


def fp8_grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor,
    recipe: RecipeLike = None,
    out_dtype: torch.dtype | None = None,
    *,
    scaling: GroupedScaling | None = None,
    training: bool = True,
    regathered: bool = False,
    observer: Callable[[str, torch.Tensor, Quantized], None] | None = None,
    replay: bool = False,
) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs)`` with its three GEMMs (forward, input and weight gradients) on FP8 operands.

    Args:
        a: (M, K) tokens sorted by expert.
        b: (E, K, N) expert weights (a fused (E, N, K) weight is passed as ``weight.transpose(-2, -1)``).
        offs: int32 (E,), the cumulative end row of each expert's group; it must end at M.
        recipe: the scaling recipe (object, name or dict); ``DelayedScaling()`` by default.
        out_dtype: the output dtype; ``a.dtype`` by default.
        scaling: the state to keep between calls (a module's :class:`GroupedScaling`); a fresh one by default, which
            makes delayed scaling scale each tensor just in time.
        training: book the casts in ``scaling`` (amax histories); False leaves it as it was.
        regathered: ``b`` was refilled in place since the last call (an FSDP2 all-gather into a reused buffer keeps
            its version counter): cast it afresh instead of reusing ``scaling``'s cached cast.
        observer: called as ``observer(role, x, q)`` with each high-precision operand and its FP8 operand:
            ``"input"``, ``"weight[e]"`` for each expert, ``"grad_output"`` (statistics, the divergence guard).
        replay: an activation-checkpoint recompute (with ``training=False``): ``scaling``'s cached weight cast of
            the forward it repeats, while it is that of ``b``.

    Returns:
        The (M, N) product, differentiable in ``a`` and ``b``.

    Raises:
        TypeError: ``offs`` is not an int32 tensor.
        ValueError: ``offs`` not non-decreasing or not ending at M; K not a multiple of the recipe's block; a weight
            of the wrong shape; an ``out_dtype`` that is not float32, bfloat16, float16 or float64 (each message names
            the argument and the fix).
        RuntimeError: a double backward (``create_graph=True``).
    """
    recipe = scaling.recipe if scaling is not None else recipe_from(recipe)
    experts, k, n = check_grouped_shapes(a, b, recipe)
    if out_dtype is not None and out_dtype not in GROUPED_OUT_DTYPES:
        raise ValueError(f"fp8_grouped_mm: out_dtype={out_dtype} is not allowed; allowed: "
                         f"{', '.join(map(str, GROUPED_OUT_DTYPES))} (None: a's dtype).")
    bounds = group_bounds(offs, a.shape[0], experts)
    if scaling is None:
        scaling = GroupedScaling(recipe, experts)
    elif scaling.experts != experts:
        raise ValueError(f"fp8_grouped_mm: scaling holds {scaling.experts} experts but b holds {experts}.")
    native = recipe.grouped_native(a.device, experts)
    if native is None:
        warn_once(a.device, recipe.grouped_fallback_reason(a.device, experts))
    step = GroupedStep(scaling, bounds, offs, out_dtype or a.dtype, training, regathered, observer, native, replay)
    return FP8GroupedMMFunction.apply(a, b.transpose(1, 2), step).contiguous()
