"""Setting ``FP8_LIGHTNING_*`` variables inside a test: the library reads them once (``fp8_lightning.settings``),
so a test that changes one also swaps the parsed settings, and pytest's undo restores both."""

from __future__ import annotations

import pytest

from fp8_lightning import settings as settings_module


def set_env(patch: pytest.MonkeyPatch, **values: str | None) -> settings_module.Settings:
    """Set (or, with None, remove) each variable through ``patch`` and re-read the settings the same way."""
    for name, value in values.items():
        if value is None:
            patch.delenv(name, raising=False)
        else:
            patch.setenv(name, value)
    parsed = settings_module.Settings.from_environ()
    patch.setattr(settings_module, "_current", parsed)
    return parsed
