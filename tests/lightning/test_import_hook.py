"""``import fp8_lightning`` leaves Lightning alone until the program imports it, then registers at once.

Each case runs in a fresh interpreter: what is in ``sys.modules`` before and after is the thing under test.
"""

import subprocess
import sys
import textwrap

import pytest

CORE = ", ".join(f"fp8_lightning.{name}" for name in ("formats", "quantize", "linear", "convert", "recipes"))
LIGHTNING_FREE = ("lightning", "pytorch_lightning", "lightning_fabric", "hydra", "omegaconf")


def _run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_core_modules_do_not_import_lightning():
    _run(
        f"""
        import sys
        import {CORE}
        import fp8_lightning
        loaded = [m for m in {LIGHTNING_FREE!r} if m in sys.modules]
        assert not loaded, loaded
        """
    )


TRAINER_AND_FABRIC = """
    import lightning.pytorch as pl
    from lightning.fabric import Fabric
    trainer = pl.Trainer(precision="fp8-hybrid", accelerator="cpu", logger=False, enable_checkpointing=False)
    assert type(trainer.precision_plugin).__name__ == "FP8Precision", trainer.precision_plugin
    fabric = Fabric(precision="fp8-hybrid", accelerator="cpu")
    assert type(fabric.strategy.precision).__name__ == "FP8FabricPrecision", fabric.strategy.precision
    for name, cls in (("fp8_ddp", "FP8DDPStrategy"), ("fp8_fsdp", "FP8FSDPStrategy")):
        assert name in pl.strategies.StrategyRegistry, name
        assert pl.strategies.StrategyRegistry[name]["strategy"].__name__ == cls
    """


@pytest.mark.parametrize("lightning_first", [False, True], ids=["fp8_lightning-first", "lightning-first"])
def test_precision_strings_registered_whichever_is_imported_first(lightning_first):
    first, second = "import lightning", "import fp8_lightning"
    if not lightning_first:
        first, second = second, first
    _run(f"{first}\n{second}\n" + textwrap.dedent(TRAINER_AND_FABRIC))


def test_registration_through_the_hook_happens_once():
    _run(
        """
        import fp8_lightning
        from fp8_lightning.lightning.hook import LightningImportHook
        import lightning.pytorch as pl
        from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector
        wrapped = _AcceleratorConnector.__init__
        fp8_lightning.register_precision_strings()
        assert _AcceleratorConnector.__init__ is wrapped
        assert "lightning" not in LightningImportHook.watched
        """
    )


@pytest.mark.parametrize(
    "first",
    [
        "from fp8_lightning import FP8DDPStrategy",
        "from fp8_lightning import FP8FSDPStrategy",
        "from fp8_lightning import FP8Precision",
        "import fp8_lightning.lightning.registration",
        "import fp8_lightning.lightning.plugin_base",
    ],
)
def test_an_adapter_imported_first_brings_lightning_in_and_registers(first):
    """The adapter's own import of Lightning fires the hook while the adapter is half imported: the registration
    waits for it."""
    _run(f"{first}\n" + textwrap.dedent(TRAINER_AND_FABRIC))


def test_standalone_pytorch_lightning_imported_after():
    _run(
        """
        import fp8_lightning
        import pytorch_lightning as pl
        trainer = pl.Trainer(precision="fp8-hybrid", accelerator="cpu", logger=False, enable_checkpointing=False)
        assert type(trainer.precision_plugin).__module__ == "fp8_lightning.lightning.standalone"
        """
    )


def test_public_names_load_from_the_package_root():
    _run(
        """
        import sys
        import fp8_lightning
        assert "lightning" not in sys.modules
        from fp8_lightning import FP8Precision, FP8FSDPStrategy, FP8DDPStrategy, FP8StatsMonitor
        from fp8_lightning import FP8FabricPrecision, FP8OptimizerStates, register_precision_strings
        assert FP8Precision.__module__ == "fp8_lightning.lightning.precision"
        assert set(fp8_lightning.__all__) <= set(dir(fp8_lightning))
        for name in fp8_lightning.__all__:
            getattr(fp8_lightning, name)
        """
    )
