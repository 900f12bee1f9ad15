"""Fixtures of the config and CLI tests."""

import pytest

from tests.hydra.helpers import compose_config


@pytest.fixture
def compose_train(tmp_path):
    """``compose_train(*overrides)`` -> the composed root config, with outputs under ``tmp_path``."""
    return lambda *overrides: compose_config(tmp_path, *overrides)
