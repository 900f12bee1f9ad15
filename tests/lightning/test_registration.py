"""Precision strings for Trainer and Fabric: registration, idempotency, untouched other values, clear errors."""

import types

import lightning as L
import pytest
import torch

import fp8_lightning
from fp8_lightning import FP8FabricPrecision, FP8Precision
from fp8_lightning.lightning import registration
from fp8_lightning.lightning.strings import PRECISION_RECIPES, precision_for_recipe
from fp8_lightning.recipes import BlockwiseScaling, DelayedScaling, MXFP8BlockScaling, RowwiseScaling, TensorwiseScaling

QUIET = dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)


def test_strings_map_to_the_documented_recipes():
    assert PRECISION_RECIPES["fp8-hybrid"] == DelayedScaling(fp8_format="HYBRID", amax_history_len=16,
                                                             amax_compute_algo="max")  # fmt: skip
    e4m3 = PRECISION_RECIPES["fp8-e4m3"]
    assert isinstance(e4m3, DelayedScaling) and e4m3.fp8_format.backward_dtype == torch.float8_e4m3fn
    assert PRECISION_RECIPES["fp8-tensorwise"] == TensorwiseScaling(fp8_format="HYBRID")
    assert isinstance(PRECISION_RECIPES["fp8-mxfp8"], MXFP8BlockScaling)
    assert PRECISION_RECIPES["fp8-rowwise"] == RowwiseScaling()
    assert PRECISION_RECIPES["fp8-blockwise"] == BlockwiseScaling()
    assert precision_for_recipe(DelayedScaling(margin=2)) == "fp8-delayed"


@pytest.mark.parametrize("precision", list(PRECISION_RECIPES) + ["FP8-Hybrid"])
def test_trainer_and_fabric_accept_each_string(precision):
    trainer = L.Trainer(precision=precision, **QUIET)
    assert trainer.precision == precision.lower()
    assert isinstance(trainer.precision_plugin, FP8Precision)
    assert trainer.precision_plugin.recipe == PRECISION_RECIPES[precision.lower()]
    fabric = L.Fabric(precision=precision, accelerator="cpu")
    assert isinstance(fabric.strategy.precision, FP8FabricPrecision)
    assert fabric.strategy.precision.precision == precision.lower()


def test_standalone_pytorch_lightning_package_is_covered():
    pl = pytest.importorskip("pytorch_lightning")
    trainer = pl.Trainer(precision="fp8-e4m3", **QUIET)
    assert trainer.precision == "fp8-e4m3"
    assert isinstance(trainer.precision_plugin, pl.plugins.precision.Precision)
    assert type(trainer.precision_plugin).__name__ == "FP8Precision"  # same checkpoint key as lightning.pytorch


def test_registration_is_idempotent_and_leaves_other_values_alone():
    init = L.pytorch.trainer.connectors.accelerator_connector._AcceleratorConnector.__init__
    assert fp8_lightning.register_precision_strings() == fp8_lightning.register_precision_strings()
    assert L.pytorch.trainer.connectors.accelerator_connector._AcceleratorConnector.__init__ is init
    assert L.Trainer(precision="bf16-mixed", **QUIET).precision == "bf16-mixed"
    assert L.Trainer(**QUIET).precision == "32-true"
    with pytest.raises(ValueError, match="Precision 'int7' is invalid"):  # Lightning's own error, unchanged
        L.Trainer(precision="int7", **QUIET)


def test_unknown_fp8_string_lists_the_valid_ones():
    for make in (lambda: L.Trainer(precision="fp8-e5m2", **QUIET), lambda: L.Fabric(precision="fp8")):
        with pytest.raises(ValueError, match="allowed: fp8-hybrid, fp8-e4m3, fp8-tensorwise, fp8-mxfp8, fp8-rowwise, fp8-blockwise"):
            make()


def test_plugin_route_needs_no_string_and_reports_conflicts():
    plugin = FP8Precision(recipe="mxfp8")
    trainer = L.Trainer(plugins=[plugin], **QUIET)
    assert trainer.precision_plugin is plugin and trainer.precision == "fp8-mxfp8"
    with pytest.raises(ValueError, match="both choose the precision; pass only one"):
        L.Trainer(precision="fp8-hybrid", plugins=[FP8Precision()], **QUIET)


def test_strategy_carrying_a_precision_plugin():
    from lightning.pytorch.plugins import MixedPrecision
    from lightning.pytorch.strategies import SingleDeviceStrategy

    same = SingleDeviceStrategy("cpu", precision_plugin=FP8Precision(recipe="tensorwise"))
    same.precision_plugin.precision = "fp8-tensorwise"
    assert L.Trainer(strategy=same, precision="fp8-tensorwise", **QUIET).precision == "fp8-tensorwise"
    other = SingleDeviceStrategy("cpu", precision_plugin=MixedPrecision("bf16-mixed", "cpu"))
    with pytest.raises(ValueError, match="conflicts with the precision plugin .* that the strategy carries"):
        L.Trainer(strategy=other, precision="fp8-hybrid", **QUIET)


@pytest.mark.parametrize("route", ["string", "plugin"])
def test_fsdp1_is_refused_with_what_to_use_instead(route):
    kwargs = {"precision": "fp8-hybrid"} if route == "string" else {"plugins": [FP8Precision()]}
    with pytest.raises(ValueError, match="FSDPStrategy.*ModelParallelStrategy with torch's fully_shard"):
        L.Trainer(strategy="fsdp", **kwargs, **QUIET)
    with pytest.raises(ValueError, match="FSDPStrategy.*FP8 FSDP2 strategy"):
        L.Fabric(strategy="fsdp", precision="fp8-hybrid", accelerator="cpu")


def test_cuda_device_without_fp8_gets_the_core_message(monkeypatch):
    monkeypatch.setattr("fp8_lightning.gemm.fp8_gemm_support", lambda device: (False, "compute capability 8.0"))
    family = registration._FAMILIES[0]
    connector = types.SimpleNamespace(precision_plugin=FP8Precision(), _parallel_devices=[torch.device("cuda", 0)])
    with pytest.raises(RuntimeError, match="FP8 training cannot run here: compute capability 8.0.*emulate=True"):
        registration.check_accelerator(connector, family)
    connector.precision_plugin = FP8Precision(emulate=True)
    registration.check_accelerator(connector, family)  # emulation requested: accepted
    cpu = types.SimpleNamespace(precision_plugin=FP8Precision(), _parallel_devices=[torch.device("cpu")])
    registration.check_accelerator(cpu, family)
