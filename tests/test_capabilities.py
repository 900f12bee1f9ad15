"""The capability table: its routes agree with the library's own device checks on simulated GPUs, conversion warns
once where a recipe would not run natively, and the profitability gate uses the route's rate (tests/test_docs.py
checks the support matrix's copies)."""

from __future__ import annotations

import warnings

import pytest
import torch

from fp8_lightning import capability_table as caps
from fp8_lightning import convert_to_fp8
from fp8_lightning.blockwise import blockwise_gemm_support
from fp8_lightning.gemm import fp8_gemm_support, native_mx_gemm_support
from fp8_lightning.gemm_routes import EMULATED, FALLBACK, NATIVE, REFUSED
from fp8_lightning.profitability import ProfitabilityGate
from fp8_lightning.roofline import _datasheet
from fp8_lightning.recipes import RECIPES, recipe_from

ARCHS = [(8, 0), (8, 9), (9, 0), (10, 0), (12, 0)]
CUDAS = ["12.4", "12.8", "12.9", "13.0"]


@pytest.fixture
def simulated_gpu(monkeypatch):
    """Make torch report one CUDA device of a chosen capability and CUDA version (no GPU needed)."""

    def simulate(capability: tuple[int, int], cuda: str = "12.9", name: str = "NVIDIA H100 80GB HBM3"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(torch.version, "cuda", cuda)
        monkeypatch.setattr(caps, "_warned", set())

    return simulate


@pytest.mark.parametrize("cuda", CUDAS)
@pytest.mark.parametrize("capability", ARCHS, ids=lambda c: f"sm_{c[0]}{c[1]}")
def test_routes_agree_with_the_checks_the_gemms_make(simulated_gpu, capability, cuda):
    simulated_gpu(capability, cuda)
    table = caps.capabilities("cuda")
    runs = fp8_gemm_support("cuda")[0]
    assert table["tensorwise"].runs == table["delayed"].runs == runs
    if not runs:
        assert all(route.verdict == REFUSED for route in table.values())
        return
    assert (table["blockwise"].verdict == NATIVE) == blockwise_gemm_support("cuda")[0]
    assert (table["mxfp8"].verdict == NATIVE) == native_mx_gemm_support("cuda")[0]
    assert table["tensorwise"].verdict == table["rowwise"].verdict == NATIVE


def test_the_cpu_emulates_every_recipe():
    table = caps.capabilities("cpu")
    assert set(table) == set(RECIPES)
    assert {route.verdict for route in table.values()} == {EMULATED}


def test_mxfp8_on_hopper_warns_once_at_conversion_and_tensorwise_not_at_all(simulated_gpu):
    simulated_gpu((9, 0))
    for recipe, expected in (("tensorwise", 0), ("mxfp8", 1)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(2):
                caps.warn_if_not_native(recipe_from(recipe), "cuda")
        mine = [w for w in seen if "fp8_lightning.capability_table" in str(w.message)]
        assert len(mine) == expected, [str(w.message) for w in seen]
    assert "Triton MX GEMM" in str(mine[0].message) and "0.31x" in str(mine[0].message)


@pytest.mark.parametrize("capability, warned", [((9, 0), 1), ((10, 0), 0), ((12, 0), 0)])
def test_nvfp4_warns_once_where_it_is_emulated_and_not_where_cublas_runs_it(simulated_gpu, capability, warned):
    simulated_gpu(capability)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            caps.warn_if_not_native(recipe_from("nvfp4"), "cuda")
    mine = [str(w.message) for w in seen if "fp8_lightning.capability_table" in str(w.message)]
    assert len(mine) == warned, mine
    if warned:
        assert "sm_90 has no FP4 tensor cores" in mine[0] and "float32 emulation" in mine[0], mine
    else:
        assert caps.recipe_route(recipe_from("nvfp4"), "cuda").gemm.startswith("cuBLAS NVFP4")


def test_conversion_on_cpu_does_not_warn():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_to_fp8(model, "mxfp8")


def test_the_gate_keeps_mxfp8_layers_in_bf16_on_hopper_and_converts_them_on_blackwell(simulated_gpu):
    layer = torch.nn.Linear(4096, 4096)
    h100 = _datasheet("H100 SXM", 989, 1979, 3.35)
    gate = ProfitabilityGate(device="cuda", roofline=h100)
    simulated_gpu((9, 0))
    reason = gate.skip_reason(layer, recipe_from("mxfp8"))
    assert reason is not None and "Triton MX GEMM" in reason and "0.31x the bf16 rate" in reason
    assert gate.skip_reason(layer, recipe_from("tensorwise")) is None
    simulated_gpu((10, 0), name="NVIDIA B200")
    assert gate.skip_reason(layer, recipe_from("mxfp8")) is None


def test_cli_exit_code_says_whether_the_recipe_runs(simulated_gpu, capsys):
    simulated_gpu((8, 0), name="NVIDIA A100")
    assert caps.main(["--recipe", "tensorwise", "--device", "cuda"]) == 1
    assert "refused" in capsys.readouterr().out
    simulated_gpu((9, 0))
    assert caps.main(["--recipe", "mxfp8", "--device", "cuda"]) == 0
    assert FALLBACK in capsys.readouterr().out


def test_the_package_exports_the_table():
    import fp8_lightning

    assert fp8_lightning.capabilities("cpu") == caps.capabilities("cpu")


def test_a_recipe_that_does_not_say_is_reported_unknown_not_a_crash(simulated_gpu):
    from fp8_lightning.gemm_routes import UNKNOWN
    from fp8_lightning.recipes import Recipe

    simulated_gpu((9, 0))
    route = caps.route_on(Recipe.__new__(Recipe), (9, 0), (12, 9), True)
    assert route.verdict == UNKNOWN and "gemm_route" in route.why and route.runs
