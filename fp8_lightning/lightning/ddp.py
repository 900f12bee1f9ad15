"""``FP8DDPStrategy``: Lightning's ``DDPStrategy`` with FP8 gradient communication as one switch.

    trainer = Trainer(strategy=FP8DDPStrategy(fp8_gradients=True), devices=8)
    fp8-train strategy=ddp strategy.fp8_gradients=true          # the Hydra config conf/strategy/ddp.yaml

``fp8_gradients=True`` registers :func:`~fp8_lightning.distributed.fp8_compress_hook` with a fresh
:class:`~fp8_lightning.distributed.FP8CommState` (``fp8_format``, ``block_size``): gradients are averaged with FP8
codes on the wire and float32 sums. With ``fp8_gradients=False`` this is ``DDPStrategy`` unchanged.

One difference from ``DDPStrategy``: Lightning registers a ``ddp_comm_hook`` only on CUDA devices and silently
ignores it elsewhere; this strategy registers it on any device (the FP8 hook runs on gloo as well as NCCL), so a
CPU run communicates the way a GPU run would.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from fp8_lightning.distributed.grad_comm import DEFAULT_GRAD_BLOCK_SIZE, FP8CommState, fp8_compress_hook
from fp8_lightning.lightning.plugin_base import strict_bool


class FP8DDPStrategy(DDPStrategy):
    """``DDPStrategy`` that can average gradients in FP8 (see the module docstring).

    Args:
        fp8_gradients: register the FP8 communication hook.
        fp8_format: ``"e4m3"`` (default) or ``"e5m2"`` codes on the wire.
        block_size: elements sharing one scale (None: one per rank's chunk of a bucket).
        **kwargs: ``DDPStrategy``'s arguments (``find_unused_parameters``, ``process_group_backend``, ...).
    """

    strategy_name = "fp8_ddp"

    def __init__(
        self,
        fp8_gradients: bool = False,
        fp8_format: str = "e4m3",
        block_size: int | None = DEFAULT_GRAD_BLOCK_SIZE,
        **kwargs: Any,
    ) -> None:
        self.fp8_gradients = strict_bool(fp8_gradients, type(self).__name__, "fp8_gradients")
        if self.fp8_gradients:
            if kwargs.get("ddp_comm_hook") is not None:
                raise ValueError(
                    "FP8DDPStrategy(fp8_gradients=True) registers its own communication hook; drop ddp_comm_hook="
                    f"{kwargs['ddp_comm_hook']!r} or set fp8_gradients=False."
                )
            kwargs["ddp_comm_hook"] = fp8_compress_hook
            kwargs["ddp_comm_state"] = FP8CommState(fp8_format=fp8_format, block_size=block_size)
        super().__init__(**kwargs)

    @property
    def fp8_comm_state(self) -> FP8CommState | None:
        """The hook's state (its automatic factors and back-off counts), or None without FP8 gradients."""
        state = self._ddp_comm_state
        return state if isinstance(state, FP8CommState) else None

    @override
    def _register_ddp_hooks(self) -> None:
        if self.root_device.type == "cuda" or self._ddp_comm_hook is None:
            return super()._register_ddp_hooks()
        hook = self._ddp_comm_hook if self._ddp_comm_wrapper is None else self._ddp_comm_wrapper(self._ddp_comm_hook)
        self.model.register_comm_hook(state=self._ddp_comm_state, hook=hook)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="DDP with FP8 gradient communication",
                                   fp8_gradients=True)


def register_ddp_strategy() -> None:
    """Make ``Trainer(strategy="fp8_ddp")`` work: DDP with FP8 gradients (idempotent)."""
    from lightning.pytorch.strategies import StrategyRegistry

    if FP8DDPStrategy.strategy_name not in StrategyRegistry:
        FP8DDPStrategy.register_strategies(StrategyRegistry)
