"""The recipe protocol: a frozen, validated dataclass that says *what* scaling to use and carries its behaviour.

A recipe is configuration (hashable, built from a name or a plain dict so YAML/Hydra configs carry it) plus the
methods the rest of the library calls instead of asking which recipe it holds, in the spirit of TransformerEngine's
Recipe/Quantizer split:

* the layer: :meth:`Recipe.shape_unsupported_reason`, :meth:`Recipe.operand_states` (the mutable scaling state, if
  any), :meth:`Recipe.cast` (each GEMM operand's rowwise and columnwise copies), :meth:`Recipe.transposed` (what
  a backward GEMM multiplies), :meth:`Recipe.traced_plan` / :meth:`Recipe.traced_cast` (the same under compile);
* the GEMM and the statistics: :attr:`Recipe.operand_kind`, whose behaviour (its GEMM, float32 form,
  dequantization and scale statistics, :class:`~fp8_lightning.quantize.OperandKind`) the recipe's module implements;
* FSDP2: :meth:`Recipe.fsdp_unsupported_reason`, :meth:`Recipe.fsdp_pack`, :meth:`Recipe.fsdp_unpack`,
  :meth:`Recipe.fsdp_operands`, :attr:`Recipe.global_weight_amax`, and for fused expert weights
  :meth:`Recipe.fsdp_experts_unsupported_reason`, :meth:`Recipe.fsdp_experts_pack`,
  :meth:`Recipe.fsdp_experts_unpack`, :meth:`Recipe.fsdp_experts_operands`;
* grouped GEMMs of mixtures of experts: :meth:`Recipe.grouped_operands`, :meth:`Recipe.grouped_weight_operands`,
  :meth:`Recipe.grouped_native`, :meth:`Recipe.grouped_fallback_reason`, :meth:`Recipe.grouped_gemm_route`, and under
  compile :meth:`Recipe.grouped_columns_from_rows`, :meth:`Recipe.traced_grouped_unsupported_reason`;
* tensor and sequence parallelism: :meth:`Recipe.tensor_parallel_unsupported_reason`,
  :meth:`Recipe.tensor_parallel_bind`, :meth:`Recipe.sequence_cast`, :meth:`Recipe.sequence_gather`;
* the cost model: :meth:`Recipe.cast_bytes_per_element`, :meth:`Recipe.fp8_gemms`.

A subclass registers itself under its ``name`` (:func:`recipe_from` and checkpoints find it by that name), so a
recipe defined outside this package works everywhere a built-in one does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping, Union

import torch

from fp8_lightning.formats import Format
from fp8_lightning.gemm_routes import Capability, CudaVersion, GemmRoute, emulated_on_gpu
from fp8_lightning.quantize import LAYOUT_MULTIPLE, OperandKind, Quantized
from fp8_lightning.traced import TracedPlan, plan_for

AMAX_COMPUTE_ALGOS = ("max", "most_recent")


RECIPES: dict[str, type["Recipe"]] = {}  # name -> class; every subclass with a name adds itself


def invalid(cls_name: str, field: str, value: Any, allowed: str) -> ValueError:
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
    per_tensor: ClassVar[bool] = False  # one scale per tensor (the FP8 bytes transpose freely)
    operand_kind: ClassVar[OperandKind]  # the kind of the operands its casts make
    global_weight_amax: ClassVar[bool] = False  # FSDP2: the gathered weight's scale needs the whole weight's amax
    # grouped wgrad from a list of per-group columnwise copies (grouped_operands' default): they carry values in their
    # padding along the tokens, so the product sums over the padded width, not the group's rows (a container of all
    # the groups, groups.GroupOperands, answers this itself through its wgrad_values)
    wgrad_sums_padding: ClassVar[bool] = False

    fp8_format: Format = Format.HYBRID
    fprop_fast_accum: bool = True
    grad_fast_accum: bool = False

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "fp8_format", Format.parse(self.fp8_format))
        except ValueError as err:
            raise invalid(type(self).__name__, "fp8_format", self.fp8_format, "E4M3, E5M2, HYBRID") from err
        for flag in ("fprop_fast_accum", "grad_fast_accum"):
            if not isinstance(getattr(self, flag), bool):
                raise invalid(type(self).__name__, flag, getattr(self, flag), "True or False")
        if self.fp8_format is Format.E5M2:  # both operands of every GEMM would be E5M2
            raise invalid(
                type(self).__name__, "fp8_format", "E5M2",
                "HYBRID (E4M3 forward, E5M2 gradients) or E4M3: with E5M2 every GEMM multiplies two E5M2 operands, "
                "which CUDA refuses ('Multiplication of two Float8_e5m2 matrices is not supported')",
            )

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("name"):
            RECIPES[cls.name] = cls

    # -- the layer ------------------------------------------------------------------------------------------

    def shape_unsupported_reason(
        self, in_features: int, out_features: int, names: tuple[str, str] = ("in_features", "out_features")
    ) -> str | None:
        """Why an (out, in) weight cannot run its GEMMs in FP8 under this recipe, or None. By default K and N must
        be multiples of 16, the FP8 GEMM layouts' rule. ``names``: what the reason calls K and N (a grouped GEMM's
        caller says ``("K", "N")``)."""
        return multiple_reason(self, in_features, out_features, LAYOUT_MULTIPLE, names)

    def operand_states(self, forward_dtype: torch.dtype, backward_dtype: torch.dtype) -> dict[str, Any]:
        """The mutable scaling state of one layer, per GEMM role (``"input"``, ``"weight"``, ``"grad_output"``):
        none for recipes whose every scale comes from the tensor being cast."""
        return {}

    def cast(
        self, role: str, x: torch.Tensor, dtype: torch.dtype, columnwise: bool, columnwise_f32: bool, state: Any,
        record: bool,
    ) -> tuple[Quantized, Quantized | None]:
        """The FP8 operand of a 2-D ``x`` in GEMM ``role`` (K last) and, with ``columnwise``, the operand of ``x.T``
        where the recipe makes one from the high-precision tensor (None where :meth:`transposed` derives it).
        ``state``: this role's entry of :meth:`operand_states`; ``record``: training (the state books the cast).
        ``columnwise_f32=False``: the columnwise copy is only saved, so no float32 GEMM form is made for it yet."""
        raise NotImplementedError(f"{type(self).__name__} does not define cast()")

    def transposed(self, row: Quantized, column: Quantized | None) -> Quantized:
        """The operand a backward GEMM multiplies for ``x.T``: the columnwise copy :meth:`cast` made."""
        return column

    def traced_plan(self, device: torch.device, out_dtype: torch.dtype, emulate: bool) -> TracedPlan:
        """The plain values the traced layer step needs (:mod:`fp8_lightning.traced`)."""
        return plan_for(self, device, out_dtype, emulate)

    def traced_cast(
        self, x: torch.Tensor, state: tuple, plan: TracedPlan, role: str, dtype: torch.dtype, columnwise: bool,
        record: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(data, scale, columnwise data, columnwise scale) of a 2-D ``x`` as traceable code: plain tensor
        operations or custom ops. ``state``: the role's state tensors (``()`` without state). A columnwise copy that
        :meth:`transposed` derives is returned as the transposed data with scale None."""
        raise NotImplementedError(f"{type(self).__name__} does not define traced_cast()")

    # -- grouped GEMMs (mixtures of experts) ----------------------------------------------------------------

    def grouped_operands(
        self, role: str, x: torch.Tensor, bounds: list[tuple[int, int]], dtype: torch.dtype, columnwise: bool,
        state: Any, record: bool,
    ) -> tuple[Quantized, list[Quantized | None] | None]:
        """The operand of a 2-D ``x`` whose rows are sorted into groups (``bounds``: each group's (start, end) row),
        K last, and with ``columnwise`` each group's operand of ``x[start:end].T`` (None for an empty group), whose
        scales run along that group's rows only: a weight gradient reduces over one expert's tokens.

        By default the rowwise copy is one cast of ``x`` (its scales run along K, within a row, so they never cross
        a group) and the columnwise copies are cast group by group from the high-precision rows."""
        row = self.cast(role, x, dtype, False, True, state, record)[0]
        if not columnwise:
            return row, None
        columns = []
        for start, end in bounds:
            if start == end:
                columns.append(None)
                continue
            part_row, part_column = self.cast(role, x[start:end], dtype, True, True, state, record)
            columns.append(self.transposed(part_row, part_column))
        return row, columns

    def grouped_weight_operands(
        self, weight: torch.Tensor, dtype: torch.dtype, states: list[Any], record: bool
    ) -> list[tuple[Quantized, Quantized]]:
        """For each expert ``e`` of a 3-D ``weight`` (E, N, K): (the operand of ``weight[e]``, the operand of
        ``weight[e].T`` that the input gradient multiplies), each expert cast on its own with its own state
        (``states[e]``): its scales never cover another expert's weights."""
        operands = []
        for expert, state in zip(weight, states):
            row, column = self.cast("weight", expert, dtype, True, True, state, record)
            operands.append((row, self.transposed(row, column)))
        return operands

    def grouped_native(self, device: torch.device, experts: int) -> Any:
        """The native grouped GEMMs of this recipe on ``device`` for ``experts`` experts: an object with
        ``fprop(x, weights, offs, out_dtype)``, ``dgrad(g, weights, offs, out_dtype)`` and
        ``wgrad(g_columns, x_columns, out_dtype)`` taking the operands :meth:`grouped_operands` and
        :meth:`grouped_weight_operands` made, one grouped launch each; None (the default) where the grouped GEMMs
        are emulated from the operands' exact values."""
        return None

    def grouped_fallback_reason(self, device: torch.device, experts: int) -> str | None:
        """Why :meth:`grouped_native` gives nothing on ``device`` where this recipe has a native grouped kernel for
        such devices (a torch build without it, say), for the emulation's one warning; None (the default): no reason
        beyond the route's own."""
        return None

    def grouped_columns_from_rows(self) -> bool:
        """Whether each group's ``x[start:end].T`` operand is a view of the rowwise cast of ``x`` (one scale for the
        whole tensor): the traced grouped step then multiplies the rowwise values in wgrad too."""
        return False

    def traced_grouped_columns(
        self, x: torch.Tensor, offs: torch.Tensor, dtype: torch.dtype, role: str
    ) -> torch.Tensor | None:
        """The float32 values (M, K) of every group's ``x.T`` operand (row ``i`` holds token ``i``'s values in its
        group's copy), made by traceable device operations from ``offs`` on the device; None where the traced step
        runs the eager per-group casts inside one op (the default)."""
        return None

    def traced_grouped_unsupported_reason(self) -> str | None:
        """Why this recipe's experts cannot be traced into one graph by ``torch.compile`` (None: they can)."""
        return None

    def grouped_gemm_route(self, capability: Capability, cuda: CudaVersion, has_grouped_api: bool) -> GemmRoute:
        """Which GEMM serves this recipe's grouped (expert) GEMMs on a CUDA device of ``capability`` with ``cuda``;
        ``has_grouped_api``: whether torch has ``torch._scaled_grouped_mm``. By default they are emulated in
        float32 from the FP8 operands."""
        return emulated_on_gpu(f"no FP8 grouped kernel serves {type(self).__name__}: grouped GEMMs emulated")

    # -- tensor and sequence parallelism ---------------------------------------------------------------------

    def tensor_parallel_block(self) -> int:
        """The extent of a scale block along either dimension of a weight: a tensor-parallel shard must hold whole
        blocks (and the FP8 GEMM layouts take multiples of 16)."""
        return LAYOUT_MULTIPLE

    def tensor_parallel_unsupported_reason(
        self, in_features: int, out_features: int, sharded: str, tp_size: int
    ) -> str | None:
        """Why an (out_features, in_features) weight split over ``tp_size`` ranks along ``sharded``
        (``"out_features"``: colwise, ``"in_features"``: rowwise) cannot run in FP8, or None."""
        size = in_features if sharded == "in_features" else out_features
        block = self.tensor_parallel_block()
        if size % (tp_size * block):
            return (f"{sharded}={size} split over {tp_size} ranks gives shards of {size / tp_size:g}, which must "
                    f"hold whole {type(self).__name__} blocks of {block}")
        local_in, local_out = (size // tp_size, out_features) if sharded == "in_features" else (in_features,
                                                                                                 size // tp_size)
        reason = self.shape_unsupported_reason(local_in, local_out)
        return None if reason is None else f"each rank's shard ({local_out}, {local_in}): {reason}"

    def tensor_parallel_bind(self, operands: dict[str, Any], roles: tuple[str, ...], group: Any) -> None:
        """Point the scaling state of each of ``roles`` (the operands a tensor-parallel split leaves each rank a part
        of) at ``group``, once: its casts then take the amax of the whole tensor, agreed across the group. By default
        the states that have an ``amax_group`` (per-tensor scales); block scales lie inside a shard."""
        for role in roles:
            state = operands.get(role)
            if state is not None and hasattr(state, "amax_group") and state.amax_group is None:
                state.amax_group = group

    def sequence_block(self) -> int:
        """Tokens per scale block of the copies quantized along the token dimension (a wgrad operand): a
        sequence-parallel shard must hold whole blocks for its FP8 all-gather to equal the cast of the whole."""
        return 1

    def sequence_cast(
        self, x: torch.Tensor, dtype: torch.dtype, state: Any, record: bool, group: Any, columnwise: bool = True
    ) -> tuple[Quantized, Quantized | None] | None:
        """This rank's tokens ``x`` (2-D) cast for a sequence-parallel FP8 all-gather: (the fprop operand, the copy
        quantized along the tokens or None where :meth:`transposed` derives it or ``columnwise`` is False), each
        scale what the cast of the gathered tensor would give (agreed across ``group`` where a scale spans ranks);
        None: not in FP8."""
        return self.cast("input", x, dtype, columnwise, True, state, record)

    def sequence_gather(self, row: Quantized, column: Quantized | None, gather) -> tuple[Quantized, Quantized | None]:
        """The operands of the gathered tokens from every rank's :meth:`sequence_cast`; ``gather(t, dim)`` gathers
        ``t`` along its token dimension ``dim`` (the rows of ``row``, the columns of ``column``)."""
        gathered_column = None
        if column is not None:
            gathered_column = Quantized(gather(column.data, 1), gather(column.scale, 1), column.kind)
        return Quantized(gather(row.data, 0), gather(row.scale, 0), row.kind), gathered_column

    def sequence_columns(self, row: Quantized, dtype: torch.dtype) -> Quantized | None:
        """The wgrad copy of gathered tokens re-quantized from their gathered fprop copy ``row`` (a gather that
        carries the fprop copy alone): the values ``row`` holds, cast along the tokens (one more rounding)."""
        return self.cast("input", row.kind.dequantize(row, torch.float32), dtype, True, True, None, False)[1]

    # -- FSDP2 all-gather of the weight ---------------------------------------------------------------------

    def fsdp_unsupported_reason(self, rows: int, cols: int, world_size: int) -> str | None:
        """Why a (rows, cols) weight sharded by rows over ``world_size`` ranks cannot be gathered in FP8."""
        return None

    def fsdp_pack(self, shard: torch.Tensor, module: Any, global_amax: Any) -> tuple[torch.Tensor, Any]:
        """(uint8 all-gather input, metadata) of this rank's weight shard. ``global_amax()`` gives the whole
        weight's amax agreed across the shard group (for :attr:`global_weight_amax` recipes)."""
        raise NotImplementedError(f"{type(self).__name__} does not define fsdp_pack()")

    def fsdp_unpack(self, gathered: torch.Tensor, shard_rows: int, k: int, metadata: Any) -> Quantized:
        """The fprop operand of the whole weight from the gathered bytes of all shards (views, no copy)."""
        raise NotImplementedError(f"{type(self).__name__} does not define fsdp_unpack()")

    def fsdp_operands(self, gathered: Quantized, scaling: Any, metadata: Any, record: bool, columnwise: bool = True):
        """(fprop operand, columnwise operand or None) of a gathered weight, for the layer's ``scaling``; without
        ``columnwise`` (backward makes it again from the re-gathered weight) the second is None."""
        raise NotImplementedError(f"{type(self).__name__} does not define fsdp_operands()")

    # -- FSDP2 all-gather of fused expert weights (E, N, K), sharded by whole experts ----------------------

    def fsdp_experts_unsupported_reason(self, experts: int, n: int, k: int, world_size: int) -> str | None:
        """Why (E, N, K) expert weights sharded along E over ``world_size`` ranks cannot be gathered in FP8."""
        if experts % world_size:
            return (f"num_experts={experts} is not divisible by the shard world size {world_size}: a shard would cut "
                    "an expert and its scales (use a number of experts that the data-parallel size divides)")
        return self.fsdp_unsupported_reason(n, k, 1)

    def fsdp_experts_pack(self, shard: torch.Tensor, scaling: Any, first: int, record: bool, global_amax: Any):
        """(uint8 all-gather input, metadata) of this rank's experts ``shard`` (E_local, N, K), experts ``first`` on.
        ``scaling``: the projection's grouped state; ``global_amax()``: every expert's weight amax (E,), agreed
        across the shard group. By default each expert is packed as a whole linear weight, rows stacked."""
        return torch.cat([self.fsdp_pack(w, None, None)[0] for w in shard]), None

    def fsdp_experts_unpack(self, gathered: torch.Tensor, experts: int, n: int, k: int, metadata: Any):
        """Each expert's fprop operand of W_e (N, K) from the gathered bytes (E * N rows) of all shards."""
        return [self.fsdp_unpack(part, n, k, metadata) for part in gathered.split(n)]

    def fsdp_experts_operands(self, gathered: list[Quantized], scaling: Any, metadata: Any, record: bool):
        """What :meth:`grouped_weight_operands` returns, from the gathered operands: (W_e, W_e.T) per expert."""
        pairs = []
        for q in gathered:
            row, column = self.fsdp_operands(q, None, metadata, record)
            pairs.append((row, self.transposed(row, column)))
        return pairs

    # -- cost model -----------------------------------------------------------------------------------------

    def cast_bytes_per_element(self) -> float:
        """Extra memory traffic per operand element for the FP8 casts (bf16 in, codes and scales out)."""
        return 7.0

    def fp8_gemms(self) -> int:
        """How many of a layer's three GEMMs run in FP8."""
        return 3

    def gemm_route(self, capability: Capability, cuda: CudaVersion, has_scaled_mm_v2: bool) -> GemmRoute:
        """Which GEMM serves this recipe on a CUDA device of ``capability`` (sm_89 or later) with ``cuda``, and at
        what rate (:mod:`fp8_lightning.gemm_routes`); a pure function, so the support matrix is made for any
        device. ``has_scaled_mm_v2``: whether torch has ``torch.nn.functional.scaled_mm``."""
        raise NotImplementedError(f"{type(self).__name__} does not say which GEMM serves it (Recipe.gemm_route)")

    def default_layers(self) -> dict[str, Any]:
        """The layer policy this recipe implies when the user gives none (:mod:`fp8_lightning.policy`): nothing by
        default; NVFP4 keeps the last 15% of the repeated blocks in high precision, as the NVFP4 paper does."""
        return {}

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


def multiple_reason(
    recipe: Recipe, in_features: int, out_features: int, multiple: int,
    names: tuple[str, str] = ("in_features", "out_features"),
) -> str | None:
    if not (in_features % multiple or out_features % multiple):
        return None  # the common case, asked at every forward
    bad = [f"{name}={v}" for name, v in zip(names, (in_features, out_features)) if v % multiple]
    if bad:
        return f"{', '.join(bad)} not divisible by {multiple} ({type(recipe).__name__})"
    return None


def check_flags(recipe: Recipe, *flags: str) -> None:
    for flag in flags:
        if not isinstance(getattr(recipe, flag), bool):
            raise invalid(type(recipe).__name__, flag, getattr(recipe, flag), "True or False")


ALIASES = {
    "current": "tensorwise", "jit": "tensorwise", "mx": "mxfp8", "delayed_scaling": "delayed",
    "axiswise": "rowwise", "block": "blockwise", "deepseek": "blockwise",
}

RecipeLike = Union[Recipe, str, Mapping[str, Any], None]


def recipe_from(spec: RecipeLike, default: Recipe | None = None) -> Recipe:
    """Build a recipe from a recipe object, a name, or a dict with a ``name`` key (YAML form).

    Args:
        spec: a :class:`Recipe`, a registered name (``"delayed"``, ``"tensorwise"``, ...), a dict such as
            ``{"name": "delayed", "margin": 1}``, or None.
        default: what None gives (the delayed recipe when not given).

    Returns:
        The recipe.

    Raises:
        ValueError: an unknown name or field, or a field value the recipe does not allow.
    """
    if spec is None:
        return default if default is not None else RECIPES["delayed"]()
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
        hint = ""
        if key.startswith(("fp8_", "fp4_")):  # a Trainer(precision=...) string given where a recipe is asked
            hint = (f" {name!r} looks like a Trainer(precision=...) string, which stands for a recipe with settings: "
                    "pass the recipe name, or the recipe the string stands for "
                    f"(fp8_lightning.lightning.strings.recipe_for_precision({name!r})).")
        raise ValueError(f"recipe name {name!r} is unknown; allowed: {', '.join(allowed)}.{hint}")
    return RECIPES[key]
