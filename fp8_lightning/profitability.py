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
import json
import pathlib
import time
from typing import Iterator, Union

import torch
import torch.nn as nn

from fp8_lightning.capability_table import recipe_grouped_route, recipe_route
from fp8_lightning.gemm_routes import NATIVE
from fp8_lightning.grouped.experts import expert_weights
from fp8_lightning.recipes import Recipe
from fp8_lightning.settings import settings

ACHIEVABLE = 0.7  # fraction of datasheet peaks that large GEMMs and copies reach in practice


@dataclasses.dataclass(frozen=True)
class DeviceRoofline:
    """What one device does per second: dense bf16 and FP8 FLOP/s, memory bytes/s, and a launch latency."""

    name: str
    bf16_flops: float
    fp8_flops: float
    bandwidth: float
    launch_s: float = 5e-6
    source: str = "datasheet x 0.7"


def _datasheet(name: str, bf16_tflops: float, fp8_tflops: float, tb_per_s: float) -> DeviceRoofline:
    a = ACHIEVABLE
    return DeviceRoofline(name, bf16_tflops * 1e12 * a, fp8_tflops * 1e12 * a, tb_per_s * 1e12 * a)


# Dense (no sparsity) datasheet peaks. Matched by substring of torch.cuda.get_device_name(), first match wins.
KNOWN_DEVICES = [
    ("H200", _datasheet("H200", 989, 1979, 4.8)),
    ("H100 PCIe", _datasheet("H100 PCIe", 756, 1513, 2.0)),
    ("H100 NVL", _datasheet("H100 NVL", 835, 1671, 3.9)),
    ("H100", _datasheet("H100 SXM", 989, 1979, 3.35)),
    ("H20", _datasheet("H20", 148, 296, 4.0)),
    ("B200", _datasheet("B200", 2250, 4500, 8.0)),
    ("L40S", _datasheet("L40S", 362, 733, 0.864)),
    ("L4", _datasheet("L4", 121, 242, 0.3)),
    ("RTX 4090", _datasheet("RTX 4090", 165, 330, 1.0)),
]


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """Modelled forward+backward seconds of one linear layer in bf16 and in FP8."""

    bf16_s: float
    fp8_s: float

    @property
    def speedup(self) -> float:
        return self.bf16_s / self.fp8_s


def cast_bytes_per_element(recipe: Recipe) -> float:
    """Extra memory traffic per operand element for the FP8 casts (bf16 in, 1-byte codes out).

    Tensorwise: amax read (2) + cast read (2) + write (1) + transposed copy (1 + 1) = 7. Delayed: the amax comes
    out of the cast kernel itself, 5. MXFP8: rowwise and columnwise copies each read bf16 and write codes and
    block scales (2 + 1 + 1/32, twice), about 6.1. Rowwise and blockwise: two copies per operand, each an amax
    pass and a cast pass over bf16 plus the codes (2 + 2 + 1) and a float32 scale per row or per 128 elements
    (counted as 4/128; the blockwise weight's second copy is a transpose of codes, which costs less), about 10.1.
    """
    return recipe.cast_bytes_per_element()


EXTRA_KERNELS = 9  # three casts (with their amax) and three transposed copies, plus scale updates


def layer_cost(
    m: int, k: int, n: int, recipe: Recipe, device: DeviceRoofline, fp8_flops: float | None = None,
    weight_casts: float = 1.0,
) -> LayerCost:
    """The roofline model of the module docstring for one (M, K, N) layer. ``fp8_flops``: the rate of the
    recipe's FP8 GEMMs where they do not run on FP8 tensor cores (:mod:`fp8_lightning.capability_table`);
    ``weight_casts``: as in :func:`experts_cost`."""
    return experts_cost(m, 1, k, n, recipe, device, fp8_flops, weight_casts)


def experts_cost(
    m: int, experts: int, k: int, n: int, recipe: Recipe, device: DeviceRoofline, fp8_flops: float | None = None,
    weight_casts: float = 1.0,
) -> LayerCost:
    """The same roofline for one grouped projection: ``m`` routed tokens over ``experts`` weights (K, N) each.

    The GEMMs' FLOPs follow the tokens, but every expert's weight is read (and, in FP8, cast with its copies) each
    step, whatever its tokens: with few tokens per expert the weight casts alone outweigh what FP8 saves.
    ``weight_casts``: weight casts per forward+backward, 1 per step, ``1 / k`` where ``k`` micro-batches of
    gradient accumulation share the cast of an unchanged weight (the layer caches it by weight version)."""

    def gemm(flops: float, nbytes: float, peak: float) -> float:
        return max(flops / peak, nbytes / device.bandwidth)

    flops = 2.0 * m * k * n
    weight = experts * n * k
    bf16 = 3 * gemm(flops, 2.0 * (m * k + weight + m * n), device.bf16_flops)
    fp8_gemms = recipe.fp8_gemms()  # rowwise: wgrad may stay in bf16
    rate = fp8_flops or device.fp8_flops
    fp8 = fp8_gemms * gemm(flops, (m * k + weight) + 2.0 * m * n, rate) + (3 - fp8_gemms) * bf16 / 3
    fp8 += cast_bytes_per_element(recipe) * (m * k + weight_casts * weight + m * n) / device.bandwidth
    fp8 += EXTRA_KERNELS * device.launch_s
    return LayerCost(bf16, fp8)


# --------------------------------------------------------------------------------------------------------
# Device numbers: table, or measured once and cached
# --------------------------------------------------------------------------------------------------------


def _cache_file() -> pathlib.Path:
    return settings().cache / "roofline.json"


def _timed(fn, repeats: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def measure_cuda_roofline(device: torch.device, size: int = 8192) -> DeviceRoofline:
    """Measure bf16 and FP8 GEMM rates and copy bandwidth on ``device`` (a few seconds)."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    bf16_s = _timed(lambda: a @ b.t())
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)
    fp8_s = _timed(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    copy_s = _timed(lambda: a.clone())
    empty = torch.empty(1, device=device)
    launch_s = _timed(lambda: empty.add_(1), repeats=200)
    flops = 2.0 * size**3
    name = torch.cuda.get_device_name(device)
    return DeviceRoofline(name, flops / bf16_s, flops / fp8_s, 2 * a.numel() * 2 / copy_s, launch_s, "measured")


def device_roofline(device: torch.device | str) -> DeviceRoofline:
    """The roofline numbers of a CUDA device: the table, else the cache, else measured now and cached."""
    device = torch.device(device)
    name = torch.cuda.get_device_name(device)
    for key, known in KNOWN_DEVICES:
        if key in name:
            return known
    path = _cache_file()
    cached = json.loads(path.read_text()) if path.exists() else {}
    key = f"{name} | torch {torch.__version__}"
    if key not in cached:
        cached[key] = dataclasses.asdict(measure_cuda_roofline(device))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cached, indent=2))
    return DeviceRoofline(**cached[key])


# --------------------------------------------------------------------------------------------------------
# The gate
# --------------------------------------------------------------------------------------------------------

DEFAULT_EXPERTS_TOP_K = 1  # experts per token where neither the model nor the gate says: the fewest routed rows
_MODULE_TOP_K = ("top_k", "num_experts_per_tok")  # a router's or MoE block's own attribute
_ASSUMED_TOP_K = "assumed: the model does not say; pass ProfitabilityGate(experts_top_k=...)"
_CONFIG_TOP_K = ("num_experts_per_tok", "moe_top_k", "experts_per_token")  # transformers maps moe_k, moe_topk here


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _said_top_k(module: nn.Module, with_children: bool) -> int | None:
    holders = [(module, _MODULE_TOP_K), (getattr(module, "config", None), _CONFIG_TOP_K)]
    holders += [(child, _MODULE_TOP_K) for child in module.children()] if with_children else []
    values = (getattr(holder, name, None) for holder, names in holders if holder is not None for name in names)
    return next((value for value in values if _positive_int(value)), None)


def model_top_k(model: nn.Module, name: str) -> int | None:
    """The experts per token (top-k) of the experts module ``name`` of ``model``, where the model says it.

    Asked nearest first: the module itself (its ``top_k``, or its config's ``num_experts_per_tok``, as transformers'
    Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3 and gpt-oss experts hold it), then each enclosing module: its own
    ``top_k``, its config's, and its children's ``top_k`` (the router beside the experts). None where none says.
    """
    parts = [] if name in ("", "<root>") else name.split(".")
    chain = [model.get_submodule(".".join(parts[:depth])) for depth in range(len(parts) + 1)]
    said = (_said_top_k(module, with_children=module is not chain[-1]) for module in reversed(chain))
    return next((value for value in said if value is not None), None)


@dataclasses.dataclass
class ProfitabilityGate:
    """Keeps layers whose modelled FP8 forward+backward is not faster than bf16 in high precision.

    Args:
        tokens: tokens per micro-batch (``M`` of every GEMM) the model is trained with.
        min_speedup: FP8 must be modelled at least this much faster (1.0: not slower).
        device: where the model will train (default: the layer's weight device).
        roofline: device numbers to use instead of the table / measurement (tests, what-if studies).
        experts_top_k: experts each token is routed to, for fused experts modules whose model does not say
            (:func:`model_top_k`); None: :data:`DEFAULT_EXPERTS_TOP_K`. Experts see ``tokens x top_k / E`` rows each.
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

    def applies_to(self, device: torch.device) -> bool:
        return self.roofline is not None or device.type == "cuda"

    def skip_reason(self, layer: nn.Linear, recipe: Recipe) -> str | None:
        """Why ``layer`` should stay in high precision, or None when FP8 pays off."""
        device = torch.device(self.device) if self.device is not None else layer.weight.device
        if not self.applies_to(device):
            return f"FP8 is emulated on {device.type} (never faster than float32 there); profitability gate forced on"
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
            f"from {roofline.source}); pass profitability=False to convert it anyway"
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
        ``tokens x top_k`` routed rows (``top_k``: what the model says, :func:`model_top_k`; else ``experts_top_k``,
        else :data:`DEFAULT_EXPERTS_TOP_K`) with ``1 / microbatches`` weight casts; the module stays in bf16 where
        the sum is modelled slower than bf16 x ``min_speedup``. Without ``experts`` only the route decides."""
        device = torch.device(self.device) if self.device is not None else device
        if not self.applies_to(device):
            return f"FP8 is emulated on {device.type} (never faster than float32 there); profitability gate forced on"
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
        source = "the model's" if top_k is not None else "ProfitabilityGate.experts_top_k"
        if (top_k := top_k or self.experts_top_k) is None:
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
            f"{roofline.source}); pass profitability=False to convert it anyway"
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
