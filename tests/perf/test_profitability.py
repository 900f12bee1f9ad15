"""The per-layer profitability gate: the roofline model, the conversion report, the defaults and overrides."""

import types

import pytest
import torch
import torch.nn as nn

from fp8_lightning import FP8Linear, FP8Precision, TensorwiseScaling, convert_to_fp8
from fp8_lightning.lightning.precision import trainer_gate
from fp8_lightning.settings import reload_settings
from fp8_lightning.profitability import ProfitabilityGate, profitability_setting, resolve_gate
from fp8_lightning.roofline import KNOWN_DEVICES, DeviceRoofline, experts_cost, layer_cost
from fp8_lightning.recipes import BlockwiseScaling, DelayedScaling, MXFP8BlockScaling, RowwiseScaling
from tests.conftest import requires_cuda_fp8

H100 = dict(KNOWN_DEVICES)["H100"]
# A made-up device with round numbers, so that the expected costs can be computed by hand below.
TOY = DeviceRoofline("toy", bf16_flops=1e12, fp8_flops=2e12, bandwidth=1e9, launch_s=1e-6, source="test")


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8192, 8192), nn.Linear(8192, 1024), nn.Linear(256, 256))


def test_layer_cost_is_the_documented_roofline():
    m, k, n = 64, 128, 32
    # bf16: compute 2*64*128*32 / 1e12 = 5.24e-7 s, bytes 2*(64*128 + 32*128 + 64*32) / 1e9 = 2.87e-5 s (memory bound)
    bf16 = 3 * max(2 * m * k * n / 1e12, 2 * (m * k + n * k + m * n) / 1e9)
    fp8 = 3 * max(2 * m * k * n / 2e12, ((m * k + n * k) + 2 * m * n) / 1e9)
    fp8 += 7.0 * (m * k + n * k + m * n) / 1e9 + 9 * 1e-6  # tensorwise casts, extra kernels
    cost = layer_cost(m, k, n, TensorwiseScaling(), TOY)
    assert cost.bf16_s == pytest.approx(bf16, rel=1e-12)
    assert cost.fp8_s == pytest.approx(fp8, rel=1e-12)
    assert layer_cost(m, k, n, DelayedScaling(), TOY).fp8_s < cost.fp8_s  # fused amax: fewer bytes


def test_rowwise_and_blockwise_costs_are_the_documented_roofline():
    """Two copies per operand (10 bytes + a float32 scale per 128 elements); a high-precision wgrad is one bf16 GEMM
    in place of an FP8 one."""
    m, k, n = 64, 128, 32
    bf16_gemm = max(2 * m * k * n / 1e12, 2 * (m * k + n * k + m * n) / 1e9)
    fp8_gemm = max(2 * m * k * n / 2e12, ((m * k + n * k) + 2 * m * n) / 1e9)
    casts = 2 * (5 + 4 / 128) * (m * k + n * k + m * n) / 1e9 + 9 * 1e-6
    for recipe in (RowwiseScaling(), BlockwiseScaling()):
        assert layer_cost(m, k, n, recipe, TOY).fp8_s == pytest.approx(3 * fp8_gemm + casts, rel=1e-12)
    hp_wgrad = layer_cost(m, k, n, RowwiseScaling(high_precision_wgrad=True), TOY)
    assert hp_wgrad.fp8_s == pytest.approx(2 * fp8_gemm + bf16_gemm + casts, rel=1e-12)


def test_experts_cost_reads_and_casts_every_expert_weight():
    """A grouped projection: the tokens' FLOPs, every expert's weight read each step and cast once per weight
    version; micro-batches sharing one cast pay a fraction of it."""
    m, e, k, n = 96, 4, 128, 32
    w = e * n * k
    bf16 = 3 * max(2 * m * k * n / 1e12, 2 * (m * k + w + m * n) / 1e9)
    gemms = 3 * max(2 * m * k * n / 2e12, ((m * k + w) + 2 * m * n) / 1e9)
    for share in (1.0, 0.25):
        fp8 = gemms + 7.0 * (m * k + share * w + m * n) / 1e9 + 9 * 1e-6  # tensorwise casts, extra kernels
        cost = experts_cost(m, e, k, n, TensorwiseScaling(), TOY, weight_casts=share)
        assert cost.bf16_s == pytest.approx(bf16, rel=1e-12)
        assert cost.fp8_s == pytest.approx(fp8, rel=1e-12)


def test_few_tokens_per_expert_keep_fp8_experts_below_bf16_on_h100():
    """DeepSeek-V3's gate/up projection (64 experts, K 7168, N 4096) on an H100: at ~134 tokens per expert the
    weight casts leave FP8 below bf16; more tokens, or micro-batches sharing the weight cast, lift it above."""
    def speedup(tokens_per_expert, share=1.0):
        return experts_cost(64 * tokens_per_expert, 64, 7168, 4096, RowwiseScaling(), H100, weight_casts=share).speedup

    assert speedup(134) < 0.6
    assert speedup(134) < speedup(1024) < speedup(4096)
    assert speedup(4096) > 1.0
    assert speedup(134, share=1 / 8) > 1.0


def test_speedup_grows_with_size_on_h100():
    speedups = [layer_cost(8192, s, s, TensorwiseScaling(), H100).speedup for s in (512, 1024, 2048, 4096, 8192)]
    assert speedups == sorted(speedups)
    assert speedups[0] < 1 < speedups[-1]


@pytest.mark.parametrize("recipe", [TensorwiseScaling(), DelayedScaling(), MXFP8BlockScaling()], ids=lambda r: r.name)
def test_small_layers_stay_high_precision_with_the_reason(recipe):
    model = _model()
    report = convert_to_fp8(model, recipe, profitability=ProfitabilityGate(roofline=H100))
    assert "0" in report.converted and "2" in report.skipped  # 8192x8192 pays off, 256x256 does not
    assert sorted(report.converted + list(report.skipped)) == ["0", "1", "2"]
    reason = report.skipped["2"]
    assert "too small to gain from FP8 on H100" in reason and "K=256, N=256" in reason and "profitability=False" in reason
    assert type(model[2]) is nn.Linear and isinstance(model[0], FP8Linear)


def test_tokens_per_step_changes_the_decision():
    layer = nn.Linear(2048, 2048)
    assert ProfitabilityGate(tokens=256, roofline=H100).skip_reason(layer, TensorwiseScaling()) is not None
    assert ProfitabilityGate(tokens=65536, roofline=H100).skip_reason(layer, TensorwiseScaling()) is None


def test_default_on_cpu_converts_every_layer():
    model = _model()
    report = convert_to_fp8(model, "tensorwise")
    assert report.converted == ["0", "1", "2"] and report.skipped == {}


def test_forcing_the_gate_on_cpu_keeps_everything_high_precision_and_says_why():
    report = convert_to_fp8(_model(), "tensorwise", profitability=True)
    assert report.converted == []
    assert all("emulated on cpu" in reason for reason in report.skipped.values())


def test_false_and_context_default():
    assert convert_to_fp8(_model(), "tensorwise", profitability=False).skipped == {}
    with profitability_setting(ProfitabilityGate(roofline=H100)):
        assert "2" in convert_to_fp8(_model(), "tensorwise").skipped
    with pytest.raises(ValueError, match="allowed: 'auto'"):
        resolve_gate("sometimes")


def test_precision_plugin_option_reaches_the_conversion():
    plugin = FP8Precision(recipe="tensorwise", profitability=ProfitabilityGate(roofline=H100))
    plugin.convert_module(_model())
    assert set(plugin.conversion_report.skipped) >= {"2"} and plugin.conversion_report.converted[0] == "0"
    default = FP8Precision(recipe="tensorwise")  # "auto" on CPU: nothing skipped
    default.convert_module(_model())
    assert default.conversion_report.skipped == {}
    with pytest.raises(ValueError, match="profitability="):
        FP8Precision(profitability="yes")


@requires_cuda_fp8
def test_cuda_auto_gate_uses_the_device_numbers():
    layer = nn.Linear(8192, 8192, device="cuda")
    assert resolve_gate("auto").skip_reason(layer, TensorwiseScaling()) is None
    assert resolve_gate("auto").skip_reason(nn.Linear(64, 64, device="cuda"), TensorwiseScaling()) is not None


@pytest.mark.parametrize(("field", "value"), [("tokens", 0), ("tokens", -5), ("tokens", 8.5), ("min_speedup", 0),
                                              ("min_speedup", float("nan")), ("min_speedup", float("inf")),
                                              ("roofline", "X100"), ("roofline", 1e15), ("device", "cuda:x"),
                                              ("device", [0])])
def test_gate_fields_that_cannot_mean_anything_are_refused(field, value):
    """Guards against ProfitabilityGate(tokens=0) or min_speedup=nan being taken and modelling nonsense."""
    from fp8_lightning import ProfitabilityGate

    with pytest.raises(ValueError, match=rf"ProfitabilityGate.{field}=.* is invalid; allowed:"):
        ProfitabilityGate(**{field: value})


def _gate_of_conversion(monkeypatch, accumulate, profitability, device="cpu"):
    """The gate a Trainer's conversion (``FP8Precision.convert_module``) put in force."""
    from lightning.pytorch import LightningModule, Trainer

    import fp8_lightning.lightning.precision as precision

    seen, real = [], precision.profitability_setting
    monkeypatch.setattr(precision, "profitability_setting", lambda gate: (seen.append(gate), real(gate))[1])
    module = LightningModule()
    module.net = nn.Sequential(nn.Linear(64, 64))
    module.trainer = Trainer(accumulate_grad_batches=accumulate, accelerator=device, logger=False,
                             enable_checkpointing=False)
    FP8Precision(recipe="tensorwise", profitability=profitability).convert_module(module)
    return seen[-1]


@pytest.mark.parametrize("value", ["auto", True])
def test_a_trainers_gradient_accumulation_reaches_the_gate(monkeypatch, value):
    assert _gate_of_conversion(monkeypatch, 8, value).microbatches == 8
    assert _gate_of_conversion(monkeypatch, 1, value).microbatches == 1


def test_a_gate_the_user_built_keeps_its_micro_batches(monkeypatch):
    own = ProfitabilityGate(roofline=H100, microbatches=2)
    assert _gate_of_conversion(monkeypatch, 8, own).microbatches == 2
    with profitability_setting(own):  # None: the setting in force, the user's gate
        assert _gate_of_conversion(monkeypatch, 8, None).microbatches == 2
    assert _gate_of_conversion(monkeypatch, 8, False) is False  # no gate
    on_cuda = types.SimpleNamespace(accumulate_grad_batches=True,  # a bool is no count
                                    strategy=types.SimpleNamespace(root_device=torch.device("cuda", 0)))
    gate = trainer_gate("auto", on_cuda)
    assert gate.microbatches == 1 and gate.device == torch.device("cuda", 0)


def test_on_a_gpu_micro_batches_share_the_cast_only_without_the_checksum(monkeypatch):
    on_cuda = types.SimpleNamespace(accumulate_grad_batches=8,
                                    strategy=types.SimpleNamespace(root_device=torch.device("cuda", 0)))
    assert trainer_gate("auto", on_cuda).microbatches == 1  # by default each micro-batch casts the weight again
    monkeypatch.setenv("FP8_LIGHTNING_WEIGHT_CHECKSUM", "0")
    reload_settings()
    try:
        assert trainer_gate("auto", on_cuda).microbatches == 8
    finally:
        monkeypatch.delenv("FP8_LIGHTNING_WEIGHT_CHECKSUM")
        reload_settings()


def test_a_known_device_is_named_by_its_table_key():
    gate = ProfitabilityGate(roofline="H100", device="cuda:0")
    assert gate.roofline is H100 and gate.device == torch.device("cuda", 0)


def test_the_plugin_names_the_gate_where_the_gate_kept_layers():
    import warnings

    plugin = FP8Precision(recipe="tensorwise", profitability=ProfitabilityGate(roofline=H100, tokens=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugin.convert_module(_model())
    said = [str(w.message) for w in caught]
    assert any("profitability gate kept 3 linear layer(s)" in m and "profitability=False" in m for m in said), said
    assert not any("Pad them" in m for m in said), said  # the gate's skips are not a shape problem
    assert any("converted no layer" in m and "profitability gate" in m for m in said), said
