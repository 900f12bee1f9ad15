"""Scaling recipes: *what* scaling to use, as frozen, validated dataclasses with no state.

A recipe is configuration only (like TransformerEngine's ``recipe`` module); the mutable part, amax histories
and scales, lives in :mod:`fp8_lightning.scaling`. Recipes are hashable, so a layer can keep one scaling state
per recipe, and they build from a name or a plain dict so that YAML/Hydra configs can carry them::

    DelayedScaling(margin=1)
    recipe_from("tensorwise")
    recipe_from({"name": "delayed", "amax_history_len": 32, "fp8_format": "hybrid"})

* :class:`DelayedScaling`: per-tensor scale from the amax history of previous steps (TE semantics).
* :class:`TensorwiseScaling`: per-tensor scale from the tensor being cast ("current" / just-in-time scaling).
* :class:`MXFP8BlockScaling`: blocks of 32 along the reduction dimension share a power-of-two E8M0 scale.
* :class:`RowwiseScaling`: one scale per row of each GEMM operand, along its reduction dimension (torchao's
  ``rowwise`` and ``rowwise_with_gw_hp``).
* :class:`BlockwiseScaling`: 1x128 tiles for inputs and output gradients, 128x128 blocks for weights
  (DeepSeek-V3's recipe, TransformerEngine's ``Float8BlockScaling``).

The numerics of the last two are defined in :mod:`fp8_lightning.rowwise` and :mod:`fp8_lightning.blockwise`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping, Union

from fp8_lightning.formats import Format

AMAX_COMPUTE_ALGOS = ("max", "most_recent")
SCALE_ROUNDINGS = ("rceil", "floor")
MX_BLOCK_SIZES = (16, 32, 64, 128)


def _invalid(cls_name: str, field: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{cls_name}.{field}={value!r} is invalid; allowed: {allowed}.")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Base class: common construction from names and dicts.

    ``fprop_fast_accum`` / ``grad_fast_accum``: cuBLAS's fast accumulation for the forward GEMM and for the two
    backward GEMMs (dgrad, wgrad) of per-tensor and rowwise recipes on CUDA (``torch._scaled_mm(use_fast_accum=)``).
    It is faster on Hopper and accumulates FP8 products less precisely; the defaults follow torchao.float8 (forward
    on, gradients off). Other GEMMs (CPU, MX and 1x128 / 128x128 block-scaled) accumulate in float32 and ignore them.
    """

    name: ClassVar[str] = ""
    per_tensor: ClassVar[bool] = True

    fp8_format: Format = Format.HYBRID
    fprop_fast_accum: bool = True
    grad_fast_accum: bool = False

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "fp8_format", Format.parse(self.fp8_format))
        except ValueError as err:
            raise _invalid(type(self).__name__, "fp8_format", self.fp8_format, "E4M3, E5M2, HYBRID") from err
        for flag in ("fprop_fast_accum", "grad_fast_accum"):
            if not isinstance(getattr(self, flag), bool):
                raise _invalid(type(self).__name__, flag, getattr(self, flag), "True or False")
        if self.fp8_format is Format.E5M2:  # both operands of every GEMM would be E5M2
            raise _invalid(
                type(self).__name__, "fp8_format", "E5M2",
                "HYBRID (E4M3 forward, E5M2 gradients) or E4M3: with E5M2 every GEMM multiplies two E5M2 operands, "
                "which CUDA refuses ('Multiplication of two Float8_e5m2 matrices is not supported')",
            )

    def to_dict(self) -> dict:
        """Plain, YAML-friendly form; ``recipe_from(r.to_dict()) == r``."""
        out = {"name": self.name}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.value if isinstance(value, Format) else value
        return out

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "Recipe":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known - {"name", "_target_"})
        if unknown:
            raise ValueError(
                f"{cls.__name__} got unknown field(s) {unknown}; allowed fields: {sorted(known)}."
            )
        return cls(**{k: v for k, v in values.items() if k in known})


@dataclasses.dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Per-tensor scaling from a rolling history of amaxes of previous steps.

    ``scale = (fp8_max / amax) / 2**margin`` with ``amax`` the maximum (``"max"``) or the newest
    (``"most_recent"``) entry of the last ``amax_history_len`` per-step amaxes. The first use of a tensor
    scales it just in time from its own amax. ``reduce_amax`` agrees amaxes across data-parallel ranks.
    """

    name: ClassVar[str] = "delayed"

    margin: int = 0
    amax_history_len: int = 16
    amax_compute_algo: str = "max"
    power_of_2_scales: bool = False
    reduce_amax: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        cls = type(self).__name__
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise _invalid(cls, "margin", self.margin, "an integer >= 0")
        if (
            isinstance(self.amax_history_len, bool)
            or not isinstance(self.amax_history_len, int)
            or self.amax_history_len < 1
        ):
            raise _invalid(cls, "amax_history_len", self.amax_history_len, "an integer >= 1")
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise _invalid(cls, "amax_compute_algo", self.amax_compute_algo, " or ".join(AMAX_COMPUTE_ALGOS))
        for flag in ("power_of_2_scales", "reduce_amax"):
            if not isinstance(getattr(self, flag), bool):
                raise _invalid(cls, flag, getattr(self, flag), "True or False")


@dataclasses.dataclass(frozen=True)
class TensorwiseScaling(Recipe):
    """Per-tensor "current" scaling: ``scale = fp8_max / max(amax, eps)`` from the tensor being cast."""

    name: ClassVar[str] = "tensorwise"

    power_of_2_scales: bool = False
    eps: float = 1e-12

    def __post_init__(self) -> None:
        super().__post_init__()
        cls = type(self).__name__
        if not isinstance(self.power_of_2_scales, bool):
            raise _invalid(cls, "power_of_2_scales", self.power_of_2_scales, "True or False")
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or not 0 < self.eps < 1:
            raise _invalid(cls, "eps", self.eps, "a number in (0, 1)")
        object.__setattr__(self, "eps", float(self.eps))


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8: ``block_size`` consecutive elements along K share one power-of-two (E8M0) scale.

    ``scale_rounding="rceil"`` (cuBLAS/TE) picks the smallest power of two that keeps every block value within
    the FP8 range; ``"floor"`` (OCP MX v1.0) uses ``floor(log2(amax)) - emax`` and saturates the few values that
    overflow. Scales are powers of two by construction. Data is E4M3; ``fp8_format=HYBRID`` makes the output
    gradient E5M2.
    """

    name: ClassVar[str] = "mxfp8"
    per_tensor: ClassVar[bool] = False

    fp8_format: Format = Format.E4M3
    block_size: int = 32
    scale_rounding: str = "rceil"

    def __post_init__(self) -> None:
        super().__post_init__()
        cls = type(self).__name__
        if self.block_size not in MX_BLOCK_SIZES or isinstance(self.block_size, bool):
            raise _invalid(cls, "block_size", self.block_size, f"one of {MX_BLOCK_SIZES} (OCP MX uses 32)")
        if self.scale_rounding not in SCALE_ROUNDINGS:
            raise _invalid(cls, "scale_rounding", self.scale_rounding, " or ".join(SCALE_ROUNDINGS))


def _check_flags(recipe: Recipe, *flags: str) -> None:
    for flag in flags:
        if not isinstance(getattr(recipe, flag), bool):
            raise _invalid(type(recipe).__name__, flag, getattr(recipe, flag), "True or False")


@dataclasses.dataclass(frozen=True)
class RowwiseScaling(Recipe):
    """One scale per row of every GEMM operand, taken along the GEMM's reduction dimension (current scaling).

    ``scale = fp8_max / max(amax_row, eps)`` (torchao's rule, rounded down to a power of two when
    ``power_of_2_scales``); a row whose amax is inf or NaN gets scale 1. Each of the three GEMMs casts its operands
    from high precision along its own reduction dimension. ``high_precision_wgrad=True`` is torchao's
    ``rowwise_with_gw_hp``: the weight gradient is computed in high precision and the weight of the input-gradient
    GEMM is scaled per tensor. Defaults (E4M3 everywhere, power-of-two scales) are torchao's ``rowwise``.
    """

    name: ClassVar[str] = "rowwise"
    per_tensor: ClassVar[bool] = False

    fp8_format: Format = Format.E4M3
    power_of_2_scales: bool = True
    high_precision_wgrad: bool = False
    eps: float = 1e-12

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_flags(self, "power_of_2_scales", "high_precision_wgrad")
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or not 0 < self.eps < 1:
            raise _invalid(type(self).__name__, "eps", self.eps, "a number in (0, 1)")
        object.__setattr__(self, "eps", float(self.eps))


@dataclasses.dataclass(frozen=True)
class BlockwiseScaling(Recipe):
    """DeepSeek-V3's block scaling: inputs and output gradients in 1x128 tiles, weights in 128x128 blocks.

    Every tile or block has a float32 scale ``fp8_max / amax`` (rounded down to a power of two when
    ``power_of_2_scales``, TransformerEngine's default); an all-zero or non-finite block gets scale 1. Tiles run
    along each GEMM's reduction dimension: activations and gradients are cast twice from high precision (along
    the feature and along the token dimension); the weight once, its blocks transposed for the input gradient.
    """

    name: ClassVar[str] = "blockwise"
    per_tensor: ClassVar[bool] = False

    fp8_format: Format = Format.E4M3
    power_of_2_scales: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_flags(self, "power_of_2_scales")


RECIPES: dict[str, type[Recipe]] = {
    "delayed": DelayedScaling,
    "tensorwise": TensorwiseScaling,
    "mxfp8": MXFP8BlockScaling,
    "rowwise": RowwiseScaling,
    "blockwise": BlockwiseScaling,
}
ALIASES = {
    "current": "tensorwise", "jit": "tensorwise", "mx": "mxfp8", "delayed_scaling": "delayed",
    "axiswise": "rowwise", "block": "blockwise", "deepseek": "blockwise",
}

RecipeLike = Union[Recipe, str, Mapping[str, Any], None]


def recipe_from(spec: RecipeLike, default: Recipe | None = None) -> Recipe:
    """Build a recipe from a recipe object, a name, or a dict with a ``name`` key (YAML form).

    ``None`` gives ``default`` (``DelayedScaling()`` when no default is given).
    """
    if spec is None:
        return default if default is not None else DelayedScaling()
    if isinstance(spec, Recipe):
        return spec
    if isinstance(spec, str):
        return _recipe_class(spec)()
    if isinstance(spec, Mapping):
        values = dict(spec)
        name = values.pop("name", None)
        if name is None:
            raise ValueError(
                f"A recipe dict needs a 'name' key (one of {sorted(RECIPES)}); got keys {sorted(values)}."
            )
        return _recipe_class(name).from_dict(values)
    raise TypeError(
        f"recipe={spec!r} ({type(spec).__name__}) is not a recipe; pass a Recipe, one of {sorted(RECIPES)}, "
        "or a dict with a 'name' key."
    )


def _recipe_class(name: str) -> type[Recipe]:
    key = str(name).strip().lower().replace("-", "_")
    key = ALIASES.get(key, key)
    if key not in RECIPES:
        allowed = sorted(RECIPES) + sorted(ALIASES)
        raise ValueError(f"recipe name {name!r} is unknown; allowed: {', '.join(allowed)}.")
    return RECIPES[key]
