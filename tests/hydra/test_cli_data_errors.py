"""Data and plugin settings that cannot work end with one configuration error (exit status 2), not a traceback."""

import pytest

from tests.hydra.test_cli import assert_fails, run_in_process


def _folder(tmp_path, files: dict[str, str]) -> str:
    root = tmp_path / "corpus"
    root.mkdir()
    for name, text in files.items():
        (root / name).write_text(text)
    return str(root)


@pytest.mark.parametrize(
    ("files", "needles"),
    [
        ({}, ["holds 0 file(s) matching data.pattern='*.py'", "at least 2 are needed"]),
        ({"a.py": "", "b.py": "", "c.py": ""}, ["too short for data.block_size=", "empty files count as nothing"]),
        ({"a.py": "x = 1\n", "b.py": "y = 2\n"}, ["too short for data.block_size=", "lower data.block_size"]),
    ],
    ids=["empty-folder", "empty-files", "shorter-than-a-block"],
)
def test_unusable_data_is_a_configuration_error(tmp_path, monkeypatch, capfd, files, needles):
    """Guards against tracebacks (rc 1) for an empty data folder, empty files, or text shorter than a block."""
    root = _folder(tmp_path, files)
    proc = run_in_process([f"data.root={root}"], tmp_path, monkeypatch, capfd)
    assert_fails(proc, 2, "fp8-train: configuration error: the data cannot be used:", *needles)


def test_a_vocabulary_smaller_than_the_bytes_is_a_configuration_error(tmp_path, monkeypatch, capfd):
    """Guards against an index error deep in the embedding for model.vocab_size below 256 on byte data."""
    proc = run_in_process(["model.vocab_size=128"], tmp_path, monkeypatch, capfd)
    assert_fails(proc, 2, "model.vocab_size=128 is smaller than the data's vocabulary (256", "model.vocab_size=256")


def test_an_unknown_plugin_dtype_is_a_configuration_error(tmp_path, monkeypatch, capfd):
    """Guards against AttributeError for precision.plugin.dtype=foo."""
    proc = run_in_process(["precision.plugin.dtype=foo"], tmp_path, monkeypatch, capfd)
    assert_fails(proc, 2, "precision.plugin.dtype='foo' is not a dtype", "allowed: float32, bfloat16, float16")


@pytest.mark.parametrize(
    "overrides",
    [["data.block_size=0"], ["data.batch_size=0"], ["data=synthetic", "data.block_size=-5"],
     ["data=synthetic", "data.batch_size=0"]],
    ids=["block-0", "batch-0", "synthetic-block-negative", "synthetic-batch-0"],
)
def test_a_size_that_is_not_a_positive_integer_is_a_configuration_error(tmp_path, monkeypatch, capfd, overrides):
    """Guards against a ZeroDivisionError (block_size=0), a negative-dimension error from the model (block_size=-5)
    and the DataLoader's traceback (batch_size=0)."""
    key, value = overrides[-1].split("=")
    proc = run_in_process(overrides, tmp_path, monkeypatch, capfd)
    assert_fails(proc, 2, "fp8-train: configuration error: data could not be built",
                 f"{key.split('.')[1]}={value} is invalid; allowed: a positive integer", f"{key}=")
