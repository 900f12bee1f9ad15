"""Model-level operations: convert ``nn.Linear`` layers to FP8 in place, and save/sync their scaling state.

``convert_to_fp8(model)`` walks the model and turns every eligible ``nn.Linear`` into an
:class:`~fp8_lightning.linear.FP8Linear` (transformers' ``Conv1D`` into an
:class:`~fp8_lightning.conv1d.FP8Conv1D`, and fused 3-D expert modules into their FP8 class,
:mod:`fp8_lightning.grouped.experts`) *in place* (the same module object, the same parameters), so
optimizers, DDP wrappers and other references created before the conversion stay valid, and the model's
``state_dict`` is unchanged. It returns a :class:`ConversionReport` that names every converted layer and every
skipped one with its reason, including modules of other types that hold a 2-D weight. Calling it again is
harmless (it reports the same layers, with an updated recipe).

The scaling state (histories, scales, fallback decisions) lives outside the ``state_dict``
(:mod:`fp8_lightning.saved_state` carries it in checkpoints); :func:`sync_scales` runs the once-per-step amax
reduction and scale update for the whole model.
"""

from __future__ import annotations

import dataclasses
import types
import warnings
from typing import Callable, Iterator

import torch.distributed as dist
import torch.nn as nn

from fp8_lightning.conv1d import FP8Conv1D, is_conv1d
from fp8_lightning.grouped.experts import (
    FP8ExpertsMixin,
    convert_experts,
    expert_weights,
    experts_skip_reason,
    holds_3d_weight,
)
from fp8_lightning.linear import FP8Linear, shape_unsupported_reason
from fp8_lightning.capability_table import warn_if_not_native
from fp8_lightning.policy import POLICY_SKIP, Choice, LayersLike, RecipePolicy
from fp8_lightning.profitability import ProfitabilityLike, model_top_k, resolve_gate
from fp8_lightning.recipes import RecipeLike, recipe_from
from fp8_lightning.saved_state import ROUTER_MARK
from fp8_lightning.saved_state import (  # noqa: F401  (the saved-state functions, importable from here as before)
    check_fp8_state,
    fp8_state_checksum,
    fp8_state_dict,
    load_fp8_state_dict,
    restart_gradient_scales,
    scaled_modules,
)
from fp8_lightning.scaling import OperandScaling, bind_layer_name, update_scales

ModuleFilter = Callable[[nn.Module, str], bool]


@dataclasses.dataclass
class ConversionReport:
    """What :func:`convert_to_fp8` did: converted layer names, skipped ones with the reason, each converted layer's
    and experts module's recipe with why it got it (``recipes``: name -> ``"<recipe name> (<why>)"``); the fused
    expert modules (``experts``, ``experts_skipped``, which also names any other module holding a 3-D weight), and
    the routers of mixtures of experts, kept in high precision by design (``routers``: transformers' ``*TopKRouter``
    modules, and each linear layer that :func:`linear_routers` finds beside a fused experts module)."""

    converted: list[str] = dataclasses.field(default_factory=list)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    recipes: dict[str, str] = dataclasses.field(default_factory=dict)
    experts: list[str] = dataclasses.field(default_factory=list)
    experts_skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    routers: list[str] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"FP8 conversion: {len(self.converted)} layer(s) converted, {len(self.skipped)} skipped"]
        if self.experts or self.experts_skipped:
            lines[0] += f"; {len(self.experts)} expert module(s) converted, {len(self.experts_skipped)} skipped"
        lines += [f"  {name}: {self.recipes[name]}" for name in self.converted if name in self.recipes]
        lines += [f"  skipped {name}: {reason}" for name, reason in self.skipped.items()]
        lines += [f"  experts converted: {name}" + (f": {self.recipes[name]}" if name in self.recipes else "")
                  for name in self.experts]
        lines += [f"  experts skipped {name}: {reason}" for name, reason in self.experts_skipped.items()]
        lines += [f"  router kept in high precision: {name}" for name in self.routers]
        return "\n".join(lines)


def convert_to_fp8(
    module: nn.Module,
    recipe: RecipeLike = None,
    module_filter_fn: ModuleFilter | None = None,
    emulate: bool = False,
    profitability: ProfitabilityLike = None,
    layers: LayersLike = None,
) -> ConversionReport:
    """Swap eligible ``nn.Linear`` layers and fused expert modules of ``module`` (the module itself included) to
    FP8, in place. Routers stay in high precision (:func:`linear_routers`), unless ``layers`` names one itself.

    Args:
        recipe: the scaling recipe (object, name or dict); ``DelayedScaling()`` by default.
        module_filter_fn: ``fn(module, fully_qualified_name) -> bool``; layers for which it returns False stay
            as they are: in high precision, or in FP8 where an earlier call converted them (the report says so).
        emulate: allow FP8 numerics emulated in float32 on CUDA devices without FP8 tensor cores.
        profitability: keep layers too small to gain from FP8 in high precision
            (:mod:`fp8_lightning.profitability`): ``"auto"`` (the default, also for None) gates layers on CUDA
            and converts every eligible layer on CPU; True, False, or a ``ProfitabilityGate(tokens=...)``.
        layers: per-layer recipes (:mod:`fp8_lightning.policy`) for linear layers and experts modules alike:
            ``{pattern: recipe or None, "first": n, "last": n}``, a callable ``fn(name, module)`` or a
            :class:`~fp8_lightning.policy.RecipePolicy`, on top of the recipe's own default (NVFP4: the last 15% of
            the repeated blocks in high precision). The report names each layer's recipe and why.

    Returns:
        A :class:`ConversionReport`: converted layers and experts, and each one left in high precision with the
        reason (``print(report)`` lists them).

    Raises:
        ValueError: an invalid recipe, ``emulate`` or ``profitability`` value (the message names what is allowed), or a
            layer split by a tensor-parallel style into shards its recipe cannot scale (the message names the fix).
    """
    if not isinstance(emulate, bool):  # bool("false") is True: a string must not turn emulation on
        raise ValueError(f"convert_to_fp8(emulate={emulate!r}): emulate takes True or False; got a "
                         f"{type(emulate).__name__}. Pass emulate=True or emulate=False.")
    recipe = recipe_from(recipe)
    gate = resolve_gate(profitability)
    report = ConversionReport()
    candidates = [name for name, child in module.named_modules()
                  if linear_features(child) is not None or expert_weights(child) is not None]
    policy = RecipePolicy.from_arg(layers, recipe)
    choices = policy.resolve(module, candidates, recipe)
    routers = linear_routers(module)
    _warn_unsure_routers(routers, choices)
    for name, child in module.named_modules():
        if _convert_experts(child, name or "<root>", choices.get(name), module_filter_fn, emulate, report, gate,
                            module):
            continue
        features = linear_features(child)
        if features is None:
            if is_router(child):
                _keep_router(child, name or "<root>", report)
            elif holds_linear_like_weight(child):
                report.skipped[name or "<root>"] = (
                    f"{type(child).__name__} holds a 2-D weight but is not an nn.Linear (or transformers' Conv1D): "
                    "no FP8 conversion for this module type"
                )
            continue
        choice = choices[name]
        if name in routers and not isinstance(child, FP8Linear) and (not choice.explicit or choice.recipe is None):
            _keep_router(child, name, report)
            continue
        layer_recipe = choice.recipe
        reason = _skip_reason(child, name, features, layer_recipe or recipe, module_filter_fn)
        if reason is None and layer_recipe is None:
            reason = f"{POLICY_SKIP} ({choice.why})"
        if reason is None and gate is not None and not isinstance(child, FP8Linear):
            shape = types.SimpleNamespace(weight=child.weight, in_features=features[0], out_features=features[1])
            reason = gate.skip_reason(shape, layer_recipe)
        if reason is not None:
            if isinstance(child, FP8Linear):  # converted by an earlier call: say that it stays FP8
                reason = f"left in FP8 as an earlier conversion made it ({child.fp8_recipe.name}); {reason}"
            report.skipped[name or "<root>"] = reason
            continue
        parallel = child.__dict__.get("fp8_tensor_parallel")  # split by an FP8 tensor-parallel style
        if parallel is not None:
            parallel.check(child, layer_recipe, name)
        if is_conv1d(child) or isinstance(child, FP8Conv1D):
            FP8Conv1D.from_conv1d(child, layer_recipe, emulate)
        else:
            FP8Linear.from_linear(child, layer_recipe, emulate)
        report.converted.append(name or "<root>")
        report.recipes[name or "<root>"] = f"{layer_recipe.name} ({choice.why})"
    warned = set()
    for name in report.converted + report.experts:  # once per recipe and device: where its GEMMs fall back, say so
        layer = module.get_submodule(name) if name != "<root>" else module
        if layer.fp8_recipe not in warned:
            warned.add(layer.fp8_recipe)
            device = gate.device if gate is not None and gate.device is not None else next(layer.parameters()).device
            warn_if_not_native(layer.fp8_recipe, device)
    bind_layer_names(module)
    return report


def bind_layer_names(module: nn.Module) -> None:
    """Each converted module learns its name in ``module`` (``fp8_layer_name``), which seeds the random numbers of
    its scaling states (:func:`~fp8_lightning.scaling.bind_layer_name`), those made later included."""
    for name, layer in scaled_modules(module):
        layer.fp8_layer_name = name
        for _, scaling in layer.fp8_scalings():
            bind_layer_name(scaling.operands, name)


def _convert_experts(
    child: nn.Module, name: str, choice: Choice | None, module_filter_fn: ModuleFilter | None, emulate: bool,
    report: ConversionReport, gate=None, model: nn.Module | None = None,
) -> bool:
    """Convert (or report) a fused experts module under the recipe the layer policy chose for it (``choice``), or
    name a module with a 3-D weight left alone; True when ``child`` was such a module. ``model`` (holding ``child``
    as ``name``) tells the gate the experts per token."""
    if expert_weights(child) is None:
        if holds_3d_weight(child):
            report.experts_skipped[name] = (
                f"{type(child).__name__} holds a 3-D weight but is not a fused experts module this library knows "
                "(transformers' use_experts_implementation experts, fp8_lightning.GroupedExperts): no FP8 conversion"
            )
        return holds_3d_weight(child)
    recipe = choice.recipe
    if module_filter_fn is not None and not module_filter_fn(child, name):
        reason = "excluded by module_filter_fn"
    elif recipe is None:
        reason = f"{POLICY_SKIP} ({choice.why})"
    else:
        reason = experts_skip_reason(child, recipe)
    if reason is None and gate is not None and not isinstance(child, FP8ExpertsMixin):
        top_k = model_top_k(model, name) if model is not None else None
        reason = gate.experts_skip_reason(next(child.parameters()).device, recipe, child, top_k)
    if reason is not None:
        if isinstance(child, FP8ExpertsMixin):
            reason = f"left in FP8 as an earlier conversion made it ({child.fp8_recipe.name}); {reason}"
        report.experts_skipped[name] = reason
    else:
        convert_experts(child, recipe, emulate)
        report.experts.append(name)
        report.recipes[name] = f"{recipe.name} ({choice.why})"
    return True


def _keep_router(router: nn.Module, name: str, report: ConversionReport) -> None:
    """Keep a router in high precision, marked so that a checkpoint holding its FP8 state from a run that converted
    it still loads (:func:`~fp8_lightning.saved_state.load_fp8_state_dict` then sets that state aside)."""
    setattr(router, ROUTER_MARK, True)
    report.routers.append(name)


def is_router(module: nn.Module) -> bool:
    """The router of a mixture of experts (transformers' ``*TopKRouter`` / ``*TopkRouter``): a 2-D weight whose
    scores pick the experts, kept in high precision."""
    return holds_linear_like_weight(module) and type(module).__name__.lower().endswith("topkrouter")


def linear_routers(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """The routers of hand-written mixtures of experts: each ``nn.Linear`` (or ``Conv1D``) beside a fused experts
    module (a child of the same parent, or a child of such a child: torchtitan's ``router.gate``) that maps the
    experts' input width to one score per expert (``in_features`` = the experts' model dimension, ``out_features`` =
    their number), with the other layers there that fit as well (several: which one routes is unknown, and all stay
    in high precision). Kept in high precision unless the layer policy names them itself
    (:attr:`~fp8_lightning.policy.Choice.explicit`)."""
    routers = {}
    for parent_name, parent in model.named_modules():
        shapes = set()  # (model dimension, experts) of the experts modules in this parent
        for child in parent.children():
            weights = expert_weights(child)
            if weights is not None:
                first, stored_kn = next(iter(weights.items()))
                weight = getattr(child, first)
                shapes.add((weight.shape[1] if stored_kn else weight.shape[2], weight.shape[0]))
        if not shapes:
            continue
        prefix = f"{parent_name}." if parent_name else ""
        nearby = [(name, child) for name, child in parent.named_children() if expert_weights(child) is None]
        nearby += [(f"{name}.{inner}", grandchild) for name, child in nearby  # torchtitan: router.gate
                   for inner, grandchild in child.named_children()]  # fmt: skip
        fits = tuple(prefix + name for name, child in nearby if linear_features(child) in shapes)
        routers.update((name, fits) for name in fits)
    return routers


def _warn_unsure_routers(routers: dict[str, tuple[str, ...]], choices: dict[str, Choice]) -> None:
    """Say where several layers fit one router and the layer policy named none of them."""
    for fits in dict.fromkeys(routers.values()):
        if len(fits) > 1 and not any(choices[name].explicit for name in fits):
            warnings.warn(
                f"{list(fits)} each map the experts' input to one score per expert: which one is the router is "
                "unknown, so all stay in high precision. Convert those that are not routers by naming them in the "
                "layer policy: layers={'<name>': '<recipe>'} (convert_to_fp8 or FP8Precision)."
            )


def linear_features(module: nn.Module) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of a layer conversion handles (``nn.Linear``, its subclasses, which are
    then refused with a reason, and transformers' ``Conv1D``), else None."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if is_conv1d(module):
        return module.nx, module.nf
    return None


_NOT_LINEAR_LIKE = (nn.Embedding, nn.EmbeddingBag)  # 2-D weights that are tables, not GEMM operands


def holds_linear_like_weight(module: nn.Module) -> bool:
    """A module of another type with a 2-D ``weight`` parameter of its own (a custom linear layer, say): named in
    the report, so that what stays in high precision is never silent."""
    weight = module._parameters.get("weight")
    return weight is not None and weight.dim() == 2 and not isinstance(module, _NOT_LINEAR_LIKE)


def _skip_reason(
    layer: nn.Module, name: str, features: tuple[int, int], recipe, module_filter_fn: ModuleFilter | None
) -> str | None:
    if module_filter_fn is not None and not module_filter_fn(layer, name):
        return "excluded by module_filter_fn"
    if isinstance(layer, nn.Linear) and type(layer) not in (nn.Linear, FP8Linear, FP8Conv1D):
        return f"{type(layer).__name__} is a subclass of nn.Linear with its own behaviour"
    return shape_unsupported_reason(*features, recipe)


def fp8_modules(module: nn.Module) -> Iterator[tuple[str, FP8Linear]]:
    """Converted layers with their names, in module order (the same order on every rank).

    Args:
        module: the model.

    Returns:
        An iterator of ``(name, FP8Linear)``.
    """
    for name, child in module.named_modules():
        if isinstance(child, FP8Linear):
            yield name, child


def fp8_expert_modules(module: nn.Module) -> Iterator[tuple[str, FP8ExpertsMixin]]:
    """Converted fused experts modules with their names, in module order."""
    for name, child in module.named_modules():
        if isinstance(child, FP8ExpertsMixin):
            yield name, child


def operand_states(module: nn.Module) -> list[OperandScaling]:
    """Every per-tensor scaling state of the model, in a deterministic order."""
    states = []
    for _, layer in scaled_modules(module):
        for _, scaling in layer.fp8_scalings():
            states.extend(scaling.operands.values())
    return states


def sync_scales(module: nn.Module, group: "dist.ProcessGroup | None" = None) -> int:
    """Once per optimizer step: reduce amaxes across ranks in one collective and advance every delayed scale.

    Args:
        module: the model holding converted layers.
        group: the process group the amaxes agree over (default: the world, when distributed is initialized).

    Returns:
        The number of collectives issued (0 or 1).
    """
    return update_scales(operand_states(module), group)
