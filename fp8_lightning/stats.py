"""FP8 numerics statistics per layer and GEMM operand: amax, scale, overflow and underflow fractions.

Casting to FP8 loses information in two ways that training can notice:

* **overflow (saturation)**: ``|x * scale| > fp8_max``; the value is clamped to ``fp8_max``. Happens when the
  scale is stale (delayed scaling after an amax jump) or, for MXFP8 with "floor" rounding, at block tops.
* **underflow (flush to zero)**: a non-zero ``x`` whose FP8 code is zero; it falls below the smallest
  subnormal after scaling. Happens when the scale is too small for most of the tensor (a spike in the amax
  history) or the dynamic range of the tensor exceeds the format's.

The counts are computed from the high-precision tensor and the :class:`~fp8_lightning.quantize.Quantized`
operand that the GEMM really used, by small pure functions below. :class:`StatsCollector` installs itself as
``layer.fp8_observer`` on the converted layers (only while something wants the numbers: the
``FP8StatsMonitor`` callback or the divergence guard; otherwise layers have no observer and pay nothing),
accumulates one optimizer step's counts on the device without host synchronisation, and turns them into
:class:`OperandStats` rows with a single host transfer in :meth:`StatsCollector.finish_step`, optionally after
one MAX all-reduce so that every data-parallel rank sees the same numbers (and takes the same decisions).

One collector is shared per model (:func:`attach_collector`), so a monitor and a guard never observe twice.
This module is plain PyTorch and never imports Lightning.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn as nn

from fp8_lightning.convert import fp8_expert_modules, fp8_modules
from fp8_lightning.ops.dispatch import fast_amax
from fp8_lightning.quantize import Quantized, float8_limits

ROLES = ("input", "weight", "grad_output")
_FIELDS = ("seen", "amax", "overflow", "underflow", "nonfinite", "scale", "order")  # columns of the packed step tensor
_COLLECTOR_ATTR = "_fp8_stats_collector"


# --------------------------------------------------------------------------------------------------------
# Pure functions
# --------------------------------------------------------------------------------------------------------


def scale_multiplier(q: Quantized, k: int) -> torch.Tensor:
    """The factor each element was multiplied by before the FP8 cast, broadcastable to ``q.data[..., :k]``.

    Per-tensor and rowwise: ``q.scale`` (data = saturate(x * scale), one per tensor or per row). MX:
    ``1 / block_scale`` repeated over each block. Blockwise: each tile's scale repeated over its tile.
    """
    return q.kind.scale_multiplier(q, k)


def saturation_threshold(dtype: torch.dtype) -> float:
    """The scaled magnitude above which the cast's clamp changes a value: the format's max plus half a unit in
    the last place there. Values between the max and this round to the max anyway (the largest element of a
    tensor scaled to exactly ``fp8_max`` lands a float32 rounding step either side of it), so they are not
    overflow."""
    return float8_limits(dtype)[1]


def overflow_count(x: torch.Tensor, q: Quantized) -> torch.Tensor:
    """Number of elements of ``x`` that the cast saturated: their scaled magnitude was above
    :func:`saturation_threshold`, so the clamp to the format's max changed them."""
    scaled = x.detach().float() * scale_multiplier(q, x.shape[-1])
    return (scaled.abs() > q.kind.value_limits(q)[1]).sum()


def underflow_count(x: torch.Tensor, q: Quantized) -> torch.Tensor:
    """Number of finite non-zero elements of ``x`` that were flushed to an FP8 zero."""
    x = x.detach()
    data = q.kind.code_values(q)[..., : x.shape[-1]]
    return ((x != 0) & torch.isfinite(x) & (data == 0)).sum()


def representative_scale(q: Quantized) -> torch.Tensor:
    """One number for the operand's scale: the per-tensor multiplier, or for MX, rowwise and blockwise the smallest
    row or block multiplier (the one with the largest values, which sets the tensor's headroom)."""
    return q.kind.representative_scale(q)


def headroom_bits(amax_value: float, scale: float, max_value: float) -> float:
    """``log2(fp8_max / (amax * scale))``: how many binades the largest value sits below saturation (negative
    means it saturated). ``inf`` for an all-zero tensor, NaN when amax is not finite."""
    if not math.isfinite(amax_value):
        return float("nan")
    top = amax_value * scale
    if top <= 0:
        return float("inf")
    return math.log2(max_value / top)


@dataclasses.dataclass(frozen=True)
class OperandStats:
    """One optimizer step's numbers for one GEMM operand of one layer (fractions are of all elements cast)."""

    layer: str
    role: str
    amax: float
    scale: float
    overflow: float
    underflow: float
    nonfinite: bool
    fp8_max: float
    order: int = 0  # when the operand was first cast in the step: forward inputs first, backward last


    @property
    def headroom_bits(self) -> float:
        return headroom_bits(self.amax, self.scale, self.fp8_max)


# --------------------------------------------------------------------------------------------------------
# The observer
# --------------------------------------------------------------------------------------------------------


class _Accumulator:
    """Device-side running totals of one (layer, role) within a step."""

    __slots__ = ("amax", "overflow", "underflow", "numel", "nonfinite", "scale", "fp8_max", "order")

    def __init__(self, device: torch.device, max_value: float, order: int):
        zero = torch.zeros((), dtype=torch.float32, device=device)
        self.amax, self.overflow, self.underflow, self.nonfinite, self.scale = (zero.clone() for _ in range(5))
        self.numel = 0
        self.fp8_max = max_value
        self.order = order

    def add(self, x: torch.Tensor, q: Quantized) -> None:
        a = fast_amax(x)
        finite = torch.isfinite(a)
        self.nonfinite = torch.maximum(self.nonfinite, (~finite).float())
        self.amax = torch.maximum(self.amax, torch.where(finite, a, torch.zeros_like(a)))
        self.overflow = self.overflow + overflow_count(x, q).float()
        self.underflow = self.underflow + underflow_count(x, q).float()
        self.scale = representative_scale(q).to(self.scale.device)
        self.numel += x.numel()

    def row(self) -> torch.Tensor:
        n = max(self.numel, 1)
        one = torch.ones((), dtype=torch.float32, device=self.amax.device)
        order = torch.full((), float(self.order), device=self.amax.device)
        return torch.stack([one, self.amax, self.overflow / n, self.underflow / n, self.nonfinite, self.scale, order])


class StatsCollector:
    """Per-step FP8 statistics of every converted layer of ``model``, gathered through ``fp8_observer`` hooks.

    ``always=True`` (the divergence guard) collects every step; otherwise only steps requested with
    :meth:`request_step` (a monitor that logs every N steps) are collected.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.names: dict[int, str] = {}
        self.keys: list[tuple[str, str]] = []
        self.always = False
        self.requested = False
        self.installed = False
        self._acc: dict[tuple[str, str], _Accumulator] = {}
        self.last: dict[tuple[str, str], OperandStats] = {}
        self.steps_finished = 0

    @property
    def enabled(self) -> bool:
        return self.always or self.requested

    @property
    def pending(self) -> bool:
        """True when the current step has counts that :meth:`finish_step` has not turned into rows yet."""
        return bool(self._acc)

    def install(self) -> "StatsCollector":
        """Hook every converted layer (idempotent; picks up layers converted since the last call)."""
        layers = list(fp8_modules(self.model))
        experts = list(fp8_expert_modules(self.model))  # roles per projection and expert (fp8_stat_roles)
        self.names = {id(layer): name for name, layer in layers + experts}
        self.keys = [(name, role) for name, _ in layers for role in ROLES]
        self.keys += [(name, role) for name, module in experts for role in module.fp8_stat_roles()]
        for _, layer in layers + experts:
            layer.fp8_observer = self.observe
        self.installed = True
        return self

    def remove(self) -> None:
        """Unhook all layers: they go back to zero observation cost."""
        for _, layer in [*fp8_modules(self.model), *fp8_expert_modules(self.model)]:
            if getattr(layer, "fp8_observer", None) == self.observe:
                layer.fp8_observer = None
        self.installed = False
        self._acc.clear()

    def request_step(self) -> None:
        """Collect the next optimizer step (until :meth:`finish_step`)."""
        self.requested = True

    def observe(self, layer: nn.Module, role: str, x: torch.Tensor, q: Quantized) -> None:
        if not self.enabled or not layer.training:  # evaluation forwards are not part of a training step
            return
        key = (self.names.get(id(layer), type(layer).__name__), role)
        acc = self._acc.get(key)
        if acc is None:
            acc = self._acc[key] = _Accumulator(x.device, q.kind.value_limits(q)[0], len(self._acc))
        with torch.no_grad():
            acc.add(x, q)

    def finish_step(self, reduce_group: "dist.ProcessGroup | None" = None, reduce: bool = False) -> dict:
        """Close the step: one host transfer (and with ``reduce`` one MAX all-reduce across ranks) turns the
        accumulated counts into ``{(layer, role): OperandStats}``, stored in :attr:`last`; counts are reset."""
        if not self.keys and not self._acc:
            self.requested = False
            return {}
        keys = self.keys or list(self._acc)
        device = next((a.amax.device for a in self._acc.values()), torch.device("cpu"))
        blank = torch.zeros(len(_FIELDS), dtype=torch.float32, device=device)
        packed = torch.stack([self._acc[k].row() if k in self._acc else blank for k in keys])
        maxima = {k: self._acc[k].fp8_max for k in self._acc}
        if reduce and dist.is_available() and dist.is_initialized() and dist.get_world_size(reduce_group) > 1:
            dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=reduce_group)
        rows = packed.cpu().tolist()
        self.last = {
            key: OperandStats(
                key[0], key[1], r[1], r[5], r[2], r[3], r[4] > 0, maxima.get(key, float("nan")), int(r[6])
            )
            for key, r in zip(keys, rows)
            if r[0] > 0
        }
        self._acc.clear()
        self.requested = False
        self.steps_finished += 1
        return self.last


def attach_collector(model: nn.Module) -> StatsCollector:
    """The model's shared collector (created and installed on first use)."""
    collector = model.__dict__.get(_COLLECTOR_ATTR)
    if collector is None:
        collector = StatsCollector(model)
        model.__dict__[_COLLECTOR_ATTR] = collector
    return collector.install()


def detach_collector(model: nn.Module) -> None:
    """Remove the model's collector and unhook its layers."""
    collector = model.__dict__.pop(_COLLECTOR_ATTR, None)
    if collector is not None:
        collector.remove()
