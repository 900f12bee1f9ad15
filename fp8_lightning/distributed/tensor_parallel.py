"""FP8 tensor and sequence parallelism: parallel styles for ``torch.distributed.tensor.parallel.parallelize_module``.

:class:`FP8ColwiseParallel` and :class:`FP8RowwiseParallel` shard a linear layer's weight as torch's
``ColwiseParallel`` / ``RowwiseParallel`` do (DTensor parameters, so distributed checkpoints and ``fully_shard``
see the usual layout), and run an FP8 layer's GEMMs on its local shards between explicit collectives:

* per-tensor recipes (delayed, tensorwise) cast each split operand with the one scale of the whole tensor: the
  shards' amaxes are agreed across the tensor-parallel group (the weight and, colwise, the output gradient;
  rowwise, the input); NVFP4 agrees the amax behind each split operand's global scale the same way
  (:meth:`~fp8_lightning.recipes.base.Recipe.tensor_parallel_bind`). Rowwise, blockwise, MXFP8 and NVFP4 scale
  blocks that lie inside a shard, which set-up checks;
* a sequence-sharded input entering a colwise layer (``input_layouts=Shard(1)``) is cast once and its FP8 codes
  and scales are all-gathered (:func:`gather_sequence`; ``fp8_all_gather="fprop"`` sends the forward copy alone);
  its gradient is reduce-scattered in high precision;
* :class:`PrepareFP8ModuleInput` does that gather once for several colwise consumers (attention's q, k, v);
* under ``torch.compile`` a split layer's local step and an FP8 sequence gather run eagerly between graphs (the
  eager bits; ``fullgraph=True`` stops with the reason, ``_TRACE_REFUSED``).

A layer the recipe leaves in high precision, or a plain ``nn.Linear``, behaves as under torch's own styles.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from fp8_lightning.distributed.sequence import (
    AllReduce,
    GatherTokens,
    GradientAllReduce,
    ReduceScatterTokens,
    SequenceGathered,
    gather_tokens,
)
from fp8_lightning.distributed.weight import fit_gather_to_split
from fp8_lightning.linear import FP8Linear
from fp8_lightning.recipes import Recipe
from fp8_lightning.scaling import records_amax

# the operands whose tensor each rank holds a part of, per style (per-tensor recipes agree their amax)
_SPLIT_ROLES = {"colwise": ("weight", "grad_output"), "rowwise": ("weight", "input")}


def _local(t: torch.Tensor | None, grad_placements=None) -> torch.Tensor | None:
    """The local shard of a DTensor (with its autograd edge), else ``t``."""
    return t.to_local(grad_placements=grad_placements) if isinstance(t, DTensor) else t


@dataclasses.dataclass(eq=False)
class ShardedLinear:
    """What an FP8 parallel style leaves on a linear layer (``layer.fp8_tensor_parallel``): how its weight is split
    and the collectives around its local GEMMs (:meth:`forward`, called by :class:`~fp8_lightning.linear.FP8Linear`).
    """

    style: str  # "colwise" (weight rows split) or "rowwise" (weight columns split)
    mesh: DeviceMesh
    output_layout: Placement
    sequence_input: bool = False  # colwise: the input arrives sharded along its tokens
    fp8_all_gather: bool | str = True  # colwise, sequence_input: see sequence_gather_mode

    @property
    def group(self):
        return self.mesh.get_group()

    @property
    def size(self) -> int:
        return self.mesh.size()

    def unsupported_reason(self, layer: nn.Module, recipe: Recipe) -> str | None:
        """Why ``layer``'s shards cannot run their GEMMs in FP8 under ``recipe``, or None."""
        sharded = "out_features" if self.style == "colwise" else "in_features"
        return recipe.tensor_parallel_unsupported_reason(layer.in_features, layer.out_features, sharded, self.size)

    def check(self, layer: nn.Module, recipe: Recipe, name: str = "") -> None:
        """Raise the set-up error of a layer whose shards ``recipe`` cannot scale (ValueError naming the fix)."""
        reason = self.unsupported_reason(layer, recipe)
        if reason is not None:
            where = f"Layer '{name}'" if name else "This layer"
            raise ValueError(f"{where} is split {self.style} over {self.size} tensor-parallel ranks, and under "
                             f"{type(recipe).__name__} {reason}. Use another tensor-parallel size, another recipe "
                             "for this layer (layers={...}), or leave the layer out of the plan.")

    def bind(self, layer: FP8Linear) -> None:
        """Point the per-tensor scaling states of the split operands at the group (each recipe's, once)."""
        roles = _SPLIT_ROLES[self.style] + (("input",) if self.sequence_input else ())
        for recipe, scaling in layer.fp8_scalings():
            recipe.tensor_parallel_bind(scaling.operands, roles, self.group)

    def forward(self, layer: FP8Linear, x: torch.Tensor) -> torch.Tensor:
        """The layer on this rank: ``x`` is the local input the style's input hook made (plain tensor). Under
        ``torch.compile`` it runs eagerly between graphs (``_TRACE_REFUSED``)."""
        if torch.compiler.is_compiling():
            return _local_step_island(self, layer, x)
        return self.local_step(layer, x)

    def local_step(self, layer: FP8Linear, x: torch.Tensor) -> torch.Tensor:
        """The local GEMMs of :meth:`forward` between the style's collectives, run eagerly."""
        self.bind(layer)
        weight = _local(layer.fp8_gemm_weight)  # the layer's weight cache keys on the DTensor's version counter
        if self.style == "colwise":
            return layer.fp8_forward(x, weight, _local(layer.bias))
        y = layer.fp8_forward(x, weight, None)  # a partial sum of the output
        if isinstance(self.output_layout, Shard):
            y = ReduceScatterTokens.apply(y, self.output_layout.dim % y.dim(), self.group)
        else:
            y = AllReduce.apply(y, self.group)
        if layer.bias is None:
            return y
        bias = _local(layer.bias)
        if isinstance(self.output_layout, Shard):  # each rank sums its tokens' share of the bias gradient
            bias = GradientAllReduce.apply(bias, self.group)
        return y + bias.to(y.dtype)


# Under torch.compile the FP8 layers split by tensor parallelism (and their sequence-parallel FP8 gathers) run eagerly
# between graphs, computing the eager bits; fullgraph=True reports this reason.
_TRACE_REFUSED = (
    "an FP8 layer split by tensor parallelism runs its local step (and the sequence-parallel FP8 all-gather of its "
    "input) eagerly between graphs: the casts of its split operands agree their amax (per-tensor scales, NVFP4's "
    "global scales) with an all-reduce over the tensor-parallel group inside the eager cast, which the traced layer "
    "step's custom ops do not carry; compile without fullgraph=True (the split layers then run between graphs, with "
    "the eager step's losses) or leave the layer out of the tensor-parallel plan"
)
_local_step_island = torch.compiler.disable(ShardedLinear.local_step, reason=_TRACE_REFUSED)


def sequence_gather_mode(value, where: str) -> bool | str:
    """``value`` checked as a sequence-parallel all-gather mode: True (every FP8 copy the layer multiplies: the
    bits of the cast of the gathered tensor), ``"fprop"`` (only the forward GEMM's copy; the weight gradient's copy
    is re-quantized from it after the gather), or False (high precision)."""
    if value is True or value is False or (isinstance(value, str) and value == "fprop"):
        return value
    raise ValueError(
        f"{where}(fp8_all_gather={value!r}): use True (every FP8 copy the layer multiplies, bit for bit with "
        "gathering in high precision), 'fprop' (only the forward copy, about half of bf16's bytes; the "
        "weight-gradient copy re-quantized from it, one more rounding) or False (high precision, as torch does)."
    )


def _fp8_sharded(module: nn.Module) -> bool:
    return isinstance(module, FP8Linear) and "fp8_tensor_parallel" in module.__dict__


def gather_sequence(
    consumers: list[FP8Linear], x: torch.Tensor, dim: int, group, fp8: bool | str = True
) -> torch.Tensor:
    """All-gather this rank's tokens ``x`` (sharded along ``dim``) for ``consumers``, colwise layers that read the
    gathered tensor.

    Args:
        consumers: the layers that read the gathered tensor (FP8 layers split by :class:`FP8ColwiseParallel`).
        x: this rank's shard of the activation.
        dim: its token dimension.
        group: the tensor-parallel process group.
        fp8: gather in FP8 when the first consumer runs FP8 now and the shard holds whole scale blocks of its
            recipe (the codes and scales of one cast travel, and each consumer with that recipe multiplies them);
            ``"fprop"``: only the forward copy travels, and the weight gradient's copy is re-quantized from the
            gathered one (:meth:`~fp8_lightning.recipes.base.Recipe.sequence_columns`); False, or otherwise: in
            high precision.

    Returns:
        The gathered activation, whose backward reduce-scatters the gradient (in high precision). Under
        ``torch.compile`` the gather runs eagerly between graphs, as the consumers' local steps do.
    """
    if torch.compiler.is_compiling():
        return _gather_island(consumers, x, dim, group, fp8)
    return _gather_sequence(consumers, x, dim, group, fp8)


def _gather_sequence(consumers: list[FP8Linear], x: torch.Tensor, dim: int, group, fp8: bool | str) -> torch.Tensor:
    dim = dim % x.dim()
    layer = consumers[0]
    recipe, replay = layer.fp8_setting(x, _local(layer.fp8_gemm_weight)) if fp8 else (None, False)
    tokens_per_run = math.prod(x.shape[dim:-1])
    copies = None
    if recipe is not None and fp8 is True and tokens_per_run % recipe.sequence_block() != 0:
        layer.fp8_warn_once(f"the sequence-parallel input is all-gathered in high precision: each rank's run of "
                            f"{tokens_per_run} tokens is not a whole number of {type(recipe).__name__}'s "
                            f"{recipe.sequence_block()}-token blocks (make the sequence length per rank a multiple)")
    elif recipe is not None:
        scaling = layer.fp8_scaling(recipe)
        x2d = x.reshape(-1, x.shape[-1])
        state = scaling.operands.get("input")
        if hasattr(state, "amax_group"):  # a per-tensor scale: the one of the gathered tensor
            state.amax_group = group
        record = records_amax(layer.training) and not replay  # a checkpoint recompute books nothing
        copies = recipe.sequence_cast(x2d, scaling.forward_dtype, state, record, group, columnwise=fp8 is True)
    if copies is None:
        out = GatherTokens.apply(x, dim, group)
    else:
        outer = math.prod(x.shape[:dim])
        row, column = recipe.sequence_gather(*copies, lambda t, d: gather_tokens(t, d, outer, group))
        if fp8 == "fprop":
            column = recipe.sequence_columns(row, scaling.forward_dtype)
        shape = list(x.shape)
        shape[dim] *= torch.distributed.get_world_size(group)
        values = row.kind.dequantize(row, x.dtype).reshape(shape)  # what any other reader of the input sees
        out = SequenceGathered.apply(x, values, dim, group)
        out.fp8_operands = {recipe: (row, column)}
    out.fp8_sequence_gathered = True  # its gradient is reduced by its own backward: consumers add no all-reduce
    return out


_gather_island = torch.compiler.disable(_gather_sequence, reason=_TRACE_REFUSED)


def _colwise_input(torch_fn, input_layouts, mod, inputs, mesh):
    if not _fp8_sharded(mod):
        return torch_fn(mod, inputs, mesh)
    x = inputs[0]
    if getattr(x, "fp8_sequence_gathered", False):
        return x
    layout = x.placements[0] if isinstance(x, DTensor) else input_layouts[0]
    if isinstance(layout, Shard):
        fp8 = mod.fp8_tensor_parallel.fp8_all_gather
        return gather_sequence([mod], _local(x), layout.dim, mesh.get_group(), fp8)
    if isinstance(x, DTensor):  # each rank's input gradient is a partial sum; DTensor reduces it upstream
        return _local(x.redistribute(placements=[Replicate()]), grad_placements=[Partial()])
    return GradientAllReduce.apply(x, mesh.get_group())


def _rowwise_input(torch_fn, input_layouts, mod, inputs, mesh):
    if not _fp8_sharded(mod):
        return torch_fn(mod, inputs, mesh)
    x = inputs[0]
    if not isinstance(x, DTensor):
        if isinstance(input_layouts[0], Shard) and input_layouts[0].dim % x.dim() == x.dim() - 1:
            return x  # this rank's features already
        x = DTensor.from_local(x, mesh, input_layouts, run_check=False)
    return _local(x.redistribute(placements=[Shard(-1)]))


def _output(torch_fn, local_layout, output_layouts, use_local_output, mod, outputs, mesh):
    if not _fp8_sharded(mod):
        return torch_fn(mod, outputs, mesh)
    if use_local_output and local_layout == output_layouts[0]:
        return outputs
    out = DTensor.from_local(outputs, mesh, [local_layout], run_check=False)
    if local_layout != output_layouts[0]:
        out = out.redistribute(placements=list(output_layouts))
    return out.to_local() if use_local_output else out


def _has_submodule(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def _check_module(style: str, module: nn.Module) -> None:
    if not isinstance(module, (nn.Linear, nn.Embedding)):
        raise TypeError(
            f"{style} shards nn.Linear layers (and, as torch's style, nn.Embedding); got {type(module).__name__}. "
            "Leave this module out of the tensor-parallel plan, or give it torch's own style if it has one."
        )


def _check_layer(parallel: ShardedLinear, module: nn.Module) -> None:
    if isinstance(module, FP8Linear):
        parallel.check(module, module.fp8_recipe)


class FP8ColwiseParallel(ColwiseParallel):
    """torch's ``ColwiseParallel`` for FP8 layers: the weight's rows are split; with ``input_layouts=Shard(1)`` (a
    sequence-parallel input) the input is all-gathered in FP8.

    Args:
        fp8_all_gather: all-gather a sequence-sharded input in FP8: True (every copy the layer multiplies),
            ``"fprop"`` (the forward copy only, the weight gradient's re-quantized from it) or False (in high
            precision, as torch does).
        **kwargs: ``ColwiseParallel``'s (``input_layouts``, ``output_layouts``, ``use_local_output``).
    """

    def __init__(self, *, fp8_all_gather: bool | str = True, **kwargs):
        super().__init__(**kwargs)
        self.fp8_all_gather = sequence_gather_mode(fp8_all_gather, type(self).__name__)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_module(type(self).__name__, module)
        if isinstance(module, nn.Embedding):
            return super()._apply(module, device_mesh)
        layout = self.input_layouts[0]
        if isinstance(layout, Shard) and layout.dim == -1:
            raise ValueError(f"{type(self).__name__}(input_layouts=Shard(-1)) would split the features a colwise "
                             "layer reduces over: use RowwiseParallel for that input, or Shard(1) for a sequence.")
        parallel = ShardedLinear("colwise", device_mesh, Shard(-1), isinstance(layout, Shard), self.fp8_all_gather)
        _check_layer(parallel, module)
        torch_in = partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts)
        torch_out = partial(self._prepare_output_fn, self.output_layouts, self.use_local_output)
        module = distribute_module(module, device_mesh, self._partition_linear_fn,
                             partial(_colwise_input, torch_in, self.input_layouts),
                             partial(_output, torch_out, Shard(-1), self.output_layouts, self.use_local_output))
        module.fp8_tensor_parallel = parallel
        fit_gather_to_split(module)
        return module


class FP8RowwiseParallel(RowwiseParallel):
    """torch's ``RowwiseParallel`` for FP8 layers: the weight's columns are split and the partial outputs summed
    (all-reduce), or reduce-scattered along the tokens with ``output_layouts=Shard(1)`` (sequence parallel). Same
    arguments as ``RowwiseParallel``."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_module(type(self).__name__, module)
        if isinstance(module, nn.Embedding):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        parallel = ShardedLinear("rowwise", device_mesh, self.output_layouts[0])
        _check_layer(parallel, module)
        torch_in = partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts)
        torch_out = partial(self._prepare_output_fn, self.output_layouts, self.use_local_output)
        module = distribute_module(module, device_mesh, self._partition_linear_fn,
                                   partial(_rowwise_input, torch_in, self.input_layouts),
                                   partial(_output, torch_out, self.output_layouts[0], self.output_layouts,
                                           self.use_local_output))
        module.fp8_tensor_parallel = parallel
        fit_gather_to_split(module)
        return module


class PrepareFP8ModuleInput(PrepareModuleInput):
    """torch's ``PrepareModuleInput`` that all-gathers a sequence-sharded input once, in FP8, for the colwise FP8
    layers ``consumers`` (names of submodules, e.g. ``("q_proj", "k_proj", "v_proj")``) that read it.

    Args:
        consumers: the submodules that read the gathered input; they share one cast of it.
        sequence_dim: the token dimension the input arrives sharded along (``Shard(sequence_dim)``).
        fp8_all_gather: all-gather in FP8 (True, or ``"fprop"``: the forward copy only, see
            :class:`FP8ColwiseParallel`) or in high precision (False), once for every consumer.
        **kwargs: ``PrepareModuleInput``'s (``input_layouts``, ``desired_input_layouts``, ...), used where a
            consumer is not an FP8 layer.
    """

    def __init__(self, *, consumers: tuple[str, ...], sequence_dim: int = 1, fp8_all_gather: bool | str = True,
                 **kwargs):  # fmt: skip
        kwargs.setdefault("input_layouts", (Shard(sequence_dim),))
        kwargs.setdefault("desired_input_layouts", (Replicate(),))
        super().__init__(**kwargs)
        if not consumers:
            raise ValueError("PrepareFP8ModuleInput(consumers=...) needs the names of the layers that read the input.")
        self.consumers, self.sequence_dim = tuple(consumers), sequence_dim
        self.fp8_all_gather = sequence_gather_mode(fp8_all_gather, type(self).__name__)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        missing = [name for name in self.consumers if not _has_submodule(module, name)]
        if missing:
            raise ValueError(f"PrepareFP8ModuleInput: {type(module).__name__} has no submodule(s) {missing}.")
        torch_hook = super()._prepare_input_fn

        def hook(mod, inputs):
            layers = [mod.get_submodule(name) for name in self.consumers]
            if not (inputs and torch.is_tensor(inputs[0]) and all(_fp8_sharded(m) for m in layers)):
                return torch_hook(inputs, device_mesh)
            x = _local(inputs[0])
            gathered = gather_sequence(layers, x, self.sequence_dim, device_mesh.get_group(), self.fp8_all_gather)
            return (gathered, *inputs[1:])

        module.register_forward_pre_hook(hook)
        return module


