"""The ``fp8-train`` command line: a few real steps under every precision, and bad configuration failing fast."""

import json
import math
import subprocess
import sys

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra

from fp8_lightning import train
from tests.hydra.helpers import group_options, run_cli

PRECISIONS = group_options("precision")
FP8_LAYERS_OF_SMOKE_GPT = ["blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.fc", "blocks.0.mlp.proj",
                           "lm_head"]


@pytest.fixture(scope="module")
def smoke_sweep(tmp_path_factory):
    """One ``fp8-train -m`` sweep over every precision option (one interpreter, six short runs)."""
    out = tmp_path_factory.mktemp("sweep")
    proc = run_cli(["-m", "experiment=smoke", f"precision={','.join(PRECISIONS)}", f"hydra.sweep.dir={out}",
                    "hydra.sweep.subdir=${precision.name}"], cwd=out, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


@pytest.mark.timeout(480)
@pytest.mark.parametrize("option", PRECISIONS)
def test_smoke_run_per_precision(smoke_sweep, option):
    out, stdout = smoke_sweep
    name = option.replace("_", "-")
    summary = json.loads((out / name / "summary.json").read_text())
    assert summary["precision"] == name and summary["steps"] == 6
    # it learned something: below the loss of a uniform guess over 256 bytes, ln(256) = 5.545
    assert math.isfinite(summary["val_loss"]) and summary["val_loss"] < math.log(256) - 0.1
    assert summary["val_ppl"] == pytest.approx(math.exp(summary["val_loss"]), rel=1e-3)
    assert summary["tokens_per_s"] > 0 and summary["peak_memory_mib"] > 0
    expected_layers = FP8_LAYERS_OF_SMOKE_GPT if option.startswith("fp8_") else []
    if option == "fp4_nvfp4":  # NVFP4's default policy keeps the last 15% of the blocks (the one block) in bf16
        expected_layers = [name for name in FP8_LAYERS_OF_SMOKE_GPT if not name.startswith("blocks.")]
    assert summary["layers"]["converted"] == expected_layers
    assert (out / name / ".hydra" / "config.yaml").is_file() and (out / name / "csv" / "metrics.csv").is_file()
    checkpoint = out / name / "checkpoints" / f"step000006-val_loss{summary['val_loss']:.4f}.ckpt"
    assert summary["checkpoint"] == str(checkpoint) and checkpoint.is_file()
    assert (out / name / "checkpoints" / "last.ckpt").is_file()
    assert f"==== fp8-train summary ({name}, 6 steps) ====" in stdout


# ---------------------------------------------------------------------------------------------- failures


def assert_fails(proc: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    text = proc.stderr + proc.stdout
    assert proc.returncode == code, f"exit {proc.returncode}, expected {code}:\n{text[-3000:]}"
    for needle in needles:
        assert needle in text, f"{needle!r} not in:\n{text[-3000:]}"
    assert "Epoch 0" not in text  # failed before any training


def run_in_process(args: list[str], tmp_path, monkeypatch, capfd) -> subprocess.CompletedProcess:
    """``fp8-train <args>`` through the same Hydra entry point, in this process (saves an interpreter start)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["fp8-train", *args])
    GlobalHydra.instance().clear()
    with pytest.raises(SystemExit) as exit_info:
        train.main()
    GlobalHydra.instance().clear()
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(args, exit_info.value.code, out, err)


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (["precision.recipe.amax_history_len=abc"], ["precision.recipe is invalid", "amax_history_len='abc'",
                                                     "an integer from 1 to 4096"]),
        (["precision.recipe.margin=-1"], ["margin=-1 is invalid", "an integer from 0 to 32"]),
        (["precision=fp8_mxfp8", "precision.recipe.block_size=48"], ["block_size=48 is invalid", "(16, 32, 64, 128)"]),
        (["precision=fp8_tensorwise", "precision.recipe.fp8_format=E3M4"], ["fp8_format='E3M4'", "E4M3, E5M2, HYBRID"]),
        (["model.n_embd=100"], ["model could not be built", "n_embd=100 is not a multiple of 32"]),
        (["data.root=no/such/folder"], ["data.root='no/such/folder' is not a folder", "data.root=null"]),
    ],
    ids=["wrong-type", "out-of-range", "mx-block-size", "unknown-format", "model-dims", "missing-data-root"],
)
def test_bad_value_fails_fast(tmp_path, monkeypatch, capfd, overrides, needles):
    proc = run_in_process(overrides, tmp_path, monkeypatch, capfd)
    assert_fails(proc, 2, "fp8-train: configuration error:", *needles)


def test_unknown_group_option_lists_the_choices(tmp_path, monkeypatch, capfd):
    proc = run_in_process(["precision=fp8_foo"], tmp_path, monkeypatch, capfd)
    assert_fails(proc, 1, "Could not find 'precision/fp8_foo'", "fp8_hybrid", "fp8_mxfp8", "bf16_mixed")


def test_field_that_a_recipe_does_not_have_is_rejected(tmp_path, monkeypatch, capfd):
    proc = run_in_process(["precision=fp8_mxfp8", "precision.recipe.amax_history_len=32"], tmp_path, monkeypatch, capfd)
    assert_fails(proc, 1, "Could not override 'precision.recipe.amax_history_len'", "not in struct")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the failure on a machine without a GPU")
def test_gpu_trainer_without_gpu_fails_fast(tmp_path, monkeypatch, capfd):
    proc = run_in_process(["trainer=gpu"], tmp_path, monkeypatch, capfd)
    assert_fails(proc, 2, "trainer.accelerator=gpu", "no usable CUDA GPU", "trainer=cpu")


@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the failure on a machine without a GPU")
def test_gpu_experiment_without_gpu_exits_non_zero_from_the_command_line(tmp_path):
    proc = run_cli(["experiment=gpt_small_gpu", "precision=fp8_mxfp8"], cwd=tmp_path)
    assert_fails(proc, 2, "fp8-train: configuration error:", "no usable CUDA GPU")
