"""Scaling state: the mutable half of a recipe (amax history, scale), its update rule and cross-rank sync.

One :class:`OperandScaling` exists per FP8 GEMM operand of a layer (input, weight, output gradient) and per-tensor
recipe. The math is in small pure functions, following TransformerEngine's delayed scaling:

    amax  = max(history)  or  history[0]          (amax_compute_algo "max" / "most_recent"; [0] is newest)
    scale = (fp8_max / amax) / 2**margin
    scale = float32 max           where scale is inf
    scale = previous scale        where amax is 0, inf or NaN

Rules that make it robust in training:

* The first use of a delayed-scaled tensor scales it just in time from its own amax instead of starting from 1.
* A non-finite amax (NaN/inf in activations or gradients) never enters the history: the previous scale is
  kept and the event is counted in ``nonfinite_count``.
* Within one optimizer step (gradient accumulation) the pending amax is the max over micro-batches and the
  history advances once per step, in :func:`update_scales`, which also agrees the pending amaxes of all
  data-parallel ranks in *one* coalesced all-reduce, so every rank ends the step with identical scales.

All state is kept in tensors (no host synchronisation on the hot path). The once-per-step update advances all
operands of a model together (:func:`advance_histories`: a dozen tensor operations for the whole model rather than
a dozen per operand), which matters where every small operation costs microseconds: on a CPU, or launching GPU
kernels.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist

from fp8_lightning.ops import dispatch
from fp8_lightning.formats import fp8_max
from fp8_lightning.quantize import (
    OperandCache,
    Quantized,
    TENSOR,
    max_over_amax,
    round_scale_to_power_of_2,
)


# --------------------------------------------------------------------------------------------------------
# Pure functions
# --------------------------------------------------------------------------------------------------------


def history_amax(amax_history: torch.Tensor, algo: str) -> torch.Tensor:
    """The amax a delayed scale is computed from: the window's max, or its newest entry (index 0), over the last
    dimension (one value per history of a batch)."""
    if algo == "max":
        return amax_history.amax(dim=-1)
    if algo == "most_recent":
        return amax_history[..., 0]
    raise ValueError(f"amax_compute_algo={algo!r} is invalid; allowed: max or most_recent.")


def delayed_scale(
    amax_history: torch.Tensor,
    prev_scale: torch.Tensor,
    max_value: "float | torch.Tensor",
    margin: int = 0,
    algo: str = "max",
    power_of_2: bool = False,
) -> torch.Tensor:
    """``(fp8_max / amax) / 2**margin``; inf becomes float32 max; amax 0/inf/NaN keeps ``prev_scale``."""
    a = history_amax(amax_history, algo).float()
    scale = max_over_amax(max_value, a.double() * 2.0**margin)  # exact in float64: a power of two
    if power_of_2:
        scale = round_scale_to_power_of_2(scale)
    usable = torch.isfinite(a) & (a > 0)
    return torch.where(usable, scale, prev_scale.float())


def finite_or_zero(x_amax: torch.Tensor) -> torch.Tensor:
    """The amax with NaN and inf replaced by 0 (an amax is >= 0, inf or NaN): what may enter a history."""
    return torch.nan_to_num(x_amax, nan=0.0, posinf=0.0)


def roll_history(amax_history: torch.Tensor, new_amax: torch.Tensor) -> torch.Tensor:
    """Push ``new_amax`` to the front (index 0 is newest) and drop the oldest entry, along the last dimension
    (a batch of histories of shape (S, L) takes S new amaxes)."""
    new = new_amax.reshape(*amax_history.shape[:-1], 1).to(amax_history.dtype)
    return torch.cat([new, amax_history[..., :-1]], dim=-1)


# --------------------------------------------------------------------------------------------------------
# Per-operand state
# --------------------------------------------------------------------------------------------------------


class OperandScaling:
    """Scale and amax bookkeeping of one GEMM operand under a per-tensor recipe (delayed or tensorwise)."""

    def __init__(self, recipe, dtype: torch.dtype, device: torch.device | str = "cpu"):
        """``recipe``: a per-tensor recipe (:class:`~fp8_lightning.recipes.per_tensor.PerTensorRecipe`), which says
        whether scales come from a history (``keeps_history``, ``history_len``) and how a fresh scale is made."""
        if not hasattr(recipe, "just_in_time_scale"):
            raise ValueError(f"OperandScaling is for per-tensor recipes; got {type(recipe).__name__}.")
        self.recipe = recipe
        self.dtype = dtype
        self.max_value = fp8_max(dtype)
        self.delayed = recipe.keeps_history
        length = recipe.history_len
        self.scale = torch.ones((), dtype=torch.float32, device=device)
        self.amax_history = torch.zeros(length, dtype=torch.float32, device=device)
        self.pending_amax = torch.zeros((), dtype=torch.float32, device=device)
        self.last_amax = torch.zeros((), dtype=torch.float32, device=device)
        self.nonfinite_count = torch.zeros((), dtype=torch.int64, device=device)
        # The same two facts as tensors, [initialized, observed], for the traced layer step (fp8_lightning.traced),
        # whose cast ops set them in place where a compiled graph cannot assign Python attributes.
        self.flags = torch.zeros(2, dtype=torch.float32, device=device)
        self._initialized = False
        self._dirty = False  # an amax was booked this step and waits for update() ("observed")
        self.casts = 0
        self.generation = 0  # bumped by every update(): cached casts made before it are stale
        # The ranks that hold shards of the tensor this operand casts (tensor parallelism): each cast takes the amax
        # of the whole tensor, agreed across them, so that every shard is cast with the one scale of the whole.
        self.amax_group: "dist.ProcessGroup | None" = None

    # -- host-side flags, kept in step with ``flags`` -------------------------------------------------------

    @property
    def initialized(self) -> bool:
        """Whether the operand has a scale (its first cast set one); read from ``flags`` until that is so."""
        if not self._initialized and bool(self.flags[0] > 0):
            self._initialized = True
        return self._initialized

    @initialized.setter
    def initialized(self, value: bool) -> None:
        if not (value and self._initialized):  # writes only on the first cast and on loading
            self.flags[0] = float(value)
        self._initialized = bool(value)

    @property
    def dirty(self) -> bool:
        """Whether an amax was booked since the last update (by an eager cast, or a traced one: ``flags[1]``)."""
        return self._dirty or bool(self.flags[1] > 0)

    @dirty.setter
    def dirty(self, value: bool) -> None:
        self._dirty = bool(value)
        if not value:
            self.flags[1] = 0.0

    # -- the hot path ---------------------------------------------------------------------------------------

    def quantize(self, x: torch.Tensor, record: bool = True, transpose: bool = False) -> Quantized:
        """Cast ``x`` with this operand's scale; returns an FP8 operand.

        ``record=False`` (evaluation) changes nothing in the state (see :meth:`_evaluation_cast`). ``transpose``
        (2-D x): the operand will also be used transposed; where the cast kernels run (CUDA), they write that
        layout in the same pass.
        """
        self.move_to(x.device)
        transpose = transpose and x.dim() == 2
        if self.amax_group is not None:
            return self._agreed_cast(x, record)
        if not record:
            return self._evaluation_cast(x, transpose)
        outputs = self.recipe.state_cast(self, x, record, transpose)  # the CUDA kernels, where they run
        if outputs is not None:
            return self._book_state_cast(outputs, record, transpose)
        fused = dispatch.fused_cast(x, self.scale, self.dtype) if self.delayed and self.initialized else None
        x_amax, host_amax = dispatch.amax_and_value(x) if fused is None else (fused.amax, fused.host_amax)
        finite = host_amax is not None and math.isfinite(host_amax)
        clean_amax = self.book(x_amax, record, finite)
        scale = self.scale_for(clean_amax, host_amax if finite else None)
        if fused is not None:
            return Quantized(fused.data, scale, TENSOR, OperandCache(fused.values, finite))
        return self._cast_with(x, scale, host_amax if finite else None)

    def _cast_with(self, x: torch.Tensor, scale: torch.Tensor, host_amax: float | None) -> Quantized:
        """``saturate(x * scale)``; a finite amax known on the host (``host_amax``) tells whether any value can
        reach the clamp (the cast rounds values a hair above fp8_max down to it). On CPU the scale is read once,
        here, for both uses."""
        finite = host_amax is not None
        scale_value = scale.item() if finite or scale.is_cpu else None
        in_range = finite and host_amax * scale_value <= self.max_value * (1 + 2**-20)
        return dispatch.quantize_operand(x, scale, self.dtype, not in_range, finite, scale_value)

    def _agreed_cast(self, x: torch.Tensor, record: bool) -> Quantized:
        """The cast of one shard of a tensor split over :attr:`amax_group`: the amax is the whole tensor's (one
        MAX all-reduce of the shards' amaxes), then the scale is made and kept as for an unsplit tensor."""
        x_amax = agreed_amax(x, self.amax_group)
        clean = finite_or_zero(x_amax)
        scale = self.scale_for(self.book(x_amax, record)) if record else self.evaluation_scale(clean)
        return self._cast_with(x, scale, None)

    def __getstate__(self) -> dict:
        """For pickle and deepcopy: a process group does not travel (a copy casts as an unsplit tensor)."""
        state = self.__dict__.copy()
        state["amax_group"] = None
        return state

    def _evaluation_cast(self, x: torch.Tensor, transpose: bool) -> Quantized:
        """The cast of an evaluation forward, which leaves every tensor, flag and counter of the state as it
        was: training after a validation loop computes exactly what it computes without one. It uses the scale
        a training cast would use: the stored delayed scale, or, where that does not exist yet (delayed before
        its first training cast, and tensorwise), the current scale of ``x`` itself, used once and not kept."""
        stored = self.delayed and self.initialized
        outputs = self.recipe.state_cast(self, x, False, transpose)
        if outputs is not None:  # the kernel's bookkeeping outputs are dropped
            data, data_t, fresh_scale, _, _, inverse = outputs
            scale = self.scale if self.delayed else fresh_scale  # the delayed kernel's third output is the amax
            return Quantized(data, scale, TENSOR, _kernel_cache(inverse, data_t if transpose else None))
        fused = dispatch.fused_cast(x, self.scale, self.dtype) if stored else None
        if fused is not None:
            return Quantized(fused.data, self.scale, TENSOR, OperandCache(fused.values, math.isfinite(fused.host_amax)))
        x_amax, host_amax = dispatch.amax_and_value(x)
        host_amax = host_amax if host_amax is not None and math.isfinite(host_amax) else None
        return self._cast_with(x, self.evaluation_scale(finite_or_zero(x_amax), host_amax), host_amax)

    def evaluation_scale(self, clean_amax: torch.Tensor, host_amax: float | None = None) -> torch.Tensor:
        """:meth:`scale_for` without keeping anything: the scale an evaluation cast of a tensor with amax
        ``clean_amax`` uses (the stored delayed scale, else the current scale of that amax)."""
        if self.delayed and self.initialized:
            return self.scale
        return self._current_scale(clean_amax, host_amax)

    def _book_state_cast(self, outputs: tuple, record: bool, transpose: bool) -> Quantized:
        """Take the results of a cast that did the bookkeeping of :meth:`book` and :meth:`scale_for` itself (same
        bits; the recipe's ``state_cast``)."""
        if self.delayed:
            data, data_t, self.last_amax, self.pending_amax, self.nonfinite_count, inverse = outputs
            self._dirty = self._dirty or record
        else:
            data, data_t, self.scale, self.last_amax, self.nonfinite_count, inverse = outputs
            self.initialized = True
        self.casts += 1
        return Quantized(data, self.scale, TENSOR, _kernel_cache(inverse, data_t if transpose else None))

    def book(self, x_amax: torch.Tensor, record: bool, finite: bool = False) -> torch.Tensor:
        """Count one use of the operand with amax ``x_amax``; returns the amax with NaN/inf replaced by 0.

        A non-finite amax is counted in ``nonfinite_count`` and never enters the history. Training (``record``)
        folds the amax into the step's pending amax (delayed scaling); evaluation (``record=False``) counts
        nothing. ``finite``: the caller knows the amax is finite (skips the masking).
        """
        clean_amax = x_amax if finite else finite_or_zero(x_amax)
        if not record:  # evaluation: nothing is counted
            return clean_amax
        if not finite:
            self.nonfinite_count += clean_amax != x_amax
        self.last_amax = x_amax
        if self.delayed:
            self.pending_amax = torch.maximum(self.pending_amax, clean_amax)
            self._dirty = True
        self.casts += 1
        return clean_amax

    def scale_for(self, clean_amax: torch.Tensor, host_amax: float | None = None) -> torch.Tensor:
        """The scale of this use: the delayed scale, or the current scale of ``clean_amax`` (tensorwise, and the
        just-in-time first use of a delayed-scaled tensor), which becomes the operand's scale. ``host_amax``: the
        same amax read on the host, when known and finite (a tensorwise scale is then worked out on the host)."""
        if not (self.delayed and self.initialized):
            self.scale = self._current_scale(clean_amax, host_amax)
            self.initialized = True
        return self.scale

    def _current_scale(self, clean_amax: torch.Tensor, host_amax: float | None = None) -> torch.Tensor:
        return self.recipe.just_in_time_scale(self, clean_amax, host_amax)

    # -- once per optimizer step ----------------------------------------------------------------------------

    @property
    def observed(self) -> torch.Tensor:
        """1.0 when an amax was booked this step (what the cross-rank reduction carries), else 0.0."""
        return self.flags[1].clamp(min=float(self._dirty))  # no host read: either booking counts

    def update(self) -> None:
        """Advance the history with the step's (already reduced) pending amax and recompute the scale."""
        advance_histories([self])

    def traced_tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors the traced layer step takes for this state (its recipe's ``traced_cast`` reads them)."""
        return self.scale, self.pending_amax, self.last_amax, self.nonfinite_count, self.flags

    # -- persistence ----------------------------------------------------------------------------------------

    _TENSORS = ("scale", "amax_history", "pending_amax", "last_amax", "nonfinite_count")

    def state_dict(self) -> dict:
        out = {name: getattr(self, name).detach().cpu().clone() for name in self._TENSORS}
        out["observed"] = self.observed.cpu()
        out["initialized"] = self.initialized
        return out

    def load_state_dict(self, state: dict) -> None:
        device = self.scale.device
        for name in self._TENSORS:
            value = state[name]
            if value.shape != getattr(self, name).shape:
                raise ValueError(
                    f"Scaling state '{name}' has shape {tuple(value.shape)} in the checkpoint but "
                    f"{tuple(getattr(self, name).shape)} here: was the recipe (amax_history_len) changed?"
                )
            setattr(self, name, value.to(device=device, dtype=getattr(self, name).dtype).clone())
        self.initialized = bool(state["initialized"])
        self.dirty = bool(state["observed"].item() > 0)

    def move_to(self, device: torch.device) -> None:
        """Keep the state on the device of the tensors it scales (moved once, on first use there)."""
        if self.scale.device != device:
            for name in (*self._TENSORS, "flags"):
                setattr(self, name, getattr(self, name).to(device))


# --------------------------------------------------------------------------------------------------------
# Once per step, for all operands of a model
# --------------------------------------------------------------------------------------------------------


def max_across(amax: torch.Tensor, group: "dist.ProcessGroup | None" = None) -> tuple[torch.Tensor, bool]:
    """(the elementwise max of ``amax`` over the ranks of ``group``, whether a collective ran): one MAX all-reduce,
    none without a process group of several ranks. A NaN is sent as inf, so that MAX carries it to every rank (NaN
    compares false)."""
    amax = torch.nan_to_num(amax, nan=float("inf"), posinf=float("inf"))  # posinf: nan_to_num's default is finite
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        return amax, True
    return amax, False


def agreed_amax(x: torch.Tensor, group: "dist.ProcessGroup") -> torch.Tensor:
    """max |x| over the shards of a tensor held by the ranks of ``group`` (float32 scalar), NaN carried as inf."""
    return max_across(dispatch.fast_amax(x), group)[0]


def bind_layer_name(operands: dict, name: str | None) -> None:
    """Hand each state among ``operands`` that draws random numbers (``bind_name``: NVFP4's stochastic rounding) the
    name of its layer and role, so that layers draw independent noise, alike on every rank and in every run."""
    if name is None:
        return
    bound = set()
    for role, state in operands.items():
        bind = getattr(state, "bind_name", None)
        if bind is not None and id(state) not in bound:
            bound.add(id(state))
            bind(f"{name}:{role}")


def records_amax(training: bool) -> bool:
    """Whether a cast books its amax and moves its scaling state: in training, and never under
    ``torch.inference_mode()``, which is evaluation whatever the module's mode (its tensors cannot be kept).
    A compiled graph cannot ask for inference mode (dynamo refuses the call); there the module's mode decides."""
    return training and (torch.compiler.is_compiling() or not torch.is_inference_mode_enabled())


def update_scales(states: Iterable[OperandScaling], group: "dist.ProcessGroup | None" = None) -> int:
    """Reduce the step's pending amaxes across ranks (MAX, one all-reduce) and advance every delayed state.

    ``states`` must be listed in the same order on every rank (iterate the model's modules). Returns the number
    of collectives issued (0 or 1), which tests use to check the coalescing.
    """
    delayed = [s for s in states if s.delayed]
    if not delayed:
        return 0
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if world == 1 or not any(s.recipe.reduce_amax for s in delayed):
        advance_histories(delayed)
        return 0
    device = delayed[0].pending_amax.device
    packed = torch.stack([torch.stack([s.pending_amax.to(device), s.observed.to(device)]) for s in delayed])
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    advance_histories(delayed, packed[:, 0], packed[:, 1])
    return 1


def advance_histories(
    states: list[OperandScaling], pending: torch.Tensor | None = None, observed: torch.Tensor | None = None
) -> None:
    """Push each delayed state's pending amax into its history and recompute its scale, all states at once.

    ``pending``/``observed`` (one entry per state) override the states' own values, e.g. after the cross-rank
    reduction. States that saw no amax this step keep their history and scale. States are batched per
    (recipe, device): a handful of tensor operations for a whole model, E4M3 and E5M2 operands together.
    """
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(states):
        if s.delayed:
            groups.setdefault((s.recipe, s.scale.device, s.amax_history.shape[0]), []).append(i)
    for (recipe, device, _), index in groups.items():
        members = [states[i] for i in index]
        flags = torch.stack([s.flags for s in members])  # (initialized, observed by a traced cast)
        if pending is None:
            step_amax = torch.stack([s.pending_amax for s in members])
            seen = torch.tensor([s._dirty for s in members], device=device) | (flags[:, 1] > 0)
        else:
            rows = torch.tensor(index, device=pending.device)
            step_amax, seen = pending[rows].to(device), observed[rows].to(device) > 0
        history = torch.stack([s.amax_history for s in members])
        prev_scale = torch.stack([s.scale for s in members])
        max_value = torch.tensor([fp8_max(s.dtype) for s in members], device=device)  # each operand's format
        history = torch.where(seen.unsqueeze(-1), roll_history(history, step_amax), history)
        fresh = delayed_scale(
            history, prev_scale, max_value, recipe.margin, recipe.amax_compute_algo, recipe.power_of_2_scales
        )
        scale = torch.where(seen, fresh, prev_scale)
        zeros = torch.zeros_like(step_amax)
        flags[:, 1] = 0.0
        for s, h, sc, z, f in zip(members, history.unbind(0), scale.unbind(0), zeros.unbind(0), flags.unbind(0)):
            s.amax_history, s.scale, s.pending_amax, s.flags = h, sc, z, f
            s._dirty = False
            s.generation += 1


def _kernel_cache(inverse: torch.Tensor, transposed: torch.Tensor | None) -> OperandCache:
    """What a CUDA cast kernel wrote besides the codes: ``1 / scale`` and, when asked, the transposed codes."""
    return OperandCache(inverse=inverse, transposed=transposed)
