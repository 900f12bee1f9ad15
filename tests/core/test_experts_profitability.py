"""The experts' profitability gate models each fused projection at ``tokens x top_k`` routed rows, top-k read from the
model (or the gate, or a default), and keeps experts in bf16 where FP8 is modelled slower; micro-batches share the
weight cast. Decisions are checked against the roofline worked out by hand below, on a simulated sm_100 (MXFP8's
grouped route native) with a made-up device whose GEMMs are all compute-bound at the token counts used."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn as nn

from fp8_lightning import GroupedExperts, ProfitabilityGate, capability_table, convert_to_fp8
from fp8_lightning.profitability import model_top_k
from fp8_lightning.roofline import DeviceRoofline
from fp8_lightning.recipes import recipe_from
from tests.helpers.moe import EXPERT_HIDDEN, EXPERTS, FAMILIES, HIDDEN, tiny_moe

# A device with bf16 at B FLOP/s, FP8 at 2B and memory at W = B / 8 bytes/s, no launch latency.
B, W = 1e12, 1e12 / 8
DEVICE = DeviceRoofline("what-if", bf16_flops=B, fp8_flops=2 * B, bandwidth=W, launch_s=0.0, source="the test")
C = 2 * (2 + 1 + 1 / 32)  # MXFP8 casts: a rowwise and a columnwise copy, each reading bf16, writing codes and scales
QWEN = [(EXPERTS, HIDDEN, 2 * EXPERT_HIDDEN), (EXPERTS, EXPERT_HIDDEN, HIDDEN)]  # (E, K, N): gate_up_proj, down_proj


def hand(m: int, projections, weight_casts: float = 1.0) -> tuple[float, float]:
    """(bf16 s, FP8 s) of the grouped forward+backward at ``m`` routed rows, every GEMM compute-bound (checked)."""
    bf16 = fp8 = 0.0
    for e, k, n in projections:
        flops = 2.0 * m * k * n
        assert flops / B >= 2 * (m * k + e * k * n + m * n) / W  # bf16 GEMMs compute-bound
        assert flops / (2 * B) >= (m * k + e * k * n + 2 * m * n) / W  # FP8 GEMMs compute-bound
        bf16 += 3 * flops / B
        fp8 += 3 * flops / (2 * B) + C * (m * k + weight_casts * e * k * n + m * n) / W
    return bf16, fp8


def break_even_rows(projections, weight_casts: float = 1.0) -> float:
    """Routed rows where FP8 equals bf16: m (3 sum KN / B - C sum (K + N) / W) = C w sum EKN / W."""
    gain = sum(3 * k * n / B - C * (k + n) / W for _, k, n in projections)
    return C * weight_casts * sum(e * k * n for e, k, n in projections) / W / gain


@contextlib.contextmanager
def sm100():
    """A simulated sm_100 CUDA device (no GPU needed): MXFP8's grouped route is native there, at 2x bf16. Entered
    after the model is built (transformers asks CUDA more than a simulation answers)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: True)
        patch.setattr(capability_table, "device_facts", lambda device: ((10, 0), (12, 9), True))
        patch.setattr(capability_table, "_warned", set())
        yield


def _gate(tokens: int, **kw) -> ProfitabilityGate:
    return ProfitabilityGate(tokens=tokens, device="cuda", roofline=DEVICE, **kw)


def _convert(model: nn.Module, gate: ProfitabilityGate):
    with sm100():
        return convert_to_fp8(model, "mxfp8", profitability=gate)


def _qwen():
    pytest.importorskip("transformers", reason="needs transformers (dev extras)")
    return tiny_moe("qwen3_moe")


def _experts_report(tokens: int, **kw):
    return _convert(_qwen(), _gate(tokens, **kw))


def test_the_hand_model_breaks_even_where_worked_out():
    rows = break_even_rows(QWEN)  # 8 x 6.0625 x 6144 / (3 x 6144 / 8 - 6.0625 x 224) = 297984 / 946
    assert rows == pytest.approx(297984 / 946)
    bf16, fp8 = hand(math.ceil(rows), QWEN)
    assert fp8 < bf16 and hand(math.floor(rows), QWEN)[1] > hand(math.floor(rows), QWEN)[0]


def test_a_large_token_count_converts_the_experts():
    report = _experts_report(tokens=4096)
    assert sorted(report.experts) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert report.experts_skipped == {}


def test_a_small_token_count_keeps_the_experts_in_bf16_with_the_modelled_times():
    tokens = 100  # x top_k 2 = 200 routed rows, 25 per expert: below the break-even of about 315 rows
    assert 2 * tokens < break_even_rows(QWEN)
    bf16, fp8 = hand(2 * tokens, QWEN)
    report = _experts_report(tokens)
    assert report.experts == [] and len(report.experts_skipped) == 2
    reason = report.experts_skipped["model.layers.0.mlp.experts"]
    assert "gate_up_proj (E=8, K=64, N=64), down_proj (E=8, K=32, N=64)" in reason
    assert "25 tokens per expert (tokens=100 x top_k=2 (the model's) / 8 experts)" in reason
    assert f"{fp8 * 1e6:.1f} us in FP8 vs {bf16 * 1e6:.1f} us in bf16" in reason  # 8.2 vs 7.4
    assert "on what-if" in reason and "profitability=False" in reason


@pytest.mark.parametrize("side", [-1, 1], ids=["below", "above"])
def test_the_decision_flips_at_the_hand_computed_break_even(side):
    rows = break_even_rows(QWEN)  # about 315 routed rows: 157 tokens x top-2 fall below it, 158 above
    tokens = math.floor(rows / 2) if side < 0 else math.ceil(rows / 2)
    report = _experts_report(tokens)
    assert (report.experts == []) == (side < 0)


def test_micro_batches_sharing_the_weight_cast_convert_what_one_would_not():
    rows = break_even_rows(QWEN, weight_casts=1 / 8)  # about 39 rows
    assert rows < 200 < break_even_rows(QWEN)
    bf16, fp8 = hand(200, QWEN, weight_casts=1 / 8)
    assert fp8 < bf16
    assert len(_experts_report(100, microbatches=8).experts) == 2
    assert _experts_report(100, microbatches=1).experts == []


def test_min_speedup_raises_the_bar():
    bf16, fp8 = hand(2 * 4096, QWEN)
    speedup = bf16 / fp8  # about 1.9
    assert len(_experts_report(4096, min_speedup=speedup * 0.99).experts) == 2
    assert _experts_report(4096, min_speedup=speedup * 1.01).experts == []


def test_the_gates_top_k_wins_over_the_models():
    """At 200 tokens the model's top-2 gives 400 routed rows (converts); top-1 gives 200 (bf16)."""
    assert 200 < break_even_rows(QWEN) < 400
    assert len(_experts_report(200).experts) == 2
    report = _experts_report(200, experts_top_k=1)  # the user's setting wins over the model's 2
    assert report.experts == [] and "top_k=1 (ProfitabilityGate.experts_top_k)" in str(report.experts_skipped)


def test_the_models_top_k_is_read():
    model = _qwen()
    model.config.num_experts_per_tok = 1  # the experts hold the model's config
    for module in model.modules():
        if hasattr(module, "top_k"):
            module.top_k = 1
    report = _convert(model, _gate(200))
    assert report.experts == [] and "top_k=1 (the model's)" in report.experts_skipped["model.layers.0.mlp.experts"]


def _grouped(tokens: int, **kw):
    experts = GroupedExperts(dim=HIDDEN, hidden_dim=EXPERT_HIDDEN, num_experts=EXPERTS)
    return _convert(experts, _gate(tokens, **kw))


def test_grouped_experts_take_top_k_from_the_gate_or_assume_one():
    projections = [(EXPERTS, HIDDEN, EXPERT_HIDDEN)] * 2 + [(EXPERTS, EXPERT_HIDDEN, HIDDEN)]  # w1, w3, w2
    rows = break_even_rows(projections)  # 297984 / 558, about 534
    assert 300 < rows < 4 * 300
    report = _grouped(300)
    assert report.experts == [] and "top_k=1 (assumed" in report.experts_skipped["<root>"]
    assert "experts_top_k=" in report.experts_skipped["<root>"]
    assert _grouped(300, experts_top_k=4).experts == ["<root>"]
    with pytest.raises(ValueError, match="top_k=9 .* exceeds the 8 experts of GroupedExperts"):
        _grouped(300, experts_top_k=9)


def test_a_linear_layer_counts_micro_batches_too():
    """One 64x64 linear at 20 tokens: the weight cast each step makes FP8 slower; shared by 8 micro-batches, faster.
    By hand: FP8 pays when m (3KN/r - C(K + N)) >= C w KN with r = B/W = 8: m >= 32.7 for w = 1, 4.1 for w = 1/8."""
    layer = nn.Linear(64, 64)
    assert break_even_rows([(1, 64, 64)]) == pytest.approx(C * 4096 / (3 * 4096 / 8 - C * 128))
    with sm100():
        assert _gate(20).skip_reason(layer, recipe_from("mxfp8")) is not None
        assert _gate(20, microbatches=8).skip_reason(layer, recipe_from("mxfp8")) is None


def test_auto_still_converts_every_expert_on_the_cpu():
    report = convert_to_fp8(_qwen(), "mxfp8")  # "auto", weights on the CPU
    assert len(report.experts) == 2 and report.experts_skipped == {}


@pytest.mark.parametrize("family", FAMILIES)
def test_top_k_is_found_in_every_familys_model(family):
    pytest.importorskip("transformers", reason="needs transformers (dev extras)")
    model = tiny_moe(family)
    names = [name for name, m in model.named_modules() if name.endswith("mlp.experts")]
    assert len(names) == 2 and all(model_top_k(model, name) == 2 for name in names)


class _Router(nn.Module):
    def __init__(self, top_k: int):
        super().__init__()
        self.top_k = top_k


def test_top_k_is_found_beside_hand_written_experts():
    block = nn.Module()
    block.router, block.experts = _Router(3), GroupedExperts(dim=16, hidden_dim=16, num_experts=4)
    model = nn.Sequential(block)
    assert model_top_k(model, "0.experts") == 3
    assert model_top_k(nn.Sequential(GroupedExperts(dim=16, hidden_dim=16, num_experts=4)), "0") is None
    assert model_top_k(GroupedExperts(dim=16, hidden_dim=16, num_experts=4), "<root>") is None


@pytest.mark.parametrize("field, value", [("experts_top_k", 0), ("experts_top_k", True), ("experts_top_k", 2.0),
                                          ("microbatches", 0), ("microbatches", "8"), ("microbatches", None)])
def test_bad_experts_fields_are_refused_with_what_is_allowed(field, value):
    with pytest.raises(ValueError, match=rf"ProfitabilityGate.{field}=.* is invalid; allowed: "):
        ProfitabilityGate(**{field: value})


def test_a_top_k_above_the_number_of_experts_belongs_to_something_else():
    block = nn.Module()
    block.router, block.experts = _Router(50), GroupedExperts(dim=16, hidden_dim=16, num_experts=4)  # 50 > 4
    model = nn.Sequential(block)
    model.top_k = 2  # an enclosing module's word, read after the one passed by
    assert model_top_k(model, "0.experts") == 2
    del model.top_k
    assert model_top_k(model, "0.experts") is None
