"""The FP8 strings through every front door: LT_PRECISION next to an explicit precision=, other programs' own
precision lists, the string trainer.precision reports, and a Fabric resume that forgot the FP8 state."""

import typing
import warnings

import lightning as L
import pytest
import torch

from fp8_lightning import FP8FabricPrecision, FP8Precision
from fp8_lightning.lightning import precision_choices
from fp8_lightning.lightning.strings import PRECISION_STRINGS
from fp8_lightning.recipes import DelayedScaling


def test_lt_precision_wins_over_an_explicit_precision_as_in_lightning(monkeypatch):
    """Guards against the crash when LT_PRECISION=fp8-hybrid meets Fabric(precision=...): the variable wins, as
    Fabric's own rule says, and the FP8 string is translated."""
    monkeypatch.setenv("LT_PRECISION", "fp8-hybrid")
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="32-true")
    assert isinstance(fabric.strategy.precision, FP8FabricPrecision)
    assert fabric.strategy.precision.precision == "fp8-hybrid"


def test_a_plain_lt_precision_wins_over_an_fp8_argument(monkeypatch):
    """Guards the other direction of the same rule: LT_PRECISION=bf16-mixed over precision='fp8-hybrid'."""
    monkeypatch.setenv("LT_PRECISION", "bf16-mixed")
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="fp8-hybrid")
    assert not isinstance(fabric.strategy.precision, FP8FabricPrecision)


def test_under_fabric_run_a_conflicting_precision_is_an_error(monkeypatch):
    """Guards Fabric's CLI rule: under `fabric run` (LT_CLI_USED=1) a different explicit precision is refused."""
    monkeypatch.setenv("LT_PRECISION", "fp8-hybrid")
    monkeypatch.setenv("LT_CLI_USED", "1")
    with pytest.raises(ValueError, match="conflicts with the value `--precision=fp8-hybrid`"):
        L.Fabric(accelerator="cpu", devices=1, precision="32-true")


def test_precision_choices_extends_another_programs_list():
    """Guards the documented route for programs with their own precision list (litgpt)."""
    assert precision_choices(["bf16-true", "32-true"])[:2] == ("bf16-true", "32-true")
    assert set(PRECISION_STRINGS) <= set(precision_choices(["bf16-true"]))
    literal = precision_choices(typing.Literal["bf16-true", "32-true"])
    assert typing.get_origin(literal) is typing.Literal and "fp8-hybrid" in typing.get_args(literal)
    with pytest.raises(TypeError, match="Wrap it in a list"):
        precision_choices("bf16-true")


def test_the_precision_a_plugin_reports_is_accepted_by_the_trainer():
    """Guards against trainer.precision reporting "fp8-delayed", which Trainer(precision=) refused."""
    plugin = FP8Precision(recipe=DelayedScaling(margin=2))  # a recipe without a string of its own
    reported = L.Trainer(plugins=[plugin], accelerator="cpu", logger=False).precision
    assert reported == "fp8-delayed"
    trainer = L.Trainer(precision=reported, accelerator="cpu", logger=False)  # the family's defaults
    assert trainer.precision == reported and trainer.precision_plugin.recipe == DelayedScaling()


def _fabric_steps(fabric, model, optimizer, steps: int):
    for _ in range(steps):
        loss = model(torch.randn(4, 32)).square().mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


def test_a_fabric_resume_without_the_fp8_state_warns_once(tmp_path):
    """Guards against a Fabric program (litgpt) that saves its own state silently dropping the FP8 scaling state on
    resume: one warning that names the fix; none when the plugin is saved and loaded too."""

    def start():
        fabric = L.Fabric(accelerator="cpu", devices=1, precision="fp8-hybrid")
        model = torch.nn.Sequential(torch.nn.Linear(32, 32))
        optimizer = torch.optim.AdamW(model.parameters())
        model, optimizer = fabric.setup(model, optimizer)
        return fabric, model, optimizer

    fabric, model, optimizer = start()
    _fabric_steps(fabric, model, optimizer, 2)
    fabric.save(tmp_path / "no_fp8.ckpt", {"model": model, "optimizer": optimizer})
    fabric.save(tmp_path / "with_fp8.ckpt", {"model": model, "optimizer": optimizer, "fp8": fabric.strategy.precision})

    for name, expect in (("no_fp8.ckpt", 1), ("with_fp8.ckpt", 0)):
        fabric, model, optimizer = start()
        state = {"model": model, "optimizer": optimizer}
        if expect == 0:
            state["fp8"] = fabric.strategy.precision
        fabric.load(tmp_path / name, state)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _fabric_steps(fabric, model, optimizer, 3)
        messages = [str(w.message) for w in caught if "FP8 scaling state was not" in str(w.message)]
        assert len(messages) == expect, (name, messages)

    fabric, model, optimizer = start()  # a fresh run never warns
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fabric_steps(fabric, model, optimizer, 2)
    assert not [w for w in caught if "FP8 scaling state was not" in str(w.message)]


@pytest.mark.parametrize(
    "plugin, expect",
    [({"recipe": "mxfp8"}, 0), ({"recipe": "rowwise"}, 0), ({"recipe": "mxfp8", "divergence_guard": True}, 1),
     ({"recipe": "nvfp4"}, 1)],
    ids=["mxfp8", "rowwise", "mxfp8-guard", "nvfp4"],
)
def test_the_fabric_resume_warning_only_when_state_was_lost(tmp_path, plugin, expect):
    """Guards against a false alarm: MXFP8 and rowwise layers compute every scale from the tensor being cast, so a
    resume without the plugin's state is exact (checked here) and must not warn; a divergence guard's decisions and
    NVFP4's signs and rounding counter are state that was lost, and do."""

    def run(first: int, last: int, load: bool):
        torch.manual_seed(0)
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[FP8FabricPrecision(**plugin)])
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        if load:
            fabric.load(tmp_path / "state.ckpt", {"model": model, "optimizer": optimizer})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(first, last):
                x = torch.randn(4, 32, generator=torch.Generator().manual_seed(step)) * (1 + step)
                fabric.backward(model(x).square().mean())
                optimizer.step()
                optimizer.zero_grad()
        if not load:
            fabric.save(tmp_path / "state.ckpt", {"model": model, "optimizer": optimizer})
        warned = [w for w in caught if "FP8 scaling state was not" in str(w.message)]
        return [p.detach().clone() for p in model.parameters()], len(warned)

    uninterrupted, _ = run(0, 4, load=False)
    run(0, 2, load=False)
    resumed, warnings_seen = run(2, 4, load=True)
    assert warnings_seen == expect
    if expect == 0:
        assert all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed)), "nothing of the plugin was needed"


def test_errors_about_an_lt_precision_string_name_the_variable(monkeypatch):
    """Guards against messages that blamed a precision= the program never passed when the FP8 string came from
    LT_PRECISION (an unknown string, or one next to a precision plugin in plugins=)."""
    monkeypatch.setenv("LT_PRECISION", "fp8-bogus")
    with pytest.raises(ValueError, match=r"LT_PRECISION='fp8-bogus' \(the environment variable\): .* Or unset"):
        L.Fabric(accelerator="cpu", devices=1, precision="32-true")
    monkeypatch.setenv("LT_PRECISION", "fp8-hybrid")
    with pytest.raises(ValueError, match=r"LT_PRECISION='fp8-hybrid' \(the environment variable\) and plugins=.*"
                                         r"unset LT_PRECISION"):
        L.Fabric(accelerator="cpu", devices=1, plugins=[FP8FabricPrecision(recipe="mxfp8")])
