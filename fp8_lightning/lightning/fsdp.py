"""``FP8FSDPStrategy``: FSDP2 (``fully_shard``) through Lightning's ``ModelParallelStrategy``, with FP8 weights.

    trainer = Trainer(strategy="fp8_fsdp", precision="fp8-hybrid", devices=8)
    trainer = Trainer(strategy=FP8FSDPStrategy(block_classes=["Block"], reduce_dtype="bf16"),
                      plugins=[FP8Precision(recipe="mxfp8")])

The design in full: ``docs/design/notes.md``, section ``fp8_lightning.lightning.fsdp``.
"""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Generator, Iterable, Literal

import torch
import torch.nn as nn
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from fp8_lightning.distributed.reduce_scatter import enable_fp8_reduce_scatter, fp8_reduce_scatter_unsupported_reason
from fp8_lightning.distributed.sharding import (
    AllGatherReport,
    disable_fp8_all_gather,
    enable_fp8_all_gather,
    is_sharded,
    shard_model,
)
from fp8_lightning.lightning.plugin_base import parse_dtype, strict_bool
from fp8_lightning.privates import data_parallel_size, set_data_parallel_size, tensor_parallel_size
from fp8_lightning.recipes import RecipeLike, recipe_from


class FP8FSDPStrategy(ModelParallelStrategy):
    """FSDP2 with FP8 parameter all-gather for every recipe (see the module docstring).

    Args:
        recipe: recipe of the FP8 precision plugin the strategy installs when the Trainer has none (a Recipe,
            name or dict). With an FP8 precision plugin, leave it None (the plugin's recipe is used).
        fp8_all_gather: gather FP8 weights in FP8 (True) or in high precision (False, for comparison).
        fp8_reduce_scatter: reduce-scatter gradients with FP8 codes on the wire (float32 sums; torch >= 2.9).
        block_classes: class names of the modules to shard one by one (default: children of ModuleLists).
        activation_checkpointing: checkpoint every block (recomputed in FP8 during backward).
        param_dtype, reduce_dtype: FSDP2 ``MixedPrecisionPolicy``: dtype of high-precision all-gathers and of
            the gradient reduce-scatter (None: the parameter dtype, float32).
        reshard_after_forward: free gathered weights after forward (re-gathered for backward).
        data_parallel_size: ranks that shard the model (``"auto"``: all of them).
        tensor_parallel_size: kept at 1 by default (FSDP only); a user's ``configure_model`` may use more.
        save_distributed_checkpoint: one checkpoint shard per rank (True) or a full checkpoint on rank 0.
    """

    strategy_name = "fp8_fsdp"

    def __init__(
        self,
        recipe: RecipeLike = None,
        fp8_all_gather: bool = True,
        fp8_reduce_scatter: bool = False,
        block_classes: Iterable[str] | str | None = None,
        activation_checkpointing: bool = False,
        param_dtype: torch.dtype | str | None = None,
        reduce_dtype: torch.dtype | str | None = None,
        reshard_after_forward: bool = True,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = 1,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            data_parallel_size, tensor_parallel_size, save_distributed_checkpoint, process_group_backend, timeout
        )
        self.recipe = recipe_from(recipe) if recipe is not None else None
        self.fp8_all_gather = strict_bool(fp8_all_gather, type(self).__name__, "fp8_all_gather")
        self.fp8_reduce_scatter = strict_bool(fp8_reduce_scatter, type(self).__name__, "fp8_reduce_scatter")
        if self.fp8_reduce_scatter and (reason := fp8_reduce_scatter_unsupported_reason()) is not None:
            raise ValueError(f"FP8FSDPStrategy(fp8_reduce_scatter=True) is not available: {reason}.")
        self.block_classes = [block_classes] if isinstance(block_classes, str) else list(block_classes or [])
        self.activation_checkpointing = strict_bool(
            activation_checkpointing, type(self).__name__, "activation_checkpointing"
        )
        self.param_dtype = parse_dtype(param_dtype)
        self.reduce_dtype = parse_dtype(reduce_dtype)
        self.reshard_after_forward = bool(reshard_after_forward)
        self.all_gather_report: AllGatherReport | None = None

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="FSDP2 with FP8 parameter all-gather")

    # -- set-up -------------------------------------------------------------------------------------------------

    @override
    def setup_environment(self) -> None:
        shard_over_every_rank_by_default(self)
        super().setup_environment()
        self._ensure_fp8_precision()

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        self._prepare_fp8(self.lightning_module)  # layers built before configure_model
        with super().model_sharded_context():
            yield
        self._prepare_fp8(self.lightning_module)  # layers configure_model created
        if not is_sharded(self.lightning_module):
            self._shard_by_default_policy()
        self._finish_sharding()

    @override
    def setup(self, trainer: Any) -> None:
        """The user's ``configure_model`` ran in :meth:`model_sharded_context`, which sharded the module; without
        one, the default policy shards it here, before the optimizers are built (see :func:`setup_as_strategy`)."""
        if is_overridden("configure_model", self.lightning_module):
            return super().setup(trainer)
        if not is_sharded(self.lightning_module):
            self._prepare_fp8(self.lightning_module)
            self._shard_by_default_policy()
            self._finish_sharding()
        setup_as_strategy(self, trainer)

    def _ensure_fp8_precision(self) -> None:
        plugin = self.precision_plugin
        if hasattr(plugin, "convert_module") and hasattr(plugin, "recipe"):
            if self.recipe is not None and self.recipe != plugin.recipe:
                raise ValueError(
                    f"FP8FSDPStrategy(recipe={self.recipe!r}) differs from the FP8 precision plugin's recipe "
                    f"{plugin.recipe!r}; set the recipe in one place (the precision plugin)."
                )
            return
        from fp8_lightning.lightning.precision import FP8Precision

        if isinstance(plugin, MixedPrecision):
            dtype = torch.bfloat16 if plugin.precision == "bf16-mixed" else torch.float16
        elif type(plugin) is Precision:
            dtype = None
        else:
            raise ValueError(
                f"FP8FSDPStrategy cannot train in FP8 with the precision plugin {type(plugin).__name__} "
                f"(precision={getattr(plugin, 'precision', None)!r}); use precision='32-true', 'bf16-mixed' or an "
                "FP8 precision ('fp8-hybrid', plugins=[FP8Precision(...)])."
            )
        self.precision_plugin = FP8Precision(recipe=self.recipe, dtype=dtype)
        rank_zero_info(f"FP8FSDPStrategy: training with {self.precision_plugin!r}.")

    def _prepare_fp8(self, module: nn.Module) -> None:
        self.precision_plugin.convert_module(module)
        if self.fp8_all_gather:  # before configure_model: the FP8 tensor-parallel styles keep the FP8 gather
            self._report(enable_fp8_all_gather(module, self.device_mesh["data_parallel"].size()))

    def _report(self, report: AllGatherReport) -> None:
        """Keep ``report``, with the first reason found for each layer left in high precision (a layer refused
        before ``configure_model`` is reported later only as sharded without the FP8 gather)."""
        if self.all_gather_report is not None:
            hp = report.high_precision
            hp.update({name: why for name, why in self.all_gather_report.high_precision.items() if name in hp})
        self.all_gather_report = report

    def _mp_policy(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)

    def _shard_by_default_policy(self) -> None:
        module = self.lightning_module
        roots = default_roots(module)
        shard_model(
            module,
            mesh=self.device_mesh["data_parallel"],
            mp_policy=self._mp_policy(),
            reshard_after_forward=self.reshard_after_forward,
            block_classes=self.block_classes or None,
            activation_checkpointing=self.activation_checkpointing,
            roots=roots,
        )

    def _finish_sharding(self) -> None:
        module = self.lightning_module
        left = disable_fp8_all_gather(module)  # wrapped, but configure_model did not shard them
        if left:
            rank_zero_warn(f"FP8FSDPStrategy: {len(left)} FP8 layer(s) were not sharded and stay replicated: {left}.")
        if self.fp8_all_gather:
            self._report(enable_fp8_all_gather(module, self.device_mesh["data_parallel"].size()))
            if self.all_gather_report.high_precision:
                rank_zero_info(str(self.all_gather_report))
        if self.fp8_reduce_scatter:
            enable_fp8_reduce_scatter(module)

    # -- training -----------------------------------------------------------------------------------------------

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulate unsharded gradients locally on all but the last micro-batch (no reduce-scatter)."""
        from torch.distributed.fsdp import FSDPModule

        modules = [m for m in self.model.modules() if isinstance(m, FSDPModule)] if self.model is not None else []
        for m in modules:
            m.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for m in modules:
                m.set_requires_gradient_sync(True, recurse=False)


def default_roots(module: nn.Module) -> list[nn.Module]:
    """What takes the parameters left over after the blocks: each top-level child that holds parameters (the
    usual ``self.model``), or the LightningModule itself when parameters sit on it directly or are shared
    between its children (tied embeddings); then its ``forward`` must be what ``training_step`` calls."""
    children = [child for child in module.children() if any(True for _ in child.parameters())]
    owners: dict[int, int] = {}
    for index, child in enumerate(children):
        for p in child.parameters():
            owners.setdefault(id(p), index)
            if owners[id(p)] != index:
                return [module]
    if any(True for _ in module.parameters(recurse=False)):
        return [module]
    return children


def shard_over_every_rank_by_default(strategy: ModelParallelStrategy) -> None:
    """Resolve ``data_parallel_size="auto"`` to every rank (nodes x processes per node) over the tensor-parallel
    size: FSDP over all the data-parallel replicas.

    ``ModelParallelStrategy`` reads the size from its ``_data_parallel_size`` attribute in ``setup_environment``
    and resolves ``"auto"`` to the number of nodes (tensor parallelism taking the processes of a node). The number
    of processes is known only once the Trainer has handed the strategy its devices, after the constructor, and
    Lightning offers no public setter: this is the one place the strategy writes a Lightning attribute
    (``tests/distributed/test_strategy_options.py`` fails if Lightning renames it or stops reading it there).
    """
    if data_parallel_size(strategy) == "auto":
        world = strategy.num_nodes * strategy.num_processes
        tp = tensor_parallel_size(strategy)
        if tp != "auto" and world % int(tp):
            raise ValueError(
                f"{type(strategy).__name__}(tensor_parallel_size={tp}) does not divide the {world} processes "
                f"({strategy.num_nodes} node(s) x {strategy.num_processes}); pick a tensor-parallel size that does."
            )
        set_data_parallel_size(strategy, world // (1 if tp == "auto" else int(tp)))


def setup_as_strategy(strategy: ModelParallelStrategy, trainer: Any) -> None:
    """``ModelParallelStrategy.setup`` for a module the strategy has sharded itself, without its demand for a
    ``configure_model`` hook.

    ``ModelParallelStrategy.setup`` is the base ``Strategy.setup`` (accelerator, precision conversion, device,
    optimizers, precision plugin) plus a refusal of modules without ``configure_model`` or with FSDP1 wrappers,
    a materialization of meta-device parameters, and a barrier. The default policy stands in for
    ``configure_model``, so this runs the base steps after the materialization and the barrier, and the user's
    LightningModule is left as it is (``tests/distributed/test_strategy_options.py`` fails if Lightning adds a
    step to ``ModelParallelStrategy.setup`` that this does not take).
    """
    from lightning.fabric.utilities.init import _materialize_distributed_module

    _materialize_distributed_module(strategy.model, strategy.root_device)
    strategy.barrier()
    super(ModelParallelStrategy, strategy).setup(trainer)


def register_fsdp_strategy() -> None:
    """Make ``Trainer(strategy="fp8_fsdp")`` work (idempotent)."""
    from lightning.pytorch.strategies import StrategyRegistry

    if FP8FSDPStrategy.strategy_name not in StrategyRegistry:
        FP8FSDPStrategy.register_strategies(StrategyRegistry)
