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
