"""What the Trainer and the Fabric FP8 precision plugins share: conversion, the forward context, the per-step
work around the optimizer step, and the checkpointed state.

The design in full: ``docs/design/notes.md``, section ``fp8_lightning.lightning.plugin_base``.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, ContextManager

import torch
import torch.nn as nn
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn

from fp8_lightning.autocast import fp8_autocast
from fp8_lightning.convert import (
    ConversionReport,
    convert_to_fp8,
    fp8_expert_modules,
    fp8_modules,
    scaled_modules,
    check_fp8_state,
    fp8_state_checksum,
    fp8_state_dict,
    load_fp8_state_dict,
    ModuleFilter,
    operand_states,
    restart_gradient_scales,
    sync_scales,
)
from fp8_lightning.guard import DivergenceGuard, GuardEvent, GuardState
from fp8_lightning.lightning.strings import precision_for_recipe
from fp8_lightning.recipes import Recipe, RecipeLike, recipe_from
from fp8_lightning.policy import POLICY_SKIP, LayersLike, RecipePolicy
from fp8_lightning.profitability import GATE_FIX
from fp8_lightning.stats import attach_collector

# sha256 of the rest of the plugin's checkpoint entry (fp8_lightning.saved_state.fp8_state_checksum)
CHECKSUM_KEY = "checksum"
PLUGIN_CONVERTED = "fp8_converted_by_plugin"  # marks layers a plugin converted (the user's own keep their recipe)
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "16": torch.float16,
}  # fmt: skip


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``None`` (device default), a torch dtype, or its name (``"bf16"``, ``"float32"``, ...)."""
    if dtype is None:
        return None
    if isinstance(dtype, str) and dtype.strip().lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.strip().lower().removeprefix("torch.")]
    if dtype in (torch.float32, torch.bfloat16, torch.float16):
        return dtype
    raise ValueError(
        f"dtype={dtype!r} is invalid for the non-FP8 parts; allowed: None (bf16 autocast on CUDA, float32 on "
        "CPU), torch.float32, torch.bfloat16, torch.float16 or their names."
    )


_TRUE_STRINGS, _FALSE_STRINGS = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def strict_bool(value: Any, owner: str, name: str) -> bool:
    """A flag given as a bool (or 0/1), or as a string of one ("true"/"false", "1"/"0", "yes"/"no", "on"/"off", any
    case: YAML and command lines pass strings); anything else is refused, since ``bool("false")`` is True."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE_STRINGS + _FALSE_STRINGS:
        return value.strip().lower() in _TRUE_STRINGS
    raise ValueError(
        f"{owner}({name}={value!r}): {name} takes True or False (or the strings 'true'/'false'); got a "
        f"{type(value).__name__}. Pass {name}=True or {name}=False."
    )


def autocast_contexts(dtype: torch.dtype | None) -> list[ContextManager]:
    """torch autocast contexts for the high-precision parts. Autocast for a device type only affects ops on that
    device, so enabling CUDA's on a machine with a GPU leaves a CPU run in float32."""
    cuda = torch.cuda.is_available()
    if dtype is None:
        return [torch.autocast("cuda", dtype=torch.bfloat16)] if cuda else []
    if dtype == torch.float32:
        return []
    contexts = [torch.autocast("cpu", dtype=dtype)]
    return contexts + ([torch.autocast("cuda", dtype=dtype)] if cuda else [])


class FP8PrecisionMixin:
    """FP8 behaviour shared by :class:`~fp8_lightning.lightning.precision.FP8Precision` and
    :class:`~fp8_lightning.lightning.fabric.FP8FabricPrecision` (see the module docstring)."""

    precision: str = "fp8"

    def __init__(
        self,
        recipe: RecipeLike = None,
        module_filter_fn: ModuleFilter | None = None,
        dtype: torch.dtype | str | None = None,
        replace_layers: bool = True,
        emulate: bool = False,
        divergence_guard: DivergenceGuard | bool | dict | None = None,
        layers: LayersLike = None,
    ) -> None:
        super().__init__()  # the package's Precision base, next in the MRO
        self.recipe = recipe_from(recipe)
        RecipePolicy.from_arg(layers, self.recipe)  # fail fast on a bad policy
        self.layers = layers
        self.module_filter_fn = module_filter_fn
        self.dtype = parse_dtype(dtype)
        self.replace_layers = strict_bool(replace_layers, type(self).__name__, "replace_layers")
        self.emulate = strict_bool(emulate, type(self).__name__, "emulate")
        self.divergence_guard = DivergenceGuard.from_arg(divergence_guard)
        self.guard_state = GuardState(self.divergence_guard) if self.divergence_guard else None
        self.precision = precision_for_recipe(self.recipe)
        self.conversion_report: ConversionReport | None = None
        self.amax_reduction_group = None  # None: the default (world) group; a strategy may narrow it
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self._modules: list[weakref.ReferenceType] = []
        self._pending_state: dict | None = None
        self.checkpoint_path: str | None = None  # the checkpoint being resumed, when a caller knows it (errors name it)
        self._loaded_fp8_state = False

    # -- conversion -----------------------------------------------------------------------------------------

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Convert ``module``'s eligible ``nn.Linear`` layers and fused experts modules to FP8 in place (idempotent)
        and return it."""
        before = {name or "<root>": layer.fp8_recipe for name, layer in scaled_modules(module)}
        # layers and experts the user converted keep their recipe; those an FP8 plugin converted take this plugin's
        users = {name for name, layer in scaled_modules(module) if not getattr(layer, PLUGIN_CONVERTED, False)}
        if self.replace_layers:
            user_filter = self.module_filter_fn

            def keep(layer: nn.Module, name: str) -> bool:
                return name not in users and (user_filter is None or user_filter(layer, name))

            report = convert_to_fp8(module, self.recipe, keep, self.emulate, layers=self.layers)
            report.skipped = {k: v for k, v in report.skipped.items() if k not in before}
            report.experts_skipped = {k: v for k, v in report.experts_skipped.items() if k not in before}
            now = {name or "<root>": layer for name, layer in scaled_modules(module)}
            for name in report.converted + report.experts:
                setattr(now[name], PLUGIN_CONVERTED, True)
            self._warn_recipe_change(before, report.converted + report.experts, now)
        else:
            report = ConversionReport()
        report.converted = [name or "<root>" for name, _ in fp8_modules(module)]
        report.experts = [name or "<root>" for name, _ in fp8_expert_modules(module)]
        previous = self.conversion_report
        if previous is None or (report.converted, report.experts) != (previous.converted, previous.experts):
            headline, _, skipped = str(report).partition("\n")
            context = f" (recipe {type(self.recipe).__name__}, precision {self.precision!r})"
            rank_zero_info(headline + context + ("\n" + skipped if skipped else ""))
        if not report.converted and not report.experts:
            rank_zero_warn(
                f"FP8 conversion converted no layer of {type(module).__name__}: it trains entirely in high precision "
                f"under precision {self.precision!r}. FP8 applies to nn.Linear layers (and transformers' Conv1D) "
                "with both dimensions divisible by 16 (32 for MXFP8) and to fused experts modules, unless the layer "
                "policy (layers=) or the profitability gate (profitability=False turns it off) keeps them in high "
                "precision; the conversion report lists what it skipped and why."
            )
        self.conversion_report = report
        check_tensor_parallel_strategy(module)
        self._warn_skipped(report)
        self._track(module)
        if self.divergence_guard is not None:
            attach_collector(module).always = True
        if self._pending_state is not None:
            self._load_into_modules(self._pending_state)
        return module

    def _warn_recipe_change(self, before: dict[str, Recipe], converted: list[str], layers: dict) -> None:
        moved = [name for name in converted if name in before and before[name] != layers[name].fp8_recipe]
        if moved:
            old = sorted({type(before[name]).__name__ for name in moved})
            new = sorted({type(layers[name].fp8_recipe).__name__ for name in moved})
            rank_zero_warn(
                f"{len(moved)} layer(s) converted earlier under {', '.join(old)} now train under {', '.join(new)}, "
                f"as this plugin's recipe ({type(self.recipe).__name__}) and layer policy say: {', '.join(moved)}. "
                "Pass replace_layers=False to train them under the recipe they were converted with."
            )

    def _warn_skipped(self, report: ConversionReport) -> None:
        unexpected = {
            k: v for k, v in report.skipped.items()
            if v != "excluded by module_filter_fn" and not v.startswith(POLICY_SKIP)
        }
        gated = {k: v for k, v in unexpected.items() if v.endswith(GATE_FIX)}
        shapes = {k: v for k, v in unexpected.items() if k not in gated}
        if shapes:
            listing = "; ".join(f"{name} ({reason})" for name, reason in shapes.items())
            rank_zero_warn(
                f"FP8 conversion kept {len(shapes)} linear layer(s) in high precision: {listing}. "
                "Pad them to the required multiple or exclude them with module_filter_fn to silence this."
            )
        if gated:
            listing = "; ".join(f"{name} ({reason.removesuffix(GATE_FIX).rstrip('; ')})"
                                for name, reason in gated.items())
            rank_zero_warn(
                f"The profitability gate kept {len(gated)} linear layer(s) in high precision, FP8 being modelled no "
                f"faster there: {listing}. Pass profitability=False to the FP8 plugin to convert them anyway."
            )

    def _track(self, module: nn.Module) -> None:
        if all(ref() is not module for ref in self._modules):
            self._modules.append(weakref.ref(module))

    def fp8_tracked_modules(self) -> list[nn.Module]:
        """The modules this plugin converted (still alive), in conversion order."""
        return [m for m in (ref() for ref in self._modules) if m is not None]

    def carries_state(self) -> bool:
        """True when a checkpoint without this plugin's state would change a resumed run: a converted layer keeps
        scaling state between steps (amax histories and scales, NVFP4's random signs and rounding counter), or the
        divergence guard keeps its decisions. MXFP8, rowwise and blockwise layers compute every scale from the
        tensor being cast: without a guard, nothing of theirs needs saving."""
        return self.guard_state is not None or any(operand_states(m) for m in self.fp8_tracked_modules())

    # -- forward --------------------------------------------------------------------------------------------

    def forward_context(self) -> ContextManager:
        stack = contextlib.ExitStack()
        for ctx in autocast_contexts(self.dtype):
            stack.enter_context(ctx)
        stack.enter_context(fp8_autocast(enabled=True))
        return stack

    # -- around the optimizer step ----------------------------------------------------------------------------

    def fp8_before_optimizer_step(self, optimizer: Any) -> list[GuardEvent]:
        """Run the divergence guard on the finished step (gradients ready, weights not yet updated)."""
        if self.guard_state is None:
            return []
        events, nonfinite = [], False
        for module in self.fp8_tracked_modules():
            stats = attach_collector(module).finish_step(self.amax_reduction_group, reduce=True)
            nonfinite = nonfinite or any(s.nonfinite for s in stats.values())
            new = self.guard_state.step(self.optimizer_steps, stats)
            layers = dict(scaled_modules(module))  # converted layers and expert modules
            for event in new:
                if event.layer in layers:
                    layers[event.layer].fp8_disabled_reason = event.reason
                rank_zero_warn(
                    f"FP8 divergence guard: layer {event.layer!r} falls back to high precision: {event.reason}."
                )
            events += new
        if nonfinite and self.divergence_guard.skip_nonfinite_step:
            drop_gradients(optimizer)
            self.skipped_steps += 1
        return events

    def fp8_after_optimizer_step(self) -> int:
        """Once per optimizer step: reduce amaxes across ranks (one collective) and advance delayed scales."""
        collectives = sum(sync_scales(m, self.amax_reduction_group) for m in self.fp8_tracked_modules())
        self.optimizer_steps += 1
        return collectives

    # -- checkpoint state ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        modules = self.fp8_tracked_modules()
        if not modules:
            return dict(self._pending_state or {})
        state = {
            "precision": self.precision,
            "recipe": self.recipe.to_dict(),
            "modules": [fp8_state_dict(m) for m in modules],
            "optimizer_steps": self.optimizer_steps,
            "skipped_steps": self.skipped_steps,
            "guard": self.guard_state.state_dict() if self.guard_state is not None else None,
            "data_parallel_replicas": data_parallel_replicas(modules),
        }
        state[CHECKSUM_KEY] = fp8_state_checksum(state)
        return state

    def checkpoint_source(self) -> str | None:
        """The path of the checkpoint being loaded, when known: ``checkpoint_path`` if a caller set it, else the
        Trainer's ``ckpt_path`` (reachable through a converted LightningModule); named in every load error."""
        if self.checkpoint_path:
            return str(self.checkpoint_path)
        for module in self.fp8_tracked_modules():
            path = getattr(getattr(module, "_trainer", None), "ckpt_path", None)
            if path:
                return str(path)
        return None

    def check_state(self, state_dict: dict[str, Any]) -> None:
        """Refuse a corrupted FP8 entry before anything is restored: its checksum (when saved with one) must match,
        and every scale must be finite and positive (:func:`~fp8_lightning.saved_state.check_fp8_state`)."""
        source = self.checkpoint_source()
        where = f"checkpoint {source}" if source else "the checkpoint being loaded"
        fix = (
            f"Resume from an earlier checkpoint, or delete its {type(self).__qualname__!r} entry to restart FP8 "
            "scaling from scratch (the model weights are not affected)."
        )
        saved_checksum = state_dict.get(CHECKSUM_KEY)
        if saved_checksum is not None:
            actual = fp8_state_checksum({k: v for k, v in state_dict.items() if k != CHECKSUM_KEY})
            if actual != saved_checksum:
                raise ValueError(
                    f"The FP8 scaling state in {where} fails its checksum (saved {str(saved_checksum)[:12]}..., "
                    f"computed {actual[:12]}...): the file was corrupted or edited after saving. {fix}"
                )
        modules = state_dict.get("modules", [])
        if not isinstance(modules, list):
            raise ValueError(
                f"The FP8 scaling state in {where} has 'modules' of type {type(modules).__name__}, not a list. {fix}"
            )
        for module_state in modules:
            check_fp8_state(module_state, source)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        self._loaded_fp8_state = True
        self.check_state(state_dict)
        saved = state_dict.get("recipe")
        if saved is not None and recipe_from(saved) != self.recipe:
            rank_zero_warn(
                f"The checkpoint's FP8 scaling state was saved under {recipe_from(saved)!r}; this run trains under "
                f"{self.recipe!r}, so the saved amax histories and scales are not used: scaling starts afresh. "
                "Resume with the saved recipe to continue them."
            )
        self.optimizer_steps = int(state_dict.get("optimizer_steps", 0))
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        if self.guard_state is not None and state_dict.get("guard"):
            self.guard_state.load_state_dict(state_dict["guard"])
        if self.fp8_tracked_modules():
            self._load_into_modules(state_dict)
        else:  # loaded before the model was set up: applied by convert_module
            self._pending_state = dict(state_dict)

    def _load_into_modules(self, state: dict[str, Any]) -> None:
        modules, saved = self.fp8_tracked_modules(), state.get("modules", [])
        if len(saved) != len(modules):
            raise ValueError(
                f"The checkpoint holds FP8 scaling state for {len(saved)} module(s) but this plugin converted "
                f"{len(modules)}; set up the same models in the same order as the run that saved it."
            )
        for module, module_state in zip(modules, saved):
            load_fp8_state_dict(module, module_state, source=self.checkpoint_source())
        self._pending_state = None
        replicas, now = state.get("data_parallel_replicas"), data_parallel_replicas(modules)
        if replicas is not None and replicas != now:
            restarted = [name for module in modules for name in restart_gradient_scales(module)]
            if restarted:
                rank_zero_info(
                    f"FP8: the checkpoint was saved with {replicas} data-parallel replica(s) and this run has {now}. "
                    "Each replica's loss averages its own share of the batch, so the output gradients are scaled "
                    f"differently: the delayed gradient scales of {len(restarted)} layer(s) are made afresh from "
                    "their first backward (their amax histories continue); activation and weight scales continue "
                    "as saved."
                )

    def fp8_summary(self) -> str:
        """Conversion report and divergence-guard events, as text."""
        parts = [str(self.conversion_report) if self.conversion_report else "FP8: no module converted yet"]
        if self.guard_state is not None:
            parts.append(self.guard_state.summary())
        return "\n".join(parts)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_modules"] = []  # weak references do not pickle (spawned processes convert their own copy)
        return state


def data_parallel_replicas(modules: list[nn.Module]) -> int:
    """How many data-parallel replicas train ``modules`` (each on its own share of the data): the world size over
    the tensor-parallel size of the layers an FP8 tensor-parallel plan split (1 without ``torch.distributed``)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 1
    from fp8_lightning.distributed.tp_plans import tensor_parallel_degree

    return torch.distributed.get_world_size() // max([tensor_parallel_degree(m) for m in modules] or [1])


def check_tensor_parallel_strategy(module: nn.Module) -> None:
    """Refuse layers split by an FP8 tensor-parallel plan in a Trainer whose strategy is not Lightning's
    ``ModelParallelStrategy`` (or ``fp8_fsdp``): other strategies neither build the tensor-parallel mesh nor keep
    the data-parallel replicas apart from it."""
    trainer = getattr(module, "_trainer", None)
    if trainer is None:
        return
    from lightning.pytorch.strategies import ModelParallelStrategy

    from fp8_lightning.distributed.tp_plans import tensor_parallel_layers

    split = tensor_parallel_layers(module)
    if split and not isinstance(trainer.strategy, ModelParallelStrategy):
        raise ValueError(
            f"{len(split)} layer(s) were split by an FP8 tensor-parallel plan ({', '.join(split[:3])}...) but the "
            f"Trainer's strategy is {type(trainer.strategy).__name__}. Tensor parallelism needs "
            "strategy=ModelParallelStrategy(tensor_parallel_size=..., data_parallel_size=...) or "
            "strategy=FP8FSDPStrategy(tensor_parallel_size=...), whose device_mesh['tensor_parallel'] the plan "
            "must use in configure_model."
        )


def drop_gradients(optimizer: Any) -> None:
    """Set every gradient the optimizer would use to None: torch optimizers then skip those parameters."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None
