"""``FP8StatsMonitor``: which FP8 layers are close to numerical trouble, logged while training.

Every ``log_every_n_steps`` optimizer steps the monitor collects, per converted layer and GEMM operand
(``input``, ``weight``, ``grad_output``): the amax, the scale, the fraction of values saturated (overflow) and
the fraction of non-zero values flushed to zero (underflow), and logs them through the Trainer's loggers as
``fp8/<layer>/<operand>/<amax|scale|overflow|underflow>`` (the step is the optimizer step measured). At the end
of ``fit`` it prints a table of the layers closest to trouble (largest overflow/underflow fractions, least
headroom below the format's max) with the divergence guard's fallbacks, and keeps it in :attr:`summary`.

The numbers come from :class:`~fp8_lightning.stats.StatsCollector`, installed as the layers' ``fp8_observer``
only while the monitor is attached; the statistics are computed only in the steps that are logged, so steps in
between cost nothing extra, and a run without the monitor has no observers at all.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from fp8_lightning.convert import scaled_modules
from fp8_lightning.guard import DivergenceGuard
from fp8_lightning.lightning.plugin_base import FP8PrecisionMixin
from fp8_lightning.stats import OperandStats, StatsCollector, attach_collector, detach_collector


@dataclasses.dataclass
class TroubleRow:
    """Worst values seen for one (layer, operand) over the logged steps."""

    layer: str
    role: str
    max_overflow: float = 0.0
    max_underflow: float = 0.0
    min_headroom_bits: float = math.inf
    nonfinite_steps: int = 0
    last_amax: float = 0.0
    last_scale: float = 0.0
    disabled_reason: str | None = None

    def add(self, s: OperandStats) -> None:
        self.max_overflow = max(self.max_overflow, s.overflow)
        self.max_underflow = max(self.max_underflow, s.underflow)
        if not math.isnan(s.headroom_bits):
            self.min_headroom_bits = min(self.min_headroom_bits, s.headroom_bits)
        self.nonfinite_steps += int(s.nonfinite)
        self.last_amax, self.last_scale = s.amax, s.scale

    def trouble(self, guard: DivergenceGuard) -> float:
        """1.0 means a guard threshold is reached; fallbacks and non-finite values rank first."""
        if self.disabled_reason is not None or self.nonfinite_steps:
            return math.inf
        return max(self.max_overflow / max(guard.overflow_threshold, 1e-12),
                   self.max_underflow / max(guard.underflow_threshold, 1e-12))  # fmt: skip


def metrics_of(stats: dict[tuple[str, str], OperandStats]) -> dict[str, float]:
    """Logger-ready metrics: ``fp8/<layer>/<role>/<field>``."""
    out = {}
    for (layer, role), s in stats.items():
        prefix = f"fp8/{layer}/{role}"
        out.update({f"{prefix}/amax": s.amax, f"{prefix}/scale": s.scale,
                    f"{prefix}/overflow": s.overflow, f"{prefix}/underflow": s.underflow})  # fmt: skip
    return out


def format_table(rows: list[TroubleRow]) -> str:
    width = max([28] + [len(r.layer) for r in rows])  # whole names: the end alone does not say which model part
    header = f"{'layer':<{width}} {'operand':<11} {'overflow':>9} {'underflow':>9} {'headroom':>9} {'amax':>10}  status"
    lines = ["FP8 layers closest to trouble (worst values over the logged steps):", header]
    for r in rows:
        status = f"fell back: {r.disabled_reason}" if r.disabled_reason else (
            f"non-finite in {r.nonfinite_steps} step(s)" if r.nonfinite_steps else "ok")
        lines.append(
            f"{r.layer:<{width}} {r.role:<11} {r.max_overflow:>9.2e} {r.max_underflow:>9.2e} "
            f"{round(r.min_headroom_bits, 1) + 0.0:>8.1f}b {r.last_amax:>10.3g}  {status}"  # + 0.0: no "-0.0b"
        )
    return "\n".join(lines)


class FP8StatsMonitor(Callback):
    """Log FP8 amax, scale, overflow and underflow per layer and operand every ``log_every_n_steps`` steps.

    Args:
        log_every_n_steps: optimizer steps between two measured (and logged) steps; step 0 is measured.
        top_k: rows of the end-of-fit table.
        print_summary: print the table at the end of ``fit`` (rank 0); it is kept in :attr:`summary` anyway.
    """

    def __init__(self, log_every_n_steps: int = 50, top_k: int = 10, print_summary: bool = True) -> None:
        if isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps={log_every_n_steps!r} is invalid; allowed: an integer >= 1.")
        self.log_every_n_steps = log_every_n_steps
        self.top_k = top_k
        self.print_summary = print_summary
        self.rows: dict[tuple[str, str], TroubleRow] = {}
        self.summary: str = ""
        self._collector: StatsCollector | None = None
        self._measured_step: int | None = None
        self._finished_before = 0  # collector.steps_finished when the measured step began

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._collector = attach_collector(pl_module)  # after the strategy converted the layers

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        if self._collector is not None and trainer.global_step % self.log_every_n_steps == 0:
            self._collector.request_step()
            if self._measured_step != trainer.global_step:  # first micro-batch of the step
                self._measured_step, self._finished_before = trainer.global_step, self._collector.steps_finished

    @override
    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Any) -> None:
        collector, step = self._collector, self._measured_step
        if collector is None or step is None or step != trainer.global_step:
            return
        if collector.pending:
            stats = collector.finish_step()
        else:  # the guard finished the step already, or nothing ran in FP8
            stats = collector.last if collector.steps_finished > self._finished_before else {}
        self._measured_step = None
        for key, s in stats.items():
            self.rows.setdefault(key, TroubleRow(*key)).add(s)
        if stats:
            for logger in trainer.loggers:
                logger.log_metrics(metrics_of(stats), step=step)

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        plugin = trainer.precision_plugin
        guard = getattr(plugin, "divergence_guard", None) or DivergenceGuard()
        for name, layer in scaled_modules(pl_module):
            rows = [r for r in self.rows.values() if r.layer == name]
            if not rows and layer.fp8_disabled_reason is not None:  # fell back before any measured step
                rows = [self.rows.setdefault((name, "-"), TroubleRow(name, "-"))]
            for row in rows:
                row.disabled_reason = layer.fp8_disabled_reason
        ranked = sorted(self.rows.values(), key=lambda r: (-r.trouble(guard), r.min_headroom_bits))
        self.summary = format_table(ranked[: self.top_k])
        if isinstance(plugin, FP8PrecisionMixin) and plugin.guard_state is not None:
            self.summary += "\n" + plugin.guard_state.summary()
        if self.print_summary:
            rank_zero_info(self.summary)

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        plugin = trainer.precision_plugin
        guard_on = isinstance(plugin, FP8PrecisionMixin) and plugin.divergence_guard is not None
        if self._collector is not None and not guard_on:
            detach_collector(pl_module)  # back to zero observation cost
        self._collector = None

