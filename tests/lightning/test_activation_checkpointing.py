"""Activation checkpointing through the front doors: ``Trainer(precision="fp8-...")`` with checkpointed blocks, and
a transformers mixture of experts with ``gradient_checkpointing_enable()``, in both checkpoint modes. The runs must
match the same runs without checkpointing bit for bit (losses, weights, FP8 scaling state, expert GEMM counts)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from fp8_lightning import convert_to_fp8, fp8_autocast, fp8_state_dict, sync_scales

from .user_model import TinyTransformerLM, loader, trainer_kwargs


class CheckpointedLM(TinyTransformerLM):
    def __init__(self, use_reentrant: bool):
        super().__init__()
        self.use_reentrant = use_reentrant

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.use_reentrant)
        return self.head(self.ln_f(x))


def _same(a, b) -> bool:
    """Equal nested states, tensors bit for bit."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b))
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def _fit(precision: str, use_reentrant: bool | None):
    import lightning as L

    L.seed_everything(0, verbose=False)
    model = TinyTransformerLM() if use_reentrant is None else CheckpointedLM(use_reentrant)
    trainer = L.Trainer(max_steps=3, precision=precision, **trainer_kwargs())
    trainer.fit(model, loader())
    return model


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("precision", ["fp8-tensorwise", "fp8-delayed"])
def test_trainer_with_checkpointed_blocks_matches_the_unchecked_run(precision, use_reentrant):
    plain = _fit(precision, None)
    checked = _fit(precision, use_reentrant)
    assert checked.losses == plain.losses
    for (name, a), b in zip(plain.state_dict().items(), checked.state_dict().values()):
        assert torch.equal(a, b), name
    a, b = fp8_state_dict(plain), fp8_state_dict(checked)
    assert len(a) == 2 * 4 + 1 and _same(a, b)  # amax histories, scales and cast counters


def _moe_grads(use_reentrant: bool | str | None, recipe: str):
    transformers = pytest.importorskip("transformers", reason="needs transformers (dev extras)")
    from tests.helpers.moe import VOCAB, tiny_moe

    model = tiny_moe("qwen3_moe")
    model.config.use_cache = False
    convert_to_fp8(model, recipe)
    model.train()
    if use_reentrant == "default":  # transformers' own choice (non-reentrant in 5.x)
        model.gradient_checkpointing_enable()
    elif use_reentrant is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    assert isinstance(model, transformers.PreTrainedModel)
    torch.manual_seed(3)
    ids = torch.randint(3, VOCAB, (2, 16))
    with fp8_autocast():
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    sync_scales(model)
    # (a recipe's conversion policy may keep some experts in high precision: NVFP4's last block)
    experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts") and hasattr(m, "fp8_gemm_counts")]
    return ({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, [m.fp8_gemm_counts for m in experts],
            fp8_state_dict(model))


@pytest.mark.parametrize("use_reentrant", ["default", False, True])
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "mxfp8", "nvfp4"])
def test_hugging_face_moe_gradient_checkpointing_matches_the_unchecked_run(recipe, use_reentrant):
    grads, counts, state = _moe_grads(None, recipe)
    checked_grads, checked_counts, checked_state = _moe_grads(use_reentrant, recipe)
    assert grads.keys() == checked_grads.keys() and any("experts" in n for n in grads)
    for name in grads:
        assert torch.equal(grads[name], checked_grads[name]), name
    assert counts == checked_counts and counts and all(c == {"fprop": 2, "dgrad": 2, "wgrad": 2} for c in counts)
    assert _same(state, checked_state)
