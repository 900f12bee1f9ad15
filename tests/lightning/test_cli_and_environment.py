"""``import fp8_lightning`` works with the ways people configure Lightning and changes nothing else: LightningCLI
takes ``--trainer.precision fp8-...``, Lightning's loggers keep the user's settings (the standalone
``pytorch_lightning`` package is not imported), Fabric reads an FP8 ``LT_PRECISION`` (what ``fabric run`` sets),
and registration that cannot find Lightning's private names fails loudly, naming the ``plugins=`` route."""

import inspect
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest

from fp8_lightning import FP8FabricPrecision
from fp8_lightning.lightning import registration
from fp8_lightning.lightning.strings import PRECISION_RECIPES

REPO = Path(__file__).resolve().parents[2]
pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse[signatures] (dev extras)")


def _python(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """A fresh interpreter (nothing imported yet) in ``cwd``, where LightningCLI writes its config.yaml."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)  # keeps a chosen Lightning
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("precision", list(PRECISION_RECIPES))
def test_lightning_cli_takes_every_fp8_precision_string(precision, tmp_path, capsys):
    from tests.lightning.cli_app import LightningCLI, Model
    from lightning.pytorch.demos.boring_classes import BoringDataModule

    args = ["fit", "--trainer.precision", precision, "--trainer.max_steps", "2", "--trainer.accelerator", "cpu",
            "--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.enable_checkpointing",
            "false", "--trainer.default_root_dir", str(tmp_path)]  # fmt: skip
    LightningCLI(Model, BoringDataModule, args=args, save_config_callback=None)
    assert f"precision={precision} plugin=FP8Precision converted=['layer'] steps=2" in capsys.readouterr().out


def test_lightning_cli_script_from_the_command_line(tmp_path):
    result = _python([str(REPO / "tests/lightning/cli_app.py"), "fit", "--trainer.precision", "fp8-hybrid", "--trainer.max_steps",
                      "1", "--trainer.accelerator", "cpu", "--trainer.logger", "false"], tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "precision=fp8-hybrid plugin=FP8Precision converted=['layer'] steps=1" in result.stdout


def test_import_leaves_lightning_logging_alone_and_registers_standalone_lightning_on_its_import(tmp_path):
    pytest.importorskip("pytorch_lightning")
    code = """
import logging, sys
import fp8_lightning
import lightning.pytorch as pl
from lightning.pytorch.demos.boring_classes import BoringModel
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
assert "pytorch_lightning" not in sys.modules and "lightning_fabric" not in sys.modules
pl.Trainer(precision="fp8-hybrid", accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
           enable_progress_bar=False, enable_model_summary=False).fit(BoringModel())
print("-- standalone --", file=sys.stderr, flush=True)
import pytorch_lightning  # the standalone package, imported after fp8_lightning (its own loggers print)
trainer = pytorch_lightning.Trainer(precision="fp8-tensorwise", accelerator="cpu", logger=False)
print(trainer.precision, type(trainer.precision_plugin).__module__)
"""
    result = _python(["-c", code], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    before_standalone = result.stdout + result.stderr.split("-- standalone --")[0]
    assert "GPU available" not in before_standalone  # Lightning's INFO lines stay silenced, as the user asked
    assert "fp8-tensorwise fp8_lightning.lightning.standalone" in result.stdout


def test_fabric_reads_an_fp8_precision_from_the_fabric_cli_environment(monkeypatch):
    monkeypatch.setenv("LT_PRECISION", "fp8-mxfp8")  # `fabric run --precision ...` sets this variable
    fabric = L.Fabric(accelerator="cpu", devices=1)
    assert isinstance(fabric.strategy.precision, FP8FabricPrecision)
    assert fabric.strategy.precision.precision == "fp8-mxfp8"
    assert os.environ["LT_PRECISION"] == "fp8-mxfp8"


def test_trainer_and_fabric_annotations_list_the_fp8_strings():
    for cls in (L.Trainer, L.Fabric):
        annotation = str(inspect.unwrap(cls.__init__).__annotations__["precision"])
        assert all(p in annotation for p in PRECISION_RECIPES) and "bf16-mixed" in annotation


def test_registration_names_the_plugins_route_when_lightning_moved(monkeypatch):
    family = registration._FAMILIES[0]
    moved = registration._Family(family.connector + "Moved", *registration.dataclasses.astuple(family)[1:])
    with pytest.raises(registration.RegistrationError, match=r"plugins=\[FP8Precision\(recipe=\.\.\.\)\]"):
        registration._register(moved)

    class Connector:  # a connector whose precision argument was renamed
        def __init__(self, accelerator="auto", strategy="auto", plugins=None, precision_input=None):
            pass

    module = type(sys)("fake_lightning_connector")
    module.Connector = Connector
    monkeypatch.setitem(sys.modules, "fake_lightning_connector", module)
    renamed = registration._Family("fake_lightning_connector:Connector", *registration.dataclasses.astuple(family)[1:])
    with pytest.raises(registration.RegistrationError, match=r"no argument\(s\) \['precision'\]"):
        registration._register(renamed)


def _cli_error(args: list[str], capsys) -> list[str]:
    from tests.lightning.cli_app import LightningCLI, Model
    from lightning.pytorch.demos.boring_classes import BoringDataModule

    with pytest.raises(SystemExit):
        LightningCLI(Model, BoringDataModule, args=["fit", *args, "--trainer.accelerator", "cpu"],
                     save_config_callback=None)
    return _without_log_records(capsys.readouterr().err.splitlines())


def _without_log_records(lines: list[str]) -> list[str]:
    """stderr without what Python's logging wrote there (Lightning's INFO records, and the "--- Logging error ---"
    report of a handler an earlier test left on a closed stream in the same process)."""
    kept, in_report = [], False
    for line in lines:
        if line.startswith("--- Logging error ---"):
            in_report = True
        elif in_report:
            in_report = not line.startswith("Arguments:")
        elif not line.startswith("INFO:"):
            kept.append(line)
    return kept


def test_lightning_cli_reports_a_mistyped_fp8_precision_in_its_first_line(capsys):
    lines = _cli_error(["--trainer.precision", "fp8-hybridd"], capsys)
    assert "--trainer.precision='fp8-hybridd'" in lines[0] and "did you mean 'fp8-hybrid'?" in lines[0]
    assert any(line.startswith("usage:") for line in lines[1:])  # the parser's own report follows


def test_lightning_cli_reports_a_bad_fp8_plugin_argument_in_its_first_line(capsys):
    lines = _cli_error(["--trainer.plugins", "fp8_lightning.FP8Precision", "--trainer.plugins.recipe", "bogus"], capsys)
    assert lines[0].startswith("error: fp8_lightning.FP8Precision(recipe='bogus'")
    assert "recipe name 'bogus' is unknown; allowed:" in lines[0]


@pytest.mark.parametrize(
    ("args", "first"),
    [
        (["--trainer.strategy", "fp8_lightning.FP8DDPStrategy", "--trainer.strategy.fp8_gradients", "maybe"],
         "error: --trainer.strategy.fp8_gradients is invalid for fp8_lightning.FP8DDPStrategy: Expected a <class "
         "'bool'>. Got value: maybe"),
        (["--trainer.plugins", "fp8_lightning.FP8Precision", "--trainer.plugins.replace_layers", "maybe"],
         "error: --trainer.plugins.replace_layers is invalid for fp8_lightning.FP8Precision: Expected a <class "
         "'bool'>. Got value: maybe"),
    ],
    ids=["strategy-flag-type", "plugin-flag-type"],
)
def test_lightning_cli_reports_a_bad_fp8_class_argument_type_in_its_first_line(capsys, args, first):
    """Guards against the parser's type check of an fp8_lightning class's argument being buried in ~55 lines."""
    lines = _cli_error(args, capsys)
    assert lines[0].strip() == first
    assert any(line.startswith("usage:") for line in lines[1:])  # the parser's own report follows


def test_a_bare_fp8_class_name_the_parser_cannot_import_gets_its_path():
    """The parser resolves a bare class name only once it has seen the class (so this is checked on its message:
    jsonargparse's report for ``--trainer.plugins FP8Precision`` in a fresh process)."""
    from fp8_lightning.lightning.cli import class_argument_hint

    message = (
        'Parser key "trainer.plugins":\n\n  - Expected a path but FP8Precision either not accessible or invalid\n'
        "  - Does not validate against any of the Union subtypes\n  Errors:\n"
        "    - Expected a dot import path string: FP8Precision\n  Given value type: <class 'str'>\n"
        "  Given value: FP8Precision"
    )
    assert class_argument_hint(message) == (
        "error: --trainer.plugins FP8Precision: the parser cannot import a class by its bare name here; give its "
        "path: --trainer.plugins fp8_lightning.FP8Precision"
    )
    assert class_argument_hint(message.replace("FP8Precision", "MixedPrecision")) is None


@pytest.mark.parametrize("name", ["FP8DDPStrategy", "fp8-ddp"])
def test_an_unregistered_fp8_strategy_name_lists_the_registered_ones(name):
    """Guards against Lightning's error listing only its own examples for strategy='FP8DDPStrategy'."""
    with pytest.raises(ValueError, match=rf"strategy='{name}' is not a registered strategy name; the FP8 ones are "
                                         r"fp8_ddp, fp8_fsdp\. Pass one of them"):
        L.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False)
