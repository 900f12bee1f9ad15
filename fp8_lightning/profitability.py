"""Per-layer profitability gate: keep a linear layer or experts module in high precision where FP8 would be slower.

FP8 halves the bytes a GEMM reads and doubles the tensor-core rate, but it adds work the bf16 layer does not
have: amax reductions, scaled casts of the input, the weight and the output gradient, transposed (per-tensor)
or columnwise (MXFP8) copies for the backward GEMMs, and a handful of extra kernel launches. For a large GEMM
the saving wins; for a small one the extra passes and launches cost more than the GEMMs save. Users of every
FP8 stack hit this ("FP8 slower than bf16 on small layers"); this module decides per layer, at conversion time.

The decision is a roofline model of one layer's forward and backward (fprop, dgrad and wgrad) with ``M`` tokens,
``K`` input and ``N`` output features::

    gemm(flops, bytes)  = max(flops / peak_flops, bytes / bandwidth)
    t_bf16 = 3 * gemm(2MKN at bf16 peak,  2 * (MK + NK + MN) bytes)
    t_fp8  = 3 * gemm(2MKN at fp8 peak,   (MK + NK) + 2MN bytes)
           + cast_bytes_per_element * (MK + NK + MN) / bandwidth      (amax, cast, transposed/columnwise copies)
           + extra_kernels * launch_latency
    FP8 pays off when  t_fp8 * min_speedup <= t_bf16

The design in full: ``docs/design/notes.md``, section ``fp8_lightning.profitability``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Iterator, Union

import torch
import torch.nn as nn

from fp8_lightning.capability_table import recipe_grouped_route, recipe_route
from fp8_lightning.gemm_routes import NATIVE
from fp8_lightning.grouped.experts import expert_weights
from fp8_lightning.recipes import Recipe
from fp8_lightning.roofline import DeviceRoofline, device_roofline, experts_cost, layer_cost
from fp8_lightning.roofline import KNOWN_DEVICES  # noqa: F401  (importable from here, as before the split)

# --------------------------------------------------------------------------------------------------------
# The gate
# --------------------------------------------------------------------------------------------------------

GATE_FIX = "pass profitability=False to convert it anyway"  # ends every reason the gate gives
DEFAULT_EXPERTS_TOP_K = 1  # experts per token where neither the model nor the gate says: the fewest routed rows
_MODULE_TOP_K = ("top_k", "num_experts_per_tok")  # a router's or MoE block's own attribute
_ASSUMED_TOP_K = "assumed: the model does not say; pass ProfitabilityGate(experts_top_k=...)"
_CONFIG_TOP_K = ("num_experts_per_tok", "moe_top_k", "experts_per_token")  # transformers maps moe_k, moe_topk here


def _emulated_reason(device: torch.device) -> str:
    return (f"FP8 is emulated on {device.type} (never faster than float32 there); profitability gate forced on; "
            f"{GATE_FIX}")


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _said_top_k(module: nn.Module, with_children: bool, experts: int | None) -> int | None:
    holders = [(module, _MODULE_TOP_K), (getattr(module, "config", None), _CONFIG_TOP_K)]
    holders += [(child, _MODULE_TOP_K) for child in module.children()] if with_children else []
    values = (getattr(holder, name, None) for holder, names in holders if holder is not None for name in names)
    return next((value for value in values if _positive_int(value) and (experts is None or value <= experts)), None)


def model_top_k(model: nn.Module, name: str) -> int | None:
    """The experts per token (top-k) of the experts module ``name`` of ``model``, where the model says it.

    Asked nearest first: the module itself (its ``top_k``, or its config's ``num_experts_per_tok``, as transformers'
    Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3 and gpt-oss experts hold it), then each enclosing module: its own
    ``top_k``, its config's, and its children's ``top_k`` (the router beside the experts). None where none says.
    A value above the module's number of experts belongs to something else (a sampling ``top_k``) and is passed by.
    """
    parts = [] if name in ("", "<root>") else name.split(".")
    chain = [model.get_submodule(".".join(parts[:depth])) for depth in range(len(parts) + 1)]
    weights = expert_weights(chain[-1])
    experts = None if weights is None else getattr(chain[-1], next(iter(weights))).shape[0]
    said = (_said_top_k(module, module is not chain[-1], experts) for module in reversed(chain))
    return next((value for value in said if value is not None), None)


@dataclasses.dataclass
class ProfitabilityGate:
    """Keeps layers whose modelled FP8 forward+backward is not faster than bf16 in high precision.

    Args:
        tokens: tokens per micro-batch (``M`` of every GEMM) the model is trained with.
        min_speedup: FP8 must be modelled at least this much faster (1.0: not slower).
        device: where the model will train (default: the layer's weight device).
        roofline: device numbers to use instead of the table / measurement (tests, what-if studies).
        experts_top_k: experts each token is routed to, for fused experts modules; None: what the model says
            (:func:`model_top_k`), else :data:`DEFAULT_EXPERTS_TOP_K`. Experts see ``tokens x top_k / E`` rows each.
        microbatches: gradient-accumulation micro-batches per optimizer step; they share each weight's cast (cached
            while the weight is unchanged), so a forward+backward pays ``1 / microbatches`` weight casts.
    """

    tokens: int = 8192
    min_speedup: float = 1.0
    device: torch.device | str | None = None
    roofline: DeviceRoofline | None = None
    experts_top_k: int | None = None
    microbatches: int = 1

    def __post_init__(self) -> None:
        if not _positive_int(self.tokens):
            raise ValueError(
                f"ProfitabilityGate.tokens={self.tokens!r} is invalid; allowed: an integer >= 1, the tokens per "
                "micro-batch (batch size x sequence length) the model trains with."
            )
        speedup = self.min_speedup
        if isinstance(speedup, bool) or not isinstance(speedup, (int, float)) or not 0 < speedup < float("inf"):
            raise ValueError(
                f"ProfitabilityGate.min_speedup={speedup!r} is invalid; allowed: a finite number > 0 (1.0: FP8 must "
                "not be modelled slower than bf16; 1.2: at least 20% faster)."
            )
        if self.experts_top_k is not None and not _positive_int(self.experts_top_k):
            raise ValueError(
                f"ProfitabilityGate.experts_top_k={self.experts_top_k!r} is invalid; allowed: None (the model's own "
                f"top-k, else {DEFAULT_EXPERTS_TOP_K}) or an integer >= 1, the experts each token is routed to."
            )
        if not _positive_int(self.microbatches):
            raise ValueError(
                f"ProfitabilityGate.microbatches={self.microbatches!r} is invalid; allowed: an integer >= 1, the "
                "gradient-accumulation micro-batches per optimizer step (1 without accumulation)."
            )
        known = dict(KNOWN_DEVICES)
        if isinstance(self.roofline, str) and self.roofline in known:  # a device of the table, by name
            object.__setattr__(self, "roofline", known[self.roofline])
        if self.roofline is not None and not isinstance(self.roofline, DeviceRoofline):
            raise ValueError(
                f"ProfitabilityGate.roofline={self.roofline!r} is invalid; allowed: None (the device's own numbers), a "
                f"fp8_lightning.roofline.DeviceRoofline, or the name of a known device: {', '.join(known)}."
            )
        if self.device is not None:
            try:
                object.__setattr__(self, "device", torch.device(self.device))
            except (RuntimeError, TypeError, ValueError):
                raise ValueError(
                    f"ProfitabilityGate.device={self.device!r} is invalid; allowed: None (the layer's weight device), "
                    "a torch.device or a device string such as 'cuda' or 'cuda:0'."
                ) from None

    def applies_to(self, device: torch.device) -> bool:
        return self.roofline is not None or device.type == "cuda"

    def skip_reason(self, layer: nn.Linear, recipe: Recipe) -> str | None:
        """Why ``layer`` should stay in high precision, or None when FP8 pays off."""
        device = torch.device(self.device) if self.device is not None else layer.weight.device
        if not self.applies_to(device):
            return _emulated_reason(device)
        roofline = self.roofline or device_roofline(device)
        m, k, n = self.tokens, layer.in_features, layer.out_features
        route = recipe_route(recipe, device) if device.type == "cuda" else None
        slower = route is not None and route.verdict != NATIVE
        rate = roofline.bf16_flops * route.rate_vs_bf16 if slower else None
        cost = layer_cost(m, k, n, recipe, roofline, rate, 1 / self.microbatches)
        if cost.fp8_s * self.min_speedup <= cost.bf16_s:
            return None
        what = f"{route.gemm} at {route.rate_vs_bf16:.2f}x the bf16 rate" if slower else "too small to gain from FP8"
        return (
            f"{what} on {roofline.name}: GEMMs (M={m}, K={k}, N={n}) modelled at "
            f"{cost.fp8_s * 1e6:.1f} us in FP8 vs {cost.bf16_s * 1e6:.1f} us in bf16 ({self._per_step()}, roofline "
            f"from {roofline.source}); {GATE_FIX}"
        )

    def _per_step(self) -> str:
        return "fwd+bwd" + (f", weight cast shared by {self.microbatches} micro-batches" * (self.microbatches > 1))

    def experts_skip_reason(
        self, device: torch.device, recipe: Recipe | None = None, experts: nn.Module | None = None,
        top_k: int | None = None,
    ) -> str | None:
        """Why fused experts on ``device`` should stay in high precision under ``recipe``, or None.

        The route first (:func:`~fp8_lightning.capability_table.recipe_grouped_route`): emulated in float32, or a
        native route measured slower than bf16 (rowwise on sm_90), keeps them in bf16. Where it is native and faster,
        each fused projection of ``experts`` (E, K, N from its 3-D weight) is modelled by :func:`experts_cost` at
        ``tokens x top_k`` routed rows (``top_k``: ``experts_top_k`` where set, else what the model says,
        :func:`model_top_k`, else :data:`DEFAULT_EXPERTS_TOP_K`) with ``1 / microbatches`` weight casts; the module
        stays in bf16 where the sum is modelled slower than bf16 x ``min_speedup``.
        Without ``experts`` only the route decides."""
        device = torch.device(self.device) if self.device is not None else device
        if not self.applies_to(device):
            return _emulated_reason(device)
        known = recipe is not None and device.type == "cuda" and torch.cuda.is_available()  # a device to ask
        route = recipe_grouped_route(recipe, device) if known else None
        if route is not None and route.verdict == NATIVE and route.rate_vs_bf16 > 1:
            return None if experts is None else self._modelled_experts_reason(experts, recipe, device, top_k)
        if route is not None and route.verdict == NATIVE:
            return (f"its grouped FP8 step ({route.gemm}) is rated {route.rate_vs_bf16:.2f}x the speed of bf16 grouped "
                    "GEMMs (fp8_lightning.gemm_routes: measured, or assumed until measured); pass profitability=False "
                    "to convert it anyway (FP8 numerics)")
        why = route.why if route is not None else "no FP8 grouped kernel was named for it"
        return (
            f"its grouped GEMMs would run emulated in float32 on {device.type} ({why}), slower than bf16; pass "
            "profitability=False to convert it anyway (FP8 numerics)"
        )

    def _modelled_experts_reason(
        self, experts: nn.Module, recipe: Recipe, device: torch.device, top_k: int | None
    ) -> str | None:
        """The roofline of ``experts``' projections on their native grouped route (GEMMs at the FP8 rate)."""
        if self.experts_top_k is not None:  # the user's word wins over what the model says
            top_k, source = self.experts_top_k, "ProfitabilityGate.experts_top_k"
        elif top_k is not None:
            source = "the model's"
        else:
            top_k, source = DEFAULT_EXPERTS_TOP_K, _ASSUMED_TOP_K
        roofline = self.roofline or device_roofline(device)
        m, shapes, bf16_s, fp8_s = self.tokens * top_k, [], 0.0, 0.0
        for name, stored_kn in expert_weights(experts).items():
            e, rows, cols = getattr(experts, name).shape
            k, n = (rows, cols) if stored_kn else (cols, rows)
            if top_k > e:
                raise ValueError(
                    f"top_k={top_k} ({source}) exceeds the {e} experts of {type(experts).__name__}; allowed: at most "
                    "the number of experts. Pass ProfitabilityGate(experts_top_k=...) with the model's top-k."
                )
            cost = experts_cost(m, e, k, n, recipe, roofline, weight_casts=1 / self.microbatches)
            bf16_s, fp8_s = bf16_s + cost.bf16_s, fp8_s + cost.fp8_s
            shapes.append(f"{name} (E={e}, K={k}, N={n})")
        if fp8_s * self.min_speedup <= bf16_s:
            return None
        return (
            f"too small to gain from FP8 on {roofline.name}: grouped GEMMs {', '.join(shapes)} at "
            f"{m / e:g} tokens per expert (tokens={self.tokens} x top_k={top_k} ({source}) / {e} experts) modelled "
            f"at {fp8_s * 1e6:.1f} us in FP8 vs {bf16_s * 1e6:.1f} us in bf16 ({self._per_step()}, roofline from "
            f"{roofline.source}); {GATE_FIX}"
        )


ProfitabilityLike = Union[str, bool, ProfitabilityGate, None]
_setting: contextvars.ContextVar[ProfitabilityLike] = contextvars.ContextVar("fp8_profitability", default="auto")


@contextlib.contextmanager
def profitability_setting(value: ProfitabilityLike) -> Iterator[None]:
    """Make ``value`` the default of :func:`~fp8_lightning.convert.convert_to_fp8` calls made inside."""
    token = _setting.set(value)
    try:
        yield
    finally:
        _setting.reset(token)


def profitability_default() -> ProfitabilityLike:
    """What ``profitability=None`` stands for here: the innermost :func:`profitability_setting`, else ``"auto"``."""
    return _setting.get()


def resolve_gate(value: ProfitabilityLike, device: torch.device | str | None = None) -> ProfitabilityGate | None:
    """The gate for a ``profitability=`` argument: ``"auto"`` (None: the current default), True, False or a gate.

    ``"auto"`` gates layers that will train on CUDA and keeps everything converted on CPU.
    """
    if value is None:
        value = _setting.get()
    if isinstance(value, ProfitabilityGate):
        return value if value.device is not None or device is None else dataclasses.replace(value, device=device)
    if value is False:
        return None
    if value is True:
        return ProfitabilityGate(device=device)
    if value == "auto":
        return _AutoGate(device=device)
    raise ValueError(
        f"profitability={value!r} is invalid; allowed: 'auto' (gate on CUDA, off on CPU), True, False or a "
        "ProfitabilityGate(tokens=..., min_speedup=...)."
    )


class _AutoGate(ProfitabilityGate):
    """``"auto"``: the gate on CUDA, every layer kept on other devices (see the module docstring)."""

    def experts_skip_reason(
        self, device: torch.device, recipe: Recipe | None = None, experts: nn.Module | None = None,
        top_k: int | None = None,
    ) -> str | None:
        device = torch.device(self.device) if self.device is not None else device
        return super().experts_skip_reason(device, recipe, experts, top_k) if device.type == "cuda" else None

    def skip_reason(self, layer: nn.Linear, recipe: Recipe) -> str | None:
        device = torch.device(self.device) if self.device is not None else layer.weight.device
        return super().skip_reason(layer, recipe) if device.type == "cuda" else None
