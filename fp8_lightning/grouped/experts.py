"""Fused expert modules in FP8, converted in place: transformers' ``*Experts`` and our :class:`GroupedExperts`.

A fused experts module holds each projection of all its experts as one 3-D parameter. Conversion swaps the module's
class for a subclass whose projections run :func:`~fp8_lightning.grouped.gemm.fp8_grouped_mm` inside
:func:`~fp8_lightning.autocast.fp8_autocast` (the same object, the same parameters, so the ``state_dict`` is
unchanged and checkpoints load into the plain model and back). Outside it, or with FP8 disabled for the module, the
original forward runs.

transformers 5.x experts (``use_experts_implementation``: Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3, gpt-oss, ...) store
``gate_up_proj`` / ``up_proj`` and ``down_proj`` as (E, out, in), or (E, in, out) where ``is_transposed``; their FP8
forward is transformers' grouped-mm forward with the projections in FP8. The router stays in high precision.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import sys
import warnings
import weakref
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from fp8_lightning.autocast import autocast_state
from fp8_lightning.grouped.gemm import GroupedScaling, check_grouped_shapes, fp8_grouped_mm
from fp8_lightning.grouped.traced import recipe_key, traced_grouped_mm
from fp8_lightning.linear import GATHERED_IN_FP8
from fp8_lightning.recipes import Recipe
from fp8_lightning.recompute import close_on_backward, forward_setting
from fp8_lightning.scaling import bind_layer_name, records_amax

# torch 2.11's compiler traces the experts' step into one graph but the compiled step drifts from the eager one from
# the second step on (measured with tests/perf/test_compile_experts.py under torch 2.11; 2.13 matches bit for bit):
# there the experts run eagerly between graphs.
_TRACE_REFUSED = (
    None if tuple(int(part) for part in str(torch.__version__).split(".")[:2]) >= (2, 12) else
    f"torch {torch.__version__}: the traced expert step does not reproduce the eager one before torch 2.12"
)


def high_precision_grouped_mm(x: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(x, b, offs)`` where the device runs it for the dtype (CPU: float32, bf16, fp16; CUDA:
    bf16), else one GEMM per group (float64 on CPU)."""
    if x.dtype == torch.bfloat16 or (x.is_cpu and x.dtype in (torch.float32, torch.float16)):
        y = torch._grouped_mm(x.contiguous(), b.to(x.dtype), offs)
        if y.requires_grad:  # its backward refuses the expanded (stride-0) gradient of y.sum() (torch 2.11, 2.13 CPU)
            y.register_hook(torch.Tensor.contiguous)
        return y
    out, start = x.new_zeros(x.shape[0], b.shape[2]), 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ b[e].to(x.dtype)
        start = end
    return out


# Under torch.compile the high-precision grouped GEMMs run eagerly between graphs: the compiler's grouped GEMM takes
# bf16 only. The FP8 ones trace into the graph (fp8_lightning.grouped.traced) except where they cannot (an observer
# watches each cast in Python, the weight arrives gathered in FP8, or the recipe says why it cannot be traced).
_high_precision_island = torch.compiler.disable(high_precision_grouped_mm, reason="grouped GEMM of the experts in "
                                                "high precision (the compiler's grouped GEMM takes bf16 only)")


_ISLANDS: dict[str, Callable] = {}  # reason -> fp8_grouped_mm disabled for the compiler with that reason


def fp8_grouped_island(reason: str) -> Callable:
    """``fp8_grouped_mm`` run eagerly between graphs under torch.compile; ``reason`` is what fullgraph=True reports.
    Made once per reason, outside any trace (kept here, not on the modules, which stay picklable)."""
    if reason not in _ISLANDS:
        _ISLANDS[reason] = torch.compiler.disable(fp8_grouped_mm, reason=f"FP8 experts run between graphs: {reason}")
    return _ISLANDS[reason]


_OBSERVED_ISLAND = fp8_grouped_island("an observer watches each cast")
_GATHERED_REASON = "FP8 experts run between graphs: FSDP2 gathers their weights in FP8"
if _TRACE_REFUSED is not None:
    fp8_grouped_island(_TRACE_REFUSED)  # made here, outside any trace


class GroupedExperts(nn.Module):
    """SwiGLU experts with fused 3-D weights (torchtitan's layout), for a mixture of experts written by hand.

    ``w1`` and ``w3`` are (E, hidden_dim, dim), ``w2`` is (E, dim, hidden_dim): each ``w[e]`` is expert ``e``'s weight
    as an ``nn.Linear`` holds it. ``forward(x, offs)`` takes the tokens sorted by expert and the int32 cumulative
    end row of each expert's group (``torch._grouped_mm``'s ``offs``).
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.w1, self.w2, self.w3):
            nn.init.trunc_normal_(w, std=1.0 / math.sqrt(w.shape[-1]))

    def project(self, x: torch.Tensor, name: str, offs: torch.Tensor) -> torch.Tensor:
        """``x_e @ w[e].T`` for each expert's group of rows."""
        run = _high_precision_island if torch.compiler.is_compiling() else high_precision_grouped_mm
        return run(x, getattr(self, name).transpose(-2, -1), offs)

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return self.project(F.silu(self.project(x, "w1", offs)) * self.project(x, "w3", offs), "w2", offs)


def is_transformers_experts(module: nn.Module) -> bool:
    """A transformers fused experts module (decorated with ``use_experts_implementation``)."""
    down = module._parameters.get("down_proj")
    return (
        down is not None and down.dim() == 3 and hasattr(module, "is_transposed") and hasattr(module, "has_gate")
        and callable(getattr(module, "_apply_gate", None))
    )


def expert_weights(module: nn.Module) -> dict[str, bool] | None:
    """The fused projections of a known experts module, each with whether it is stored (E, in, out), or None."""
    if isinstance(module, GroupedExperts):
        return {"w1": False, "w3": False, "w2": False}
    if is_transformers_experts(module):
        first = "gate_up_proj" if module.has_gate else "up_proj"
        return {first: bool(module.is_transposed), "down_proj": bool(module.is_transposed)}
    return None


def holds_3d_weight(module: nn.Module) -> bool:
    """A module with a 3-D parameter of its own: named in the conversion report when it is not converted."""
    return any(p is not None and p.dim() == 3 for p in module._parameters.values())


class ExpertsScaling:
    """The scaling state of an experts module for one recipe: one :class:`GroupedScaling` per fused projection,
    presented as one layer's state (``operands`` keyed ``"<projection>/<role>"``)."""

    def __init__(self, recipe: Recipe, projections: dict[str, int]):
        self.recipe = recipe
        self.parts = {name: GroupedScaling(recipe, experts) for name, experts in projections.items()}
        reason = recipe.traced_grouped_unsupported_reason()
        if reason is not None:
            fp8_grouped_island(reason)  # made here, outside any trace
        self.key = recipe_key(recipe)  # the recipe as the traced step's ops take it

    @property
    def operands(self) -> dict:
        return {f"{name}/{role}": s for name, part in self.parts.items() for role, s in part.operands.items()}

    @property
    def dirty(self) -> bool:
        return any(part.dirty for part in self.parts.values())

    @property
    def weight_casts(self) -> int:
        return sum(part.weight_casts for part in self.parts.values())

    @property
    def gemms(self) -> collections.Counter:
        """Grouped FP8 GEMMs run by kind, over the projections."""
        return sum((part.gemms for part in self.parts.values()), collections.Counter())

    def update(self) -> None:
        for part in self.parts.values():
            part.update()

    def state_dict(self) -> dict:
        return {"recipe": self.recipe.to_dict(), "operands": {k: s.state_dict() for k, s in self.operands.items()},
                "experts": {name: part.experts for name, part in self.parts.items()}}

    def check_experts(self, state: dict, layer: str) -> None:
        """Refuse (``ValueError`` naming ``layer`` and both counts) a saved state whose projections hold another number
        of experts; a state saved without the counts tells them by its ``"<projection>/weight.<e>"`` entries."""
        saved = dict(state.get("experts") or {})
        for key in () if "experts" in state else state.get("operands", {}):
            name, _, role = key.partition("/")
            if role.startswith("weight.") and role[7:].isdigit():
                saved[name] = max(saved.get(name, 0), int(role[7:]) + 1)
        for name, part in self.parts.items():
            if saved.get(name, part.experts) != part.experts:
                raise ValueError(
                    f"The FP8 scaling state of {layer} was saved for {saved[name]} experts ({name}) but this module "
                    f"holds {part.experts}: per-expert scales cannot be matched. Load it into a model with "
                    f"{saved[name]} experts, or leave this layer's FP8 state out to restart its scaling."
                )

    def load_state_dict(self, state: dict) -> None:
        self.check_experts(state, "this experts module")
        for name, part in self.parts.items():
            prefix = f"{name}/"
            part.load_state_dict({"operands": {k[len(prefix):]: v for k, v in state["operands"].items()
                                               if k.startswith(prefix)}})


class FP8ExpertsMixin:
    """What a converted experts module adds to its class: the recipe, the scaling state, and FP8 projections."""

    fp8_recipe: Recipe
    fp8_emulate: bool
    fp8_disabled_reason: str | None
    fp8_weights: dict[str, bool]  # projection -> stored (E, in, out)

    def _fp8_adopt(self, recipe: Recipe, emulate: bool, weights: dict[str, bool]) -> None:
        self.fp8_recipe, self.fp8_emulate, self.fp8_weights = recipe, emulate, weights
        self.fp8_disabled_reason = getattr(self, "fp8_disabled_reason", None)
        self.fp8_observer = getattr(self, "fp8_observer", None)
        self._fp8_expert_scalings = getattr(self, "_fp8_expert_scalings", {})
        self.fp8_scaling(recipe)

    def fp8_scaling(self, recipe: Recipe | None = None) -> ExpertsScaling:
        recipe = recipe or self.fp8_recipe
        if recipe not in self._fp8_expert_scalings:
            sizes = {name: getattr(self, name).shape[0] for name in self.fp8_weights}
            self._fp8_expert_scalings[recipe] = ExpertsScaling(recipe, sizes)
            bind_layer_name(self._fp8_expert_scalings[recipe].operands, self.__dict__.get("fp8_layer_name"))
        return self._fp8_expert_scalings[recipe]

    def fp8_scalings(self) -> list[tuple[Recipe, ExpertsScaling]]:
        return sorted(self._fp8_expert_scalings.items(), key=lambda item: repr(item[0]))

    @property
    def fp8_weight_casts(self) -> int:
        return sum(s.weight_casts for s in self._fp8_expert_scalings.values())

    @property
    def fp8_gemm_counts(self) -> collections.Counter:
        """Grouped FP8 GEMMs this module ran, by kind ("fprop", "dgrad", "wgrad"), over its recipes."""
        return sum((s.gemms for s in self._fp8_expert_scalings.values()), collections.Counter())

    def fp8_stat_roles(self) -> list[str]:
        """The operands an observer sees, as statistics name them: per projection its input and output gradient
        (shared by the experts) and each expert's weight (``"down_proj.weight[3]"``)."""
        roles = []
        for name in self.fp8_weights:
            experts = getattr(self, name).shape[0]
            roles += [f"{name}.input", *(f"{name}.weight[{e}]" for e in range(experts)), f"{name}.grad_output"]
        return roles

    def fp8_active_recipe(self) -> Recipe | None:
        """The recipe a call would run under now, or None for the high-precision forward (a query: the forward
        asks :meth:`fp8_setting`, which also logs the call for activation checkpointing)."""
        return self._recipe_under(autocast_state())

    def fp8_setting(self) -> tuple[Recipe | None, bool]:
        """(:meth:`fp8_active_recipe`, whether this call is an activation-checkpoint recompute that replays the
        setting of its forward: :mod:`fp8_lightning.recompute`)."""
        state, replay = forward_setting(self, getattr(self, next(iter(self.fp8_weights))))
        return self._recipe_under(state), replay

    def _recipe_under(self, state) -> Recipe | None:
        if not state.enabled or self.fp8_disabled_reason is not None:
            return None
        if state.recipe is not None and state.recipe != self.fp8_recipe and self._fp8_misfit(state.recipe):
            return None  # an fp8_autocast(recipe=...) these experts' shapes cannot take: high precision
        return state.recipe or self.fp8_recipe

    def _fp8_misfit(self, recipe: Recipe) -> bool:
        """Whether ``recipe`` (an ``fp8_autocast`` override) cannot run these experts' shapes; said once per recipe,
        as a linear layer says it, and the experts then run in high precision."""
        misfits = self.__dict__.setdefault("_fp8_misfits", {})
        if recipe not in misfits:
            reason = experts_skip_reason(self, recipe)
            misfits[recipe] = reason is not None
            if reason is not None:
                warnings.warn(f"{type(self).__name__} converted as {self.fp8_recipe.name} runs in high precision under "
                              f"fp8_autocast(recipe={recipe.name!r}): {reason}. Leave this module out of the override, "
                              "or pad the expert dimensions.")
        return misfits[recipe]

    def fp8_project(
        self, x: torch.Tensor, name: str, offs: torch.Tensor, recipe: Recipe, replay: bool = False
    ) -> torch.Tensor:
        """Projection ``name`` of each expert's rows of ``x`` in FP8, in the autocast dtype when autocasting.
        ``replay``: an activation-checkpoint recompute, which books, counts and shows nothing (the forward it repeats
        did)."""
        weight = getattr(self, name)
        b = weight if self.fp8_weights[name] else weight.transpose(-2, -1)
        device_type = x.device.type
        autocasting = torch.is_autocast_enabled(device_type)
        out_dtype = torch.get_autocast_dtype(device_type) if autocasting else x.dtype
        experts_scaling = self.fp8_scaling(recipe)
        scaling = experts_scaling.parts[name]
        record = records_amax(self.training) and not replay
        observer = None if replay else self.__dict__.get("fp8_observer")
        observe = None if observer is None else functools.partial(_observe, weakref.ref(self), observer, name)
        gathered = hasattr(weight, "fp8_expert_operands")
        compiling = torch.compiler.is_compiling()
        if record and not compiling and not gathered and scaling.step_boundary_passed(weight) and scaling.booked:
            scaling.update()  # no one advanced the scales after the optimizer step: advance locally
        with torch.autocast(device_type, enabled=False) if autocasting else contextlib.nullcontext():
            untraced = (_TRACE_REFUSED or recipe.traced_grouped_unsupported_reason()) if compiling else None
            run = fp8_grouped_mm
            if untraced is not None:
                run = fp8_grouped_island(untraced)
            elif compiling and observer is not None:
                run = _OBSERVED_ISLAND
            elif compiling:
                check_grouped_shapes(x, b, recipe)
                return traced_grouped_mm(x.to(weight.dtype), b, offs, scaling, out_dtype, record, experts_scaling.key)
            return run(
                x.to(weight.dtype), b, offs, out_dtype=out_dtype, scaling=scaling, training=record,
                regathered=self.__dict__.get("_is_fsdp_managed_module", False),  # FSDP2 refills gathered weights
                observer=observe, replay=replay,
            )

    def fp8_gathered_under_compile(self) -> bool:
        """Whether this call is traced by torch.compile while FSDP2 gathers a weight of these experts in FP8: the
        forward then runs eagerly between graphs (a trace would see, and guard on, the gathered weight as a plain
        tensor: its dequantized copy). The mark, else the weights themselves, tell."""
        if not torch.compiler.is_compiling():
            return False
        return GATHERED_IN_FP8 in self.__dict__ or any(
            hasattr(getattr(self, name), "fp8_expert_operands") for name in self.fp8_weights)


def _observe(experts_ref: weakref.ref, observer, name: str, role: str, t: torch.Tensor, q) -> None:
    """Show a cast of projection ``name`` to the observer, while the experts module lives (the graph holds this)."""
    experts = experts_ref()
    if experts is not None:
        observer(experts, f"{name}.{role}", t, q)


class FP8GroupedExperts(FP8ExpertsMixin, GroupedExperts):
    """:class:`GroupedExperts` converted in place: its projections run in FP8 under ``fp8_autocast``."""

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        if self.fp8_gathered_under_compile():
            return self._eager_forward_island(x, offs)
        return super().forward(x, offs)

    _eager_forward_island = torch.compiler.disable(GroupedExperts.forward, reason=_GATHERED_REASON)

    def project(self, x: torch.Tensor, name: str, offs: torch.Tensor) -> torch.Tensor:
        recipe, replay = self.fp8_setting()
        if recipe is None:
            return close_on_backward(self, super().project(x, name, offs))
        return close_on_backward(self, self.fp8_project(x, name, offs, recipe, replay))


class FP8TransformersExperts(FP8ExpertsMixin):
    """transformers experts converted in place: transformers' grouped-mm forward, its projections in FP8."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if self.fp8_gathered_under_compile():
            return self._eager_forward_island(hidden_states, top_k_index, top_k_weights)
        recipe, replay = self.fp8_setting()
        if recipe is None:
            return close_on_backward(self, super().forward(hidden_states, top_k_index, top_k_weights))
        num_tokens, top_k = hidden_states.shape[0], top_k_index.shape[-1]
        expert_ids, perm = torch.sort(top_k_index.reshape(-1).to(torch.int64))  # int32 ids too, as transformers
        # ids >= num_experts: expert parallelism's sentinels, sorted last: zero rows of the last group, adding nothing
        dropped = (expert_ids >= self.num_experts).unsqueeze(-1)
        expert_ids = expert_ids.clamp(max=self.num_experts - 1)
        x = hidden_states[perm // top_k].masked_fill_(dropped, 0)  # in place: the gather made a fresh tensor
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=expert_ids.device)
        counts = counts.index_add(0, expert_ids, torch.ones_like(expert_ids))  # a static shape, unlike bincount
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        first, down = self.fp8_weights  # gate_up_proj (or up_proj), down_proj
        h = self.fp8_project(x, first, offs, recipe, replay)
        if self.has_bias:
            h = h + getattr(self, f"{first}_bias")[expert_ids]
        h = (self._apply_gate(h) if self.has_gate else self.act_fn(h)).masked_fill(dropped, 0)
        out = self.fp8_project(h, down, offs, recipe, replay)
        if self.has_bias:
            out = out + self.down_proj_bias[expert_ids]
        if self.has_post_expert_norm:
            out = self.post_expert_norm(out)
        out = out.masked_fill(dropped, 0) * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
        restored = torch.empty_like(out).index_copy_(0, perm, out)  # back to (token, k) order
        summed = restored.view(num_tokens, top_k, out.shape[-1]).sum(dim=1)
        return close_on_backward(self, summed.to(hidden_states.dtype))

    _eager_forward_island = torch.compiler.disable(forward, reason=_GATHERED_REASON)


_FP8_CLASSES: dict[type, type] = {}


def fp8_experts_class(cls: type) -> type:
    """The FP8 subclass of an experts class, made once and registered in this module (so pickle finds it)."""
    if issubclass(cls, FP8ExpertsMixin):
        return cls
    if cls is GroupedExperts:
        return FP8GroupedExperts
    if cls not in _FP8_CLASSES:
        made = type(f"FP8{cls.__name__}", (FP8TransformersExperts, cls), {"__module__": __name__})
        setattr(sys.modules[__name__], made.__name__, made)
        _FP8_CLASSES[cls] = made
    return _FP8_CLASSES[cls]


def experts_skip_reason(module: nn.Module, recipe: Recipe) -> str | None:
    """Why a known experts module cannot run in FP8 under ``recipe``, or None."""
    if getattr(module, "_is_expert_parallel", False):
        return "expert parallelism is not supported for FP8 experts; keep experts replicated or FSDP-sharded"
    for name, stored_kn in expert_weights(module).items():
        weight = getattr(module, name)
        k, n = (weight.shape[1], weight.shape[2]) if stored_kn else (weight.shape[2], weight.shape[1])
        reason = recipe.shape_unsupported_reason(k, n)
        if reason is not None:
            return f"{name} of {tuple(weight.shape)}: {reason}"
    return None


def convert_experts(module: nn.Module, recipe: Recipe, emulate: bool = False) -> nn.Module:
    """Turn a known experts module into its FP8 class in place (same object, same parameters) and return it."""
    weights = expert_weights(module)
    if weights is None:
        raise TypeError(f"{type(module).__name__} is not a fused experts module this library converts.")
    module.__class__ = fp8_experts_class(type(module))
    module._fp8_adopt(recipe, emulate, weights)
    return module


__all__ = [
    "ExpertsScaling",
    "FP8ExpertsMixin",
    "FP8GroupedExperts",
    "GroupedExperts",
    "convert_experts",
    "expert_weights",
    "experts_skip_reason",
    "holds_3d_weight",
]
