"""Recipes: defaults, validation messages, construction from names and YAML-style dicts."""

import pytest

from fp8_lightning import DelayedScaling, Format, MXFP8BlockScaling, TensorwiseScaling, recipe_from
from fp8_lightning.recipes import BlockwiseScaling, RowwiseScaling


def test_defaults_follow_the_documented_semantics():
    d = DelayedScaling()
    assert (d.fp8_format, d.margin, d.amax_history_len, d.amax_compute_algo) == (Format.HYBRID, 0, 16, "max")
    assert TensorwiseScaling().fp8_format is Format.HYBRID
    mx = MXFP8BlockScaling()
    assert (mx.block_size, mx.scale_rounding, mx.fp8_format) == (32, "rceil", Format.E4M3)
    rw = RowwiseScaling()  # torchao's "rowwise": E4M3 everywhere, power-of-two scales
    assert (rw.fp8_format, rw.power_of_2_scales, rw.high_precision_wgrad, rw.eps) == (Format.E4M3, True, False, 1e-12)
    bw = BlockwiseScaling()  # TransformerEngine's Float8BlockScaling: E4M3, power-of-two scales
    assert (bw.fp8_format, bw.power_of_2_scales) == (Format.E4M3, True)


@pytest.mark.parametrize(
    "build, field, value",
    [
        (lambda: DelayedScaling(margin=-1), "margin", "-1"),
        (lambda: DelayedScaling(amax_history_len=0), "amax_history_len", "0"),
        (lambda: DelayedScaling(amax_compute_algo="mean"), "amax_compute_algo", "'mean'"),
        (lambda: DelayedScaling(fp8_format="e3m4"), "fp8_format", "'e3m4'"),
        (lambda: TensorwiseScaling(eps=0.0), "eps", "0.0"),
        (lambda: MXFP8BlockScaling(block_size=24), "block_size", "24"),
        (lambda: MXFP8BlockScaling(scale_rounding="nearest"), "scale_rounding", "'nearest'"),
        (lambda: MXFP8BlockScaling(fp8_format="E5M2"), "fp8_format", "'E5M2'"),
        (lambda: DelayedScaling(fp8_format="E5M2"), "fp8_format", "'E5M2'"),
        (lambda: TensorwiseScaling(fp8_format="e5m2"), "fp8_format", "'E5M2'"),
        (lambda: RowwiseScaling(fp8_format="E5M2"), "fp8_format", "'E5M2'"),
        (lambda: RowwiseScaling(power_of_2_scales=1), "power_of_2_scales", "1"),
        (lambda: RowwiseScaling(high_precision_wgrad="yes"), "high_precision_wgrad", "'yes'"),
        (lambda: RowwiseScaling(eps=2.0), "eps", "2.0"),
        (lambda: BlockwiseScaling(fp8_format="e5m2"), "fp8_format", "'E5M2'"),
        (lambda: BlockwiseScaling(power_of_2_scales=None), "power_of_2_scales", "None"),
    ],
)
def test_invalid_values_name_the_field_the_value_and_what_is_allowed(build, field, value):
    with pytest.raises(ValueError) as err:
        build()
    message = str(err.value)
    assert f".{field}={value}" in message and "allowed" in message


def test_e5m2_everywhere_is_refused_with_hybrid_named():
    """Every GEMM would multiply two E5M2 operands, which CUDA's scaled GEMM refuses."""
    with pytest.raises(ValueError, match="HYBRID.*Float8_e5m2"):
        DelayedScaling(fp8_format="E5M2")


def test_recipes_are_frozen_and_hashable():
    r = DelayedScaling(margin=2)
    with pytest.raises(Exception):
        r.margin = 3
    assert len({r, DelayedScaling(margin=2), DelayedScaling()}) == 2


def test_construction_from_names_and_dicts():
    assert recipe_from(None) == DelayedScaling()
    assert recipe_from("tensorwise") == TensorwiseScaling()
    assert recipe_from("MX") == MXFP8BlockScaling()
    yaml_like = {"name": "delayed", "fp8_format": "e4m3", "amax_history_len": 32, "amax_compute_algo": "most_recent"}
    r = recipe_from(yaml_like)
    assert r == DelayedScaling(fp8_format=Format.E4M3, amax_history_len=32, amax_compute_algo="most_recent")
    assert recipe_from("rowwise") == RowwiseScaling() and recipe_from("DeepSeek") == BlockwiseScaling()
    assert recipe_from({"name": "blockwise", "power_of_2_scales": False}) == BlockwiseScaling(power_of_2_scales=False)
    fine = (RowwiseScaling(high_precision_wgrad=True, fp8_format="hybrid"), BlockwiseScaling(fp8_format="HYBRID"))
    for recipe in (r, TensorwiseScaling(power_of_2_scales=True), MXFP8BlockScaling(scale_rounding="floor"), *fine):
        assert recipe_from(recipe.to_dict()) == recipe


def test_bad_names_and_dicts_are_explained():
    with pytest.raises(ValueError, match="unknown; allowed: blockwise, delayed, mxfp8, nvfp4, rowwise, tensorwise"):
        recipe_from("columnwise")
    for string in ("fp8-hybrid", "fp4-nvfp4"):  # a precision string where a recipe is asked: the way to the recipe
        with pytest.raises(ValueError, match=rf"looks like a Trainer\(precision=...\) string.*for_precision\('{string}'\)"):
            recipe_from(string)
    with pytest.raises(ValueError, match="needs a 'name' key"):
        recipe_from({"margin": 1})
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['history'\]"):
        recipe_from({"name": "delayed", "history": 3})
    with pytest.raises(TypeError, match="is not a recipe"):
        recipe_from(3.5)
