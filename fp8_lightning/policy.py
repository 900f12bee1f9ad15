"""Per-layer recipe selection: which recipe each layer trains under, or high precision, and why.

A "layer" is a linear layer (``nn.Linear``, transformers' ``Conv1D``) or a fused experts module of a mixture of
experts (:mod:`fp8_lightning.grouped.experts`): the policy treats both alike. A policy maps layers to recipes in
three ways, tried in this order (the first that decides wins):

1. **Name patterns**, in the order given: a glob (``"blocks.*.attn.*"``, matched with :func:`fnmatch.fnmatchcase`
   against the layer's fully qualified name, or naming a module the layer is inside: ``"blocks.0"`` matches
   ``blocks.0.mlp.up``) or a regular expression written ``"re:<expr>"`` (``re.fullmatch``).
2. **Positions in the stack of repeated blocks** (the model's longest ``nn.ModuleList``, or the one named by
   ``"stack"``): ``"first": n`` / ``"last": n`` keep the first / last ``n`` blocks in high precision; a float in
   (0, 1) is a fraction of the blocks, rounded up (``"last": 0.15`` of 8 blocks is 2 blocks: at least one whenever
   the fraction is positive); an experts module belongs to the block it is inside. Megatron's
   ``first_last_layers_bf16`` is ``{"first": n, "last": n}``; the NVFP4 paper keeps the last ~15% of blocks in bf16
   (:meth:`~fp8_lightning.recipes.base.Recipe.default_layers`), their experts included.
3. **The default recipe** (``convert_to_fp8(recipe=...)``).

A value is a recipe (object, name or dict) or high precision: ``None``, ``"high_precision"``, ``"bf16"``, ``"hp"``.
``layers`` may also be a callable ``fn(name, module)`` returning a recipe, high precision, or :data:`DEFAULT` (the
default recipe); it is asked for experts modules too (``isinstance(module, nn.Linear)`` tells them apart). A
pattern that matches no layer is an error (a typo would otherwise silently change nothing); one that matches
only experts modules is valid. Example::

    convert_to_fp8(model, "nvfp4", layers={"last": 0.15, "lm_head": None, "blocks.0": "mxfp8"})
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import re
from typing import Any, Callable, Mapping, Union

import torch.nn as nn

from fp8_lightning.recipes import Recipe, recipe_from

HIGH_PRECISION_NAMES = ("high_precision", "bf16", "hp", "none")
POSITION_KEYS = ("first", "last", "stack")
POLICY_SKIP = "kept in high precision by the layer policy"
DEFAULT = "default"  # a callable policy's answer for "the default recipe"

LayersLike = Union[Mapping[str, Any], Callable[[str, nn.Module], Any], "RecipePolicy", None]


def is_high_precision(value: Any) -> bool:
    """Whether a policy value means "keep this layer in high precision"."""
    return value is None or (isinstance(value, str) and value.strip().lower() in HIGH_PRECISION_NAMES)


def _value(value: Any) -> Recipe | None:
    return None if is_high_precision(value) else recipe_from(value)


def _count(value: Any, blocks: int, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"layers[{key!r}]={value!r} is invalid; give a number of blocks (an int >= 0) or a "
                         "fraction of them (a float in [0, 1)).")
    if isinstance(value, float) and value < 1:
        return min(blocks, math.ceil(value * blocks - 1e-9))
    if isinstance(value, float):  # 1.0 read as "all of them" would be one block: a count is an int
        raise ValueError(f"layers[{key!r}]={value!r} is invalid; a fraction of the blocks is a float below 1 "
                         f"(0.15: the last 15%), a number of blocks an int ({int(value) if value.is_integer() else 2}"
                         ", not a float).")
    return min(blocks, int(value))


def repeated_blocks(model: nn.Module, stack: str | None = None) -> tuple[str, int]:
    """(name, length) of the stack of repeated blocks: ``stack`` when given, else the model's longest
    ``nn.ModuleList`` (the first of equal length); ``("", 0)`` when the model has none."""
    if stack is not None:
        try:
            module = model.get_submodule(stack)
        except AttributeError:
            raise ValueError(f"layers['stack']={stack!r} names no module of {type(model).__name__}.") from None
        return stack, len(module)
    best = ("", 0)
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > best[1]:
            best = (name, len(module))
    return best


@dataclasses.dataclass(frozen=True)
class Choice:
    """A layer's recipe (None: high precision), why it got it, and whether the policy named this very layer (the
    callable's answer, or a pattern that matches its full name and spells its own name: see ``_matches_itself``)."""

    recipe: Recipe | None
    why: str
    explicit: bool = False


@dataclasses.dataclass
class RecipePolicy:
    """Name patterns -> recipe or high precision, and high-precision first/last blocks (see the module docstring).

    ``patterns``: ``{pattern: recipe or None}`` tried in order; ``first`` / ``last``: blocks (int) or a fraction of
    them (float) kept in high precision; ``stack``: the ``nn.ModuleList`` of repeated blocks (default: the longest);
    ``fn``: a callable ``fn(name, module)`` asked before everything else (return :data:`DEFAULT` to pass).
    """

    patterns: dict[str, Any] = dataclasses.field(default_factory=dict)
    first: int | float = 0
    last: int | float = 0
    stack: str | None = None
    fn: Callable[[str, nn.Module], Any] | None = None

    @classmethod
    def from_arg(cls, layers: LayersLike, recipe: Recipe) -> "RecipePolicy":
        """The policy of ``convert_to_fp8(layers=...)``: the recipe's own defaults
        (:meth:`Recipe.default_layers`, e.g. NVFP4's bf16 tail) with ``layers`` on top."""
        if isinstance(layers, RecipePolicy):
            return layers
        merged: dict[str, Any] = dict(recipe.default_layers())
        if callable(layers):
            return cls(**_positions(merged), fn=layers)
        if layers is not None and not isinstance(layers, Mapping):
            raise TypeError(f"layers={layers!r} is not a layer policy; pass a dict of name patterns (and 'first', "
                            "'last', 'stack'), a callable fn(name, module), or a RecipePolicy.")
        merged.update(layers or {})
        patterns = {k: v for k, v in merged.items() if k not in POSITION_KEYS}
        for value in patterns.values():
            _value(value)  # fail fast on a bad recipe
        return cls(patterns=patterns, **_positions(merged))

    def resolve(self, model: nn.Module, names: list[str], default: Recipe) -> dict[str, Choice]:
        """Each of the layers ``names`` of ``model`` (linear layers and experts modules, ``""`` for the model
        itself): its recipe (None for high precision) and why."""
        stack, blocks = repeated_blocks(model, self.stack)
        first = _count(self.first, blocks, "first")
        last = _count(self.last, blocks, "last")
        used: set[str] = set()
        out = {}
        for name in names:
            out[name] = self._choose(model, name, default, stack, blocks, first, last, used)
        unused = [p for p in self.patterns if p not in used]
        if unused:
            listed = [name or "<root>" for name in names]
            shown = ", ".join(listed[:8]) + (", ..." if len(listed) > 8 else "")
            raise ValueError(f"layer pattern(s) {unused} match no linear layer or experts module of "
                             f"{type(model).__name__}; its layers are: {shown}. Fix the pattern (globs match the full "
                             "name or a parent module's; 're:<expr>' is a regular expression) or remove it.")
        return out

    def _choose(self, model, name, default, stack, blocks, first, last, used) -> Choice:
        if self.fn is not None:
            answer = self.fn(name, model.get_submodule(name) if name else model)
            if not (isinstance(answer, str) and answer == DEFAULT):
                return Choice(_value(answer), "chosen by the layers callable", explicit=True)
        for pattern, value in self.patterns.items():
            if _matches(pattern, name):
                used.add(pattern)
                return Choice(_value(value), f"matches {pattern!r}", explicit=_matches_itself(pattern, name))
        index = _block_index(name, stack) if blocks else None
        if index is not None and index < first:
            return Choice(None, f"in the first {first} of {blocks} blocks of {stack!r}")
        if index is not None and index >= blocks - last:
            return Choice(None, f"in the last {last} of {blocks} blocks of {stack!r}")
        return Choice(default, "the default recipe")


def first_last_high_precision(first: int | float = 1, last: int | float = 1) -> dict[str, int | float]:
    """Megatron's ``first_last_layers_bf16``: the first ``first`` and last ``last`` repeated blocks (counts, or
    fractions of the blocks) in high precision, as a ``layers`` policy (merge name patterns into it)."""
    return {"first": first, "last": last}


def _positions(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: values[k] for k in POSITION_KEYS if k in values}


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[:i]), pattern) for i in range(1, len(parts) + 1))


def _matches_itself(pattern: str, name: str) -> bool:
    """``pattern`` (which matches ``name``) names the layer itself: it matches the full name, not only a module
    holding it, and spells the layer's own name (``"*.router"``, not a catch-all such as ``"blocks.*"`` or
    ``"re:blocks.*"``, whose wildcard also spans the layer's name)."""
    leaf = name.rsplit(".", 1)[-1]
    if pattern.startswith("re:"):
        return leaf in pattern[3:]
    return fnmatch.fnmatchcase(name, pattern) and pattern.rsplit(".", 1)[-1] == leaf


def _block_index(name: str, stack: str) -> int | None:
    prefix = f"{stack}." if stack else ""
    if not name.startswith(prefix):
        return None
    head = name[len(prefix):].split(".", 1)[0]
    return int(head) if head.isdigit() else None


__all__ = [
    "DEFAULT",
    "POLICY_SKIP",
    "Choice",
    "RecipePolicy",
    "first_last_high_precision",
    "is_high_precision",
    "repeated_blocks",
]
