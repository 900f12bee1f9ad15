"""The roofline of a linear layer's and a fused experts projection's forward+backward, in bf16 and in FP8.

A GEMM takes ``max(flops / peak, bytes / bandwidth)`` on a device; FP8 halves the operands' bytes and doubles the
tensor-core rate but adds the casts' memory passes and their launches. The device numbers come from datasheets
(``KNOWN_DEVICES``, at :data:`ACHIEVABLE` of their peaks) or are measured once on the device and cached. The
profitability gate (:mod:`fp8_lightning.profitability`) and the grouped benchmark's ceilings read this model.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

import torch

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
