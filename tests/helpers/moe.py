"""Tiny random-init mixture-of-experts models from the installed transformers, one per family with fused experts."""

from __future__ import annotations

import torch

HIDDEN, EXPERT_HIDDEN, EXPERTS, VOCAB = 64, 32, 8, 128


def _config(family: str):
    import transformers as tf

    common = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **common, intermediate_size=64, moe_intermediate_size=EXPERT_HIDDEN, num_experts=EXPERTS, head_dim=16,
        )
    if family == "mixtral":
        return tf.MixtralConfig(**common, intermediate_size=EXPERT_HIDDEN, num_local_experts=EXPERTS, head_dim=16)
    if family == "olmoe":
        return tf.OlmoeConfig(**common, intermediate_size=EXPERT_HIDDEN, num_experts=EXPERTS)
    if family == "deepseek_v3":
        common["num_key_value_heads"] = 4  # multi-head latent attention: as many key-value heads as heads
        return tf.DeepseekV3Config(
            **common, intermediate_size=64, moe_intermediate_size=EXPERT_HIDDEN, n_routed_experts=EXPERTS,
            n_shared_experts=1, first_k_dense_replace=0, n_group=2, topk_group=1, q_lora_rank=None, kv_lora_rank=32,
            qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
        )
    if family == "gpt_oss":
        return tf.GptOssConfig(
            **common, intermediate_size=EXPERT_HIDDEN, num_local_experts=EXPERTS, head_dim=16, sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
        )
    raise ValueError(family)


FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss"]


def tiny_moe(family: str, seed: int = 0):
    """A random-init causal LM of ``family`` (2 layers, hidden 64, 8 experts of 32, top-2), in float32."""
    import transformers as tf

    config = _config(family)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # some families leave fused expert weights uninitialized until from_pretrained
        for name, p in model.named_parameters():
            if not torch.isfinite(p).all() or (p.dim() == 3 and p.abs().sum() == 0):
                p.normal_(0, 0.02)
    return model
