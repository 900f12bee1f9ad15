"""Flags of the FP8 strategies take booleans, or the strings of one, and refuse anything else: ``bool("false")``
is True, so the string 'false' used to turn each of them on."""

import pytest

from fp8_lightning.lightning.ddp import FP8DDPStrategy
from fp8_lightning.lightning.fsdp import FP8FSDPStrategy
from fp8_lightning.lightning.plugin_base import strict_bool


@pytest.mark.parametrize("value, expected", [(True, True), (False, False), ("false", False), ("False", False),
                                             ("true", True), ("0", False), (1, True), (0, False), ("off", False)])
def test_flag_strings_parse_strictly(value, expected):
    """Guards the parsing: 'false' means False."""
    assert strict_bool(value, "Owner", "flag") is expected


@pytest.mark.parametrize("value", ["maybe", "", None, 2, 0.5, []])
def test_other_flag_values_are_refused(value):
    """Guards against silently reading any truthy value as True."""
    with pytest.raises(ValueError, match=r"Owner\(flag=.*\): flag takes True or False .* Pass flag=True or flag=False"):
        strict_bool(value, "Owner", "flag")


def test_the_string_false_turns_off_fp8_gradients():
    """Guards FP8DDPStrategy(fp8_gradients='false'), which turned the FP8 hook on."""
    assert FP8DDPStrategy(fp8_gradients="false").fp8_gradients is False
    with pytest.raises(ValueError, match="fp8_gradients takes True or False"):
        FP8DDPStrategy(fp8_gradients="nope")


def test_the_string_false_turns_off_the_fsdp_flags():
    """Guards FP8FSDPStrategy(fp8_all_gather='false', fp8_reduce_scatter='false'), which turned both on."""
    strategy = FP8FSDPStrategy(fp8_all_gather="false", fp8_reduce_scatter="false")
    assert strategy.fp8_all_gather is False and strategy.fp8_reduce_scatter is False
    with pytest.raises(ValueError, match="fp8_reduce_scatter takes True or False"):
        FP8FSDPStrategy(fp8_reduce_scatter="yes please")


def test_the_string_false_turns_off_the_precision_plugins_flags():
    """Guards FP8Precision / FP8FabricPrecision(replace_layers='false', emulate='false') and the optimizer callback's
    flags, which bool() read as True."""
    from fp8_lightning import FP8FabricPrecision, FP8OptimizerStates, FP8Precision

    for cls in (FP8Precision, FP8FabricPrecision):
        plugin = cls(replace_layers="false", emulate="false")
        assert plugin.replace_layers is False and plugin.emulate is False
        with pytest.raises(ValueError, match="emulate takes True or False"):
            cls(emulate="sometimes")
    callback = FP8OptimizerStates(strict="false", release_gradients="false")
    assert callback.strict is False and callback.release_gradients is False


def test_core_flags_refuse_strings():
    """Guards convert_to_fp8(emulate='false') and FP8Optimizer(use_triton='false'), which read the string as True
    (the core takes Python booleans; the Lightning adapters above parse YAML's strings)."""
    import torch

    from fp8_lightning import convert_to_fp8
    from fp8_lightning.optim import FP8Optimizer

    with pytest.raises(ValueError, match=r"convert_to_fp8\(emulate='false'\): emulate takes True or False"):
        convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(32, 32)), emulate="false")
    parameter = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match=r"use_triton='false' is invalid; allowed: True or False"):
        FP8Optimizer(torch.optim.AdamW([parameter]), "default", use_triton="false")
