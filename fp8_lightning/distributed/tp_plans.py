"""Tensor-parallel plans for real models: transformers' Llama-family and Qwen models, and the project's GPT.

A plan maps module names to parallel styles for ``torch.distributed.tensor.parallel.parallelize_module``::

    plan = transformers_tp_plan(hf_model, tp_size)   # from hf_model.config.base_model_tp_plan
    parallelize_module(hf_model, mesh["tensor_parallel"], plan)

transformers names its styles (``"colwise"``, ``"rowwise"``, ...) in ``config.base_model_tp_plan``, with keys
relative to the base model (``layers.*.self_attn.q_proj``); :func:`transformers_tp_plan` gives each name its FP8
style (:data:`STYLE_FACTORIES`), prefixes the keys with the base model's attribute and expands ``*`` to the
model's own module names, so that a key that matches nothing, a style with no FP8 counterpart, or heads that do
not split evenly fail here, at set-up. transformers' attention reshapes q, k and v with ``-1`` heads and its
``head_dim``, and repeats k/v by the ratio of the head counts, so a rank that holds ``heads / tp`` query heads and
``kv_heads / tp`` key/value heads attends over them without a config change.

Norms that transformers marks ``replicated_with_grad_allreduce`` (Qwen3's per-head ``q_norm`` / ``k_norm``) see
only a rank's heads: their replicated weight's gradient is summed over the group by torch's ``SequenceParallel``
on the heads dimension. The layers a plan leaves out (embeddings, the LM head, norms between blocks) stay
replicated: every tensor-parallel rank computes them alike.
"""

from __future__ import annotations

import fnmatch
from typing import Callable

import torch.nn as nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from fp8_lightning.distributed.tensor_parallel import FP8ColwiseParallel, FP8RowwiseParallel

STYLE_FACTORIES: dict[str, Callable[[], ParallelStyle | None]] = {
    "colwise": FP8ColwiseParallel,
    "rowwise": FP8RowwiseParallel,
    "colwise_rep": lambda: FP8ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda: FP8ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: FP8RowwiseParallel(input_layouts=Replicate()),
    "rowwise_split_input": lambda: FP8RowwiseParallel(input_layouts=Replicate()),
    "sequence_parallel": lambda: SequenceParallel(use_local_output=True),
    "replicated_with_grad_allreduce": lambda: SequenceParallel(sequence_dim=-2, use_local_output=True),
    "replicate": lambda: None,
}
"""transformers' style names and the style each becomes (FP8 for linear layers; torch's for norms). ``None``: the
module stays out of the plan, replicated on every rank (transformers' ``"replicate"``)."""

_PARTIAL_OUTPUT = (
    "its layers leave partial sums for a later module of the plan ('gather', 'all_reduce') to reduce, a contract "
    "the FP8 styles (which reduce their own outputs) do not follow"
)
UNSUPPORTED_STYLES: dict[str, str] = {
    "packed_colwise": "it splits a fused weight (gate and up, or q, k and v, stacked) part by part, which the FP8 "
                      "colwise style does not; unfuse the projections, or leave the module out of the plan",
    "packed_rowwise": "it splits a fused weight part by part, which the FP8 rowwise style does not",
    "local_colwise": _PARTIAL_OUTPUT,
    "local_rowwise": _PARTIAL_OUTPUT,
    "local_packed_rowwise": _PARTIAL_OUTPUT,
    "local": _PARTIAL_OUTPUT,
    "gather": _PARTIAL_OUTPUT,
    "all_reduce": _PARTIAL_OUTPUT,
    "local_params": _PARTIAL_OUTPUT,
    "embedding_rowwise": "it splits an embedding, which stays replicated under the FP8 plans (FP8 applies to linear "
                         "layers); give it torch's RowwiseParallel() through overrides if it must be split",
    "embedding_colwise": "it splits an embedding, which stays replicated under the FP8 plans (FP8 applies to linear "
                         "layers); give it torch's ColwiseParallel() through overrides if it must be split",
    "mla_kv_a_proj": "it splits DeepSeek-style latent attention's joint projection, which has no FP8 style",
}
"""transformers' style names with no FP8 counterpart, with the reason (mixture-of-experts styles, ``moe_*``,
``ep_*`` and ``grouped_gemm``, split 3-D expert weights: expert parallelism, which these plans do not do)."""

GPT_ATTENTION = ("attn.q", "attn.k", "attn.v")


def _unsupported_reason(name: str) -> str:
    if name in UNSUPPORTED_STYLES:
        return UNSUPPORTED_STYLES[name]
    if name.startswith(("moe_", "ep_")) or name == "grouped_gemm":
        return "it splits 3-D expert weights (expert parallelism), which the FP8 tensor-parallel plans do not do"
    return f"it is not a style these plans know; supported: {sorted(STYLE_FACTORIES)}"


def fp8_style(name: str, where: str = "") -> ParallelStyle | None:
    """The parallel style for transformers' style ``name``.

    Args:
        name: a style name of ``config.base_model_tp_plan`` (``"colwise"``, ``"rowwise"``, ...).
        where: the plan key, named in the error.

    Returns:
        A fresh ``ParallelStyle`` instance, or None for a module that stays replicated (``"replicate"``).

    Raises:
        ValueError: a style with no FP8 counterpart (:data:`UNSUPPORTED_STYLES`), with the reason and the fix.
    """
    if name not in STYLE_FACTORIES:
        key = f" for '{where}'" if where else ""
        raise ValueError(
            f"tensor-parallel style {name!r}{key} has no FP8 counterpart: {_unsupported_reason(name)}. Leave that "
            f"module out of the plan (overrides={{{where or '<plan key>'!r}: None}}) or give it a style yourself "
            f"(overrides={{{where or '<plan key>'!r}: <ParallelStyle>}})."
        )
    return STYLE_FACTORIES[name]()


def _matches(pattern: str, name: str) -> bool:
    """transformers' plan keys: ``*`` stands for one dotted atom (a layer number)."""
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(fnmatch.fnmatchcase(p, a) for a, p in zip(atoms, parts))


def expand_plan(model: nn.Module, plan: dict[str, ParallelStyle | None], prefix: str = "") -> dict[str, ParallelStyle]:
    """A plan with wildcard keys (relative to ``prefix``) as the concrete module names of ``model``.

    Args:
        model: the module the plan will be applied to (``parallelize_module(model, ...)``).
        plan: keys with ``*`` for one name atom; a value of None drops the key.
        prefix: prepended to every key (e.g. ``"model."`` for a causal LM's base model).

    Returns:
        ``{module name: style}`` for every module a key matches; a key that matches none raises ValueError.
    """
    names = [name for name, _ in model.named_modules() if name]
    expanded: dict[str, ParallelStyle] = {}
    for key, style in plan.items():
        if style is None:
            continue
        found = [name for name in names if _matches(prefix + key, name)]
        if not found:
            raise ValueError(
                f"tensor-parallel plan key '{prefix + key}' matches no module of {type(model).__name__}; its modules "
                f"include {names[:6]}... Check the key (and the prefix {prefix!r}), or drop it from the plan."
            )
        expanded.update({name: style for name in found})
    return expanded


def check_heads(heads: int, kv_heads: int, tp_size: int, owner: str, fields: tuple[str, str]) -> None:
    """Refuse a split that would cut an attention head: both head counts must divide by ``tp_size``."""
    bad = [f"{field}={n}" for field, n in zip(fields, (heads, kv_heads)) if n % tp_size]
    if bad:
        raise ValueError(
            f"{owner}: {', '.join(bad)} does not split over tensor_parallel_size={tp_size}; each rank must hold "
            f"whole heads. Use a tensor-parallel size that divides {heads} and {kv_heads}."
        )


def base_model_prefix(model: nn.Module) -> str:
    """The attribute path (with a trailing dot) of a transformers model's base model, '' for a base model."""
    base = getattr(model, "base_model", model)
    if base is model:
        return ""
    name = next((n for n, m in model.named_modules() if m is base), None)
    if name is None:
        raise ValueError(f"{type(model).__name__}.base_model is not one of its submodules; pass a transformers model.")
    return name + "."


def transformers_tp_plan(
    model: nn.Module, tp_size: int, overrides: dict[str, ParallelStyle | None] | None = None
) -> dict[str, ParallelStyle]:
    """The FP8 tensor-parallel plan of a transformers model (Llama family, Qwen2/3, ...) from its
    ``config.base_model_tp_plan``.

    Args:
        model: a transformers ``PreTrainedModel`` (a causal LM or its base model); keys are relative to it.
        tp_size: the size of the tensor-parallel mesh (the heads must divide by it).
        overrides: plan keys (as in ``base_model_tp_plan``) to replace with another style, or to drop (None).

    Returns:
        ``{module name: style}`` for ``parallelize_module(model, tp_mesh, plan)``.
    """
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    names = getattr(text, "base_model_tp_plan", None)
    if not names:
        raise ValueError(
            f"{type(model).__name__} has no config.base_model_tp_plan (a transformers model whose config names its "
            "tensor-parallel styles, e.g. Llama or Qwen); build the plan by hand with FP8ColwiseParallel and "
            "FP8RowwiseParallel."
        )
    heads = int(text.num_attention_heads)
    check_heads(heads, int(getattr(text, "num_key_value_heads", None) or heads), tp_size, type(text).__name__,
                ("num_attention_heads", "num_key_value_heads"))
    overrides = dict(overrides or {})
    plan = {key: overrides[key] if key in overrides else fp8_style(style, key) for key, style in names.items()}
    return expand_plan(model, plan, base_model_prefix(model))


def gpt_tp_plan(model: nn.Module, tp_size: int) -> dict[str, ParallelStyle]:
    """The FP8 tensor-parallel plan of the project's GPT (:class:`~fp8_lightning.models.gpt.GPT`) built with
    ``fused_qkv=False``: q, k, v and the MLP's ``fc`` colwise, the output projections rowwise (Megatron's split);
    embeddings, norms and the LM head stay replicated.

    Args:
        model: the GPT (keys are relative to it).
        tp_size: the size of the tensor-parallel mesh (``n_head`` must divide by it).

    Returns:
        ``{module name: style}`` for ``parallelize_module(model, tp_mesh, plan)``.
    """
    attention = [m for _, m in model.named_modules() if type(m).__name__ == "CausalSelfAttention"]
    if any(hasattr(m, "qkv") for m in attention):
        raise ValueError(
            "GPT(fused_qkv=True) cannot be split by tensor parallelism: a colwise split of the fused qkv weight "
            "would give a rank part of q and part of k instead of its own heads. Build it with fused_qkv=False "
            "(model.fused_qkv=false in fp8-train)."
        )
    if attention:
        check_heads(attention[0].n_head, attention[0].n_head, tp_size, "GPT", ("n_head", "n_head"))
    plan: dict[str, ParallelStyle | None] = {f"blocks.*.{name}": FP8ColwiseParallel() for name in GPT_ATTENTION}
    plan.update({"blocks.*.attn.proj": FP8RowwiseParallel(), "blocks.*.mlp.fc": FP8ColwiseParallel(),
                 "blocks.*.mlp.proj": FP8RowwiseParallel()})
    return expand_plan(model, plan)


def tensor_parallel_layers(module: nn.Module) -> list[str]:
    """Names of the layers of ``module`` that an FP8 parallel style has split (for set-up checks).

    Args:
        module: any module.

    Returns:
        The names, in module order.
    """
    return [name for name, m in module.named_modules() if "fp8_tensor_parallel" in m.__dict__]


def tensor_parallel_degree(module: nn.Module) -> int:
    """The size of the tensor-parallel mesh the layers of ``module`` were split over by an FP8 plan (the largest,
    should there be several), 1 when no layer was split.

    Args:
        module: any module.

    Returns:
        The number of ranks a split layer's weight is spread over.
    """
    sizes = [m.fp8_tensor_parallel.size for _, m in module.named_modules() if "fp8_tensor_parallel" in m.__dict__]
    return max(sizes, default=1)


__all__ = ["STYLE_FACTORIES", "expand_plan", "fp8_style", "gpt_tp_plan", "tensor_parallel_layers",
           "tensor_parallel_degree", "transformers_tp_plan"]
