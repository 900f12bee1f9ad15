"""One capability table: for each recipe on a device, whether its GEMMs run natively, fall back (which way, at what
rate) or are refused, and why. Conversion consults it once per recipe and device and warns with the row where a
recipe would not run natively; the profitability gate reads its rate; the README's support matrix is generated
from it (``python -m fp8_lightning.capability_table --matrix``), and a test keeps the two equal.

    python -m fp8_lightning.capability_table            # this machine's table
    python -m fp8_lightning.capability_table --matrix   # every recipe x sm_89/sm_90/sm_100/sm_120, as in the README
    python -m fp8_lightning.capability_table --matrix --grouped   # the same for the expert (grouped) GEMMs
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch

from fp8_lightning.formats import FP8_MIN_CAPABILITY
from fp8_lightning.gemm_routes import (
    EMULATED,
    NATIVE,
    NATIVE_FP8_RATE,
    REFUSED,
    UNKNOWN,
    CudaVersion,
    GemmRoute,
    arch_name,
    cuda_name,
)
from fp8_lightning.recipes import RECIPES, Recipe, recipe_from

MATRIX_ARCHS = ((8, 9), (9, 0), (10, 0), (12, 0))
MATRIX_CUDA = (12, 9)  # the CUDA the matrix assumes (torch 2.11 wheels ship 12.6, 12.8, 12.9 and 13.0)
CPU_ROUTE = GemmRoute(EMULATED, "float GEMM on the FP8 codes' exact values (C codec)",
                      "the CPU has no FP8 tensor cores: FP8 numerics, emulated", 0.0)


def built_in_recipes() -> dict[str, type[Recipe]]:
    """The recipes this package ships (the registry also holds those a user defines)."""
    return {name: cls for name, cls in RECIPES.items() if cls.__module__.startswith("fp8_lightning.recipes.")}


def route_on(recipe: Recipe, capability: tuple[int, int], cuda: CudaVersion, has_v2: bool) -> GemmRoute:
    """The route of ``recipe`` on a simulated CUDA device: refused below sm_89, else the recipe's own answer."""
    if capability < FP8_MIN_CAPABILITY:
        need = arch_name(FP8_MIN_CAPABILITY)
        return GemmRoute(REFUSED, "none", f"{arch_name(capability)} has no FP8 tensor cores or conversions (needs "
                         f"{need}+); pass emulate=True to emulate FP8 numerics in float32", 0.0)
    try:
        return recipe.gemm_route(capability, cuda, has_v2)
    except NotImplementedError as missing:  # a user's recipe that does not say: assume its GEMMs run natively
        return GemmRoute(UNKNOWN, "the recipe's own GEMMs", str(missing), NATIVE_FP8_RATE)


def grouped_route_on(recipe: Recipe, capability: tuple[int, int], cuda: CudaVersion, has_grouped: bool) -> GemmRoute:
    """The route of ``recipe``'s grouped (expert) GEMMs on a simulated CUDA device: refused below sm_89, else the
    recipe's own answer (:meth:`~fp8_lightning.recipes.base.Recipe.grouped_gemm_route`)."""
    if capability < FP8_MIN_CAPABILITY:
        return route_on(recipe, capability, cuda, False)
    return recipe.grouped_gemm_route(capability, cuda, has_grouped)


def recipe_grouped_route(recipe: Recipe, device: torch.device | str | None = None) -> GemmRoute:
    """The route of ``recipe``'s grouped GEMMs on ``device`` (default: the current CUDA device, else the CPU)."""
    device = _default_device(device)
    if device.type != "cuda":
        return CPU_ROUTE
    capability, cuda, _ = device_facts(device)
    return grouped_route_on(recipe, capability, cuda, hasattr(torch, "_scaled_grouped_mm"))


def grouped_support_matrix(cuda: CudaVersion = MATRIX_CUDA) -> str:
    """Every recipe's grouped (expert) GEMMs x :data:`MATRIX_ARCHS`, with ``cuda`` and torch 2.11's API."""
    return _matrix(lambda recipe, arch: grouped_route_on(recipe, arch, cuda, True))


def device_facts(device: torch.device) -> tuple[tuple[int, int], CudaVersion, bool]:
    """(compute capability, CUDA version, torch has v2 ``scaled_mm``) of a CUDA device."""
    from fp8_lightning.blockwise import _cuda_version, has_scaled_mm_v2

    return tuple(torch.cuda.get_device_capability(device)), _cuda_version(), has_scaled_mm_v2()


def recipe_route(recipe: Recipe, device: torch.device | str | None = None) -> GemmRoute:
    """The route of ``recipe`` on ``device`` (default: the current CUDA device, else the CPU)."""
    device = _default_device(device)
    if device.type != "cuda":
        return CPU_ROUTE
    return route_on(recipe, *device_facts(device))


def capabilities(device: torch.device | str | None = None) -> dict[str, GemmRoute]:
    """Which GEMM serves every registered recipe (its defaults) on ``device``, natively or not, and why.

    Args:
        device: a torch device; default: the current CUDA device, else the CPU.

    Returns:
        ``{recipe name: GemmRoute}``; each route has ``verdict`` (native, fallback, refused, emulated or unknown),
        ``gemm`` (what runs), ``why`` and ``rate_vs_bf16`` (GEMM throughput relative to bf16 on that device).
    """
    return {name: recipe_route(cls(), device) for name, cls in RECIPES.items()}


def _default_device(device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


_warned: set[tuple[str, str]] = set()


def warn_if_not_native(recipe: Recipe, device: torch.device | str | None) -> GemmRoute:
    """Warn once per recipe and device where ``recipe`` would fall back or be refused on ``device``."""
    device = _default_device(device)
    route = recipe_route(recipe, device)
    key = (recipe.name, str(device))
    if route.verdict not in (NATIVE, EMULATED) and key not in _warned:
        _warned.add(key)
        rate = f", about {route.rate_vs_bf16:.2f}x the bf16 GEMM rate" if route.runs else ""
        warnings.warn(f"{type(recipe).__name__} on {device}: {route.verdict}: {route.gemm}{rate}. {route.why}. "
                      "`python -m fp8_lightning.capability_table` lists every recipe on this device.", stacklevel=3)
    return route


# --------------------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------------------


def _cell(route: GemmRoute) -> str:
    slower = route.verdict == NATIVE and route.rate_vs_bf16 < 1  # a native kernel measured slower than bf16
    rate = f" ({route.rate_vs_bf16:.2f}x bf16)" if slower or route.verdict not in (NATIVE, REFUSED, EMULATED) else ""
    return f"{route.verdict}: {route.gemm}{rate}"


def support_matrix(cuda: CudaVersion = MATRIX_CUDA, has_v2: bool = True) -> str:
    """The README's support matrix: every recipe x :data:`MATRIX_ARCHS`, with ``cuda`` and torch 2.11's API."""
    return _matrix(lambda recipe, arch: route_on(recipe, arch, cuda, has_v2))


def _matrix(route_of) -> str:
    """A Markdown table of ``route_of(recipe, arch)`` for every built-in recipe x :data:`MATRIX_ARCHS`."""
    header = "| recipe | " + " | ".join(arch_name(a) for a in MATRIX_ARCHS) + " |"
    lines = [header, "|---|" + "---|" * len(MATRIX_ARCHS)]
    for name, cls in built_in_recipes().items():
        lines.append(f"| {name} | " + " | ".join(_cell(route_of(cls(), arch)) for arch in MATRIX_ARCHS) + " |")
    return "\n".join(lines)


def device_table(device: torch.device | str | None = None) -> str:
    device = _default_device(device)
    where = str(device)
    if device.type == "cuda":
        capability, cuda, _ = device_facts(device)
        where = f"{torch.cuda.get_device_name(device)} ({arch_name(capability)}, {cuda_name(cuda)})"
    lines = [f"FP8 recipes on {where}, torch {torch.__version__}:"]
    for name, route in capabilities(device).items():
        lines.append(f"  {name:<11} {_cell(route)}\n  {'':<11} {route.why}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Which GEMM serves each FP8 recipe, natively or not, and why.")
    parser.add_argument("--matrix", action="store_true", help="every recipe x sm_89/sm_90/sm_100/sm_120 (Markdown)")
    parser.add_argument("--grouped", action="store_true", help="with --matrix: the grouped (expert) GEMMs")
    parser.add_argument("--recipe", help="one recipe by name (default: all)")
    parser.add_argument("--device", help="a torch device (default: cuda if available, else cpu)")
    args = parser.parse_args(argv)
    if args.matrix:
        print(grouped_support_matrix() if args.grouped else support_matrix())
        return 0
    if args.recipe:
        recipe = recipe_from(args.recipe)
        route = recipe_route(recipe, args.device)
        print(f"{recipe.name}: {_cell(route)}\n  {route.why}")
        return 0 if route.runs else 1
    print(device_table(args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
