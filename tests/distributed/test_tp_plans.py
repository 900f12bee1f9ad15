"""The FP8 plan of a transformers model from its ``config.base_model_tp_plan`` (one process, no collective: the
plan is built, not applied): Qwen3's per-head norms, Qwen2's and Llama's plain plans, transformers' other style names
mapped or refused with the reason, and heads that do not split."""

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import SequenceParallel

from fp8_lightning.distributed import FP8ColwiseParallel, FP8RowwiseParallel
from fp8_lightning.distributed.tp_plans import transformers_tp_plan

SIZE = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32)


def causal_lm(family: str, **overrides):
    import transformers

    config = getattr(transformers, f"{family}Config")(**{**SIZE, **overrides})
    return getattr(transformers, f"{family}ForCausalLM")(config)


def test_qwen3_plan_splits_attention_and_mlp_and_keeps_the_head_norms_replicated():
    model = causal_lm("Qwen3", head_dim=128)
    plan = transformers_tp_plan(model, 2)
    assert len(plan) == 2 * 9  # every key of Qwen3's plan, for each layer
    for layer in ("model.layers.0", "model.layers.1"):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            style = plan[f"{layer}.{name}"]
            assert type(style) is FP8ColwiseParallel and style.output_layouts == (Shard(-1),)
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            style = plan[f"{layer}.{name}"]
            assert type(style) is FP8RowwiseParallel and style.output_layouts == (Replicate(),)
        for name in ("self_attn.q_norm", "self_attn.k_norm"):  # normalize each of this rank's heads (dim -2)
            style = plan[f"{layer}.{name}"]
            assert type(style) is SequenceParallel and style.sequence_sharding == (Shard(-2),)
    assert not any("embed" in name or "lm_head" in name or "layernorm" in name for name in plan)


@pytest.mark.parametrize("family", ["Qwen2", "Llama"])
def test_plans_without_head_norms(family):
    plan = transformers_tp_plan(causal_lm(family), 2)
    assert len(plan) == 2 * 7 and not any(isinstance(style, SequenceParallel) for style in plan.values())


@pytest.mark.parametrize("name, replicated_input", [("rowwise_rep", True), ("rowwise_split_input", True),
                                                     ("colwise_rep", False), ("replicate", None)])
def test_other_transformers_styles_map_to_fp8_styles(name, replicated_input):
    model = causal_lm("Qwen2")
    model.config.base_model_tp_plan = {**model.config.base_model_tp_plan, "layers.*.mlp.down_proj": name}
    plan = transformers_tp_plan(model, 2)
    if replicated_input is None:  # "replicate": every rank keeps the whole module, out of the plan
        assert "model.layers.0.mlp.down_proj" not in plan and len(plan) == 2 * 6
        return
    style = plan["model.layers.0.mlp.down_proj"]
    assert style.output_layouts == (Replicate(),)
    if replicated_input:
        assert type(style) is FP8RowwiseParallel and style.input_layouts == (Replicate(),)


@pytest.mark.parametrize("name, reason", [
    ("packed_colwise", "fused weight"),
    ("local_rowwise", "partial sums for a later module"),
    ("gather", "partial sums for a later module"),
    ("moe_tp_experts", "3-D expert weights"),
    ("embedding_rowwise", "splits an embedding"),
    ("no_such_style", "not a style these plans know; supported: .*'colwise'"),
])
def test_styles_without_an_fp8_counterpart_are_refused_with_the_reason(name, reason):
    model = causal_lm("Qwen3", head_dim=128)
    model.config.base_model_tp_plan = {**model.config.base_model_tp_plan, "layers.*.mlp.up_proj": name}
    with pytest.raises(ValueError, match=f"{name!r} for 'layers.*.mlp.up_proj' has no FP8 counterpart: .*{reason}"):
        transformers_tp_plan(model, 2)
    plan = transformers_tp_plan(model, 2, overrides={"layers.*.mlp.up_proj": None})  # the fix the error names
    assert "model.layers.0.mlp.up_proj" not in plan and len(plan) == 2 * 8


@pytest.mark.parametrize("tp_size, field", [(4, "num_key_value_heads=2"), (8, "num_attention_heads=4")])
def test_heads_that_do_not_split_are_refused(tp_size, field):
    with pytest.raises(ValueError, match=f"Qwen3Config: .*{field}.* does not split over tensor_parallel_size"):
        transformers_tp_plan(causal_lm("Qwen3", head_dim=128), tp_size)
