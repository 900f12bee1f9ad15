"""Every private torch, Lightning and Triton name the package uses, where, and why no public route serves.

``PRIVATES`` is the table; ``tests/test_privates.py`` resolves each entry against the installed packages and fails
when one moves or disappears, so an upgrade that breaks a private route is caught by name instead of by a
stranger error deep in a training step. Where a public route exists the code takes it instead, and the name is
not here.

The accessors below are the routes the code takes for the instance attributes that have no public getter or
setter. This module imports neither Lightning nor Triton (the core imports it); names are written as strings.

Hot paths (``torch._scaled_mm`` in the GEMMs, ``Tensor._version`` in the layer) call the private name directly:
a wrapper would be paid on every step. The table still lists them.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Private:
    """One private name. ``path`` is ``"module:qualified.name"``; for an instance attribute, ``attribute`` names it
    and ``path`` is the class that sets and reads it."""

    path: str
    used_in: tuple[str, ...]
    why: str
    attribute: str | None = None
    since: str | None = None  # a torch version before which the name may be absent (the test then skips it)
    source: str | None = None  # the module that sets the attribute, when not the class's own module

    @property
    def package(self) -> str:
        return self.path.split(".")[0].split(":")[0]

    @property
    def name(self) -> str:
        return self.path + (f".{self.attribute}" if self.attribute else "")


_SCALED_MM_USERS = (
    "gemm.py", "rowwise.py", "blockwise.py", "ops/layer.py", "traced.py", "roofline.py", "quantize.py",
    "kernels/fine_grained_cast.py", "kernels/fine_grained_layout.py",
)

PRIVATES: tuple[Private, ...] = (
    # ---- torch ----------------------------------------------------------------------------------------------
    Private(
        "torch:_scaled_mm", _SCALED_MM_USERS,
        "The FP8 GEMM with tensorwise/rowwise/blockwise scales. torch.nn.functional.scaled_mm is public in newer "
        "torch but absent from torch 2.11 (the GPU image); the move belongs with the op registry, which owns "
        "every call site.",
    ),
    Private(
        "torch:Tensor._make_wrapper_subclass", ("distributed/weight.py",),
        "The documented way to build a tensor subclass that wraps another (torch has no public constructor for "
        "wrapper subclasses); FSDP2's FP8 all-gather weight is one.",
    ),
    Private(
        "torch._C:_disabled_torch_function_impl", ("distributed/weight.py",),
        "Turns off __torch_function__ for the wrapper subclass so that only __torch_dispatch__ runs, as torch's own "
        "subclasses (DTensor, Float8Tensor) do; no public equivalent.",
    ),
    Private(
        "torch.utils._pytree:tree_map_only", ("distributed/weight.py",),
        "Maps the wrapper subclass out of a dispatched op's arguments; torch.utils has no public pytree module in "
        "the supported versions.",
    ),
    Private(
        "torch._ops:OpOverload", ("distributed/weight.py",),
        "__torch_dispatch__ tells in-place ops (copy_) by their schema's is_mutable; no public accessor.",
        attribute="_schema",
    ),
    Private(
        "torch._C:_len_torch_dispatch_stack", ("ops/registry.py",),
        "The eager shortcut past the custom-op dispatch is taken only when no dispatch mode is active; torch exposes "
        "no public query for that.",
    ),
    Private(
        "torch._C:_current_graph_task_id", ("recompute.py",),
        "Whether autograd is executing a backward on this thread: a forward there is an activation-checkpoint "
        "recompute, which replays the FP8 setting of its forward; torch exposes no public query (torch.utils.checkpoint"
        " reads the same name).",
    ),
    Private(
        "torch._subclasses.fake_tensor:FakeTensorMode", ("cuda_contract/simulate.py",),
        "The CUDA contract runs the layer on fake CUDA tensors (shapes, strides, dtypes, no GPU); torch has no public "
        "fake-tensor mode (torch.compile uses this one).",
    ),
    Private(
        "torch._subclasses.fake_tensor:FakeTensor", ("cuda_contract/simulate.py",),
        "Which tensors the CUDA contract's device-guard bridges apply to (fake ones only).",
    ),
    Private(
        "torch._C._nn:_parse_to", ("cuda_contract/simulate.py",),
        "Tensor.to's own argument parser, so that the CUDA contract's bridge for fake CUDA tensors reads .to()'s "
        "arguments exactly as torch does.",
    ),
    Private(
        "torch.distributed._composable:checkpoint", ("distributed/sharding.py",),
        "Activation checkpointing applied per block before fully_shard, as FSDP2 expects (torchtitan does the "
        "same); the public torch.utils.checkpoint has no module-level form that composes with fully_shard.",
    ),
    Private(
        "torch.distributed.fsdp._fully_shard._fsdp_api:ReduceScatter", ("distributed/reduce_scatter.py",),
        "The protocol that FSDPModule.set_custom_reduce_scatter (public) takes; torch does not export it publicly.",
    ),
    Private(
        "torch.distributed.tensor:DTensor", ("distributed/amax.py", "distributed/sharding.py"),
        "The local shard of a sharded parameter without an autograd node (DTensor.to_local() records one).",
        attribute="_local_tensor",
    ),
    Private(
        "torch:_grouped_mm", ("grouped/gemm.py", "grouped/experts.py"),
        "The grouped GEMM of mixtures of experts (tokens sorted by expert, int32 group ends), the one transformers' "
        "experts call; the emulated FP8 grouped GEMM runs its float32 products through it on CPU.",
    ),
    Private(
        "torch:_scaled_grouped_mm", ("rowwise_grouped.py", "cuda_contract/rules_grouped.py"),
        "The FP8 grouped GEMM (rowwise float32 scales, int32 group ends; CUTLASS on sm_90): one launch per expert "
        "GEMM. torch.nn.functional.scaled_grouped_mm is public in newer torch but absent from torch 2.11.",
    ),
    Private(
        "torch:Tensor._version", ("layer_scaling.py", "distributed/amax.py", "recompute.py"),
        "The in-place version counter: a cached FP8 weight is reused until the weight changes; no public reader.",
    ),
    Private(
        "torch.distributed.fsdp:FSDPModule", ("linear.py", "grouped/experts.py"),
        "FSDP marks the modules it manages with this flag; the layer reads it to choose the all-gather route.",
        attribute="_is_fsdp_managed_module",
        source="torch.distributed.fsdp._fully_shard._fully_shard",
    ),
    Private(
        "torch.optim.lr_scheduler:LRScheduler", ("optim/optimizer.py",),
        "LR schedulers warn that optimizer.step() was skipped unless the optimizer's _opt_called flag is set; the "
        "FP8 optimizer updates the parameters itself, so it sets the flag on the inner optimizer "
        "(mark_optimizer_stepped).",
        attribute="_opt_called",
    ),
    # ---- Lightning ------------------------------------------------------------------------------------------
    Private(
        "lightning.pytorch.trainer.connectors.accelerator_connector:_AcceleratorConnector",
        ("lightning/registration.py",),
        "Trainer(precision=...) is checked against a fixed list with no registry; wrapping this constructor is the "
        "least invasive way to accept the FP8 strings (plugins=[FP8Precision(...)] needs none of it).",
    ),
    Private(
        "lightning.fabric.connector:_Connector", ("lightning/registration.py",),
        "Fabric's twin of _AcceleratorConnector, wrapped for Fabric(precision=...).",
    ),
    Private(
        "lightning.pytorch.trainer.connectors.accelerator_connector:_AcceleratorConnector",
        ("lightning/registration.py",),
        "The devices the Trainer chose, read once after construction to refuse a CUDA device without FP8 "
        "(parallel_devices).",
        attribute="_parallel_devices",
    ),
    Private(
        "lightning.pytorch.strategies:Strategy", ("lightning/registration.py",),
        "Whether a strategy instance already carries a precision plugin: the public precision_plugin property "
        "returns a default plugin when none was given (carried_precision).",
        attribute="_precision_plugin",
    ),
    Private(
        "lightning.fabric.strategies:Strategy", ("lightning/registration.py",),
        "Fabric's twin of Strategy._precision_plugin (carried_precision).",
        attribute="_precision",
    ),
    Private(
        "lightning.pytorch.strategies:ModelParallelStrategy", ("lightning/fsdp.py",),
        "data_parallel_size='auto' is resolved to every rank once the devices are known; Lightning reads the size "
        "from this attribute and has no public setter (set_data_parallel_size).",
        attribute="_data_parallel_size",
    ),
    Private(
        "lightning.pytorch.strategies:ModelParallelStrategy", ("lightning/fsdp.py",),
        "The tensor-parallel size as given, read to resolve data_parallel_size='auto' before Lightning builds the "
        "device mesh (no public getter before then; tensor_parallel_size).",
        attribute="_tensor_parallel_size",
    ),
    Private(
        "lightning.fabric.utilities.init:_materialize_distributed_module", ("lightning/fsdp.py",),
        "The meta-device materialization ModelParallelStrategy.setup runs, reused by the FP8 FSDP2 strategy's "
        "setup for a module it sharded itself.",
    ),
    Private(
        "lightning.pytorch.strategies:DDPStrategy._register_ddp_hooks", ("lightning/ddp.py",),
        "Overridden to register the FP8 gradient hook on CPU too (Lightning registers comm hooks on CUDA only); "
        "the hook itself is registered with torch's public DistributedDataParallel.register_comm_hook.",
    ),
    Private(
        "lightning.pytorch.strategies:DDPStrategy", ("lightning/ddp.py",),
        "The ddp_comm_hook / ddp_comm_state / ddp_comm_wrapper constructor arguments, stored without public getters.",
        attribute="_ddp_comm_state",
    ),
    Private(
        "lightning.pytorch:LightningModule", ("lightning/precision.py",),
        "The Trainer a module is attached to, or None: the public trainer property raises when there is none.",
        attribute="_trainer",
    ),
    # ---- Triton ---------------------------------------------------------------------------------------------
    Private(
        "triton.language.standard:_elementwise_max", ("kernels/per_tensor.py",),
        "The combine function of tl.max, passed to tl.reduce to reduce amaxes with NaN kept; not exported.",
    ),
    Private(
        "triton.experimental.gluon._runtime:GluonASTSource", ("kernels/aot.py",),
        "Compiles the Gluon MX GEMM ahead of time for a GPU the machine does not have; Gluon is experimental and "
        "exports no public source class.",
    ),
)


# --------------------------------------------------------------------------------------------------------------
# Accessors: the one place each private instance attribute is read or written
# --------------------------------------------------------------------------------------------------------------


def mark_optimizer_stepped(optimizer: Any) -> None:
    """Tell LR schedulers built on ``optimizer`` that a step happened (``LRScheduler`` checks ``_opt_called``)."""
    optimizer._opt_called = True


def local_shard(tensor: Any) -> Any:
    """The local shard of a ``DTensor`` (no autograd node); the tensor itself otherwise."""
    return getattr(tensor, "_local_tensor", tensor)


def carried_precision(strategy: Any) -> Any:
    """The precision plugin a strategy *instance* was given (Trainer: ``_precision_plugin``, Fabric:
    ``_precision``), or None; a strategy name (a string) carries none."""
    if isinstance(strategy, str):
        return None
    return getattr(strategy, "_precision_plugin", None) or getattr(strategy, "_precision", None)


def parallel_devices(connector: Any) -> list:
    """The devices a Trainer's / Fabric's connector chose."""
    return list(getattr(connector, "_parallel_devices", None) or [])


def data_parallel_size(strategy: Any) -> Any:
    """``ModelParallelStrategy``'s data-parallel size as given (an int or ``"auto"``)."""
    return strategy._data_parallel_size


def tensor_parallel_size(strategy: Any) -> Any:
    """``ModelParallelStrategy``'s tensor-parallel size as given (an int or ``"auto"``)."""
    return strategy._tensor_parallel_size


def set_data_parallel_size(strategy: Any, size: int) -> None:
    """Set the size ``ModelParallelStrategy.setup_environment`` builds its device mesh with."""
    strategy._data_parallel_size = size
