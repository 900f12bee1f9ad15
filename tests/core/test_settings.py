"""The environment is read once into a frozen, validated ``Settings`` (``fp8_lightning.settings``)."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from fp8_lightning import gemm
from fp8_lightning.settings import GEMM_BACKENDS, Settings, settings
from tests.environment import set_env


def test_defaults_when_nothing_is_set():
    parsed = Settings.from_environ({})
    assert parsed == Settings()
    assert (parsed.gemm, parsed.emulate, parsed.disable_triton, parsed.disable_cpu_codec) == ("auto", False, False, False)
    assert parsed.cache == Path.home() / ".cache" / "fp8_lightning"
    assert parsed.weight_checksum and not parsed.gluon_mx_gemm


def test_every_variable_is_parsed():
    parsed = Settings.from_environ({
        "FP8_LIGHTNING_GEMM": " Scaled_MM ", "FP8_LIGHTNING_EMULATE": "yes", "FP8_LIGHTNING_DISABLE_TRITON": "ON",
        "FP8_LIGHTNING_TRITON_EXPLICIT_ROUNDING": "true", "FP8_LIGHTNING_DISABLE_CPU_CODEC": "1",
        "FP8_LIGHTNING_CACHE": "/tmp/fp8-cache", "FP8_LIGHTNING_GLUON_MX_GEMM": "1",
        "FP8_LIGHTNING_WEIGHT_CHECKSUM": "off", "FP8_LIGHTNING_GROUPED_GEMM": " Triton",
    })  # fmt: skip
    assert parsed == Settings("scaled_mm", True, True, True, True, Path("/tmp/fp8-cache"), True, False, "triton")


def test_the_older_cache_name_is_still_read_and_the_new_one_wins():
    assert Settings.from_environ({"FP8_LIGHTNING_CACHE_DIR": "/a"}).cache == Path("/a")
    assert Settings.from_environ({"FP8_LIGHTNING_CACHE_DIR": "/a", "FP8_LIGHTNING_CACHE": "/b"}).cache == Path("/b")


@pytest.mark.parametrize("name, value, allowed", [
    ("FP8_LIGHTNING_GEMM", "cublas", ", ".join(GEMM_BACKENDS)),
    ("FP8_LIGHTNING_GROUPED_GEMM", "cutlass", "auto, torch, triton"),
    ("FP8_LIGHTNING_EMULATE", "maybe", "use 1 or 0"),
    ("FP8_LIGHTNING_DISABLE_CPU_CODEC", "2", "use 1 or 0"),
])  # fmt: skip
def test_a_bad_value_names_the_variable_the_value_and_what_is_allowed(name, value, allowed):
    with pytest.raises(ValueError) as err:
        Settings.from_environ({name: value})
    assert f"{name}={value!r}" in str(err.value) and allowed in str(err.value)


def test_settings_are_frozen_and_read_once(monkeypatch):
    first = settings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.gemm = "emulate"
    monkeypatch.setenv("FP8_LIGHTNING_GEMM", "emulate")  # without a reload, nothing changes
    assert settings() is first and gemm.requested_backend() == first.gemm
    assert set_env(monkeypatch, FP8_LIGHTNING_GEMM="emulate").gemm == "emulate"
    assert gemm.requested_backend() == "emulate"


def test_a_bad_variable_stops_a_training_process_with_its_message():
    script = (
        "import torch\nfrom fp8_lightning import DelayedScaling, FP8Linear, fp8_autocast\n"
        "layer = FP8Linear.from_linear(torch.nn.Linear(16, 16), DelayedScaling())\n"
        "with fp8_autocast():\n    layer(torch.randn(4, 16)).sum().backward()\n"
    )
    env = {"FP8_LIGHTNING_GEMM": "fast", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "FP8_LIGHTNING_GEMM='fast' is not allowed" in proc.stderr, proc.stderr[-2000:]
