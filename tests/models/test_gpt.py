"""The GPT LightningModule: causality, sizes, FP8-friendly dimensions, optimizer groups, perplexity, schedule."""

import functools
import math

import pytest
import torch
import torch.nn as nn

from fp8_lightning.models import GPT, check_gpt_dims, warmup_cosine, warmup_cosine_factor


def tiny(**kw) -> GPT:
    args = dict(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64)
    return GPT(**{**args, **kw})


def expected_parameters(vocab, block, layers, width, mlp_ratio=4, tied=True) -> int:
    """Counted by hand from the architecture (LayerNorms with bias, Linears with bias, tied head)."""
    per_block = 2 * width + (3 * width * width + 3 * width) + (width * width + width) + 2 * width
    per_block += (mlp_ratio * width * width + mlp_ratio * width) + (mlp_ratio * width * width + width)
    head = 0 if tied else vocab * width
    return vocab * width + block * width + layers * per_block + 2 * width + head


@pytest.mark.parametrize(("layers", "width", "tied"), [(2, 64, True), (1, 96, False)])
def test_parameter_count_matches_the_architecture(layers, width, tied):
    model = tiny(n_layer=layers, n_embd=width, n_head=2, tie_weights=tied)
    assert model.num_parameters() == expected_parameters(256, 32, layers, width, tied=tied)


def test_every_linear_dimension_is_a_multiple_of_32():
    for module in tiny(n_embd=96, n_head=3).modules():
        if isinstance(module, nn.Linear):
            assert module.in_features % 32 == 0 and module.out_features % 32 == 0, module


def test_future_tokens_do_not_change_past_logits():
    model = tiny().eval()
    x = torch.randint(256, (2, 32))
    y = x.clone()
    y[:, 20:] = torch.randint(256, (2, 12))
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_loss_at_init_is_near_uniform_and_ppl_is_exp_of_mean_loss():
    model = tiny().eval()
    x, y = torch.randint(256, (4, 32)), torch.randint(256, (4, 32))
    loss, logits = model._loss((x, y))
    assert abs(loss.item() - math.log(256)) < 0.1  # small init: nearly uniform predictions
    model.val_ppl(logits, y)
    reference = torch.nn.functional.cross_entropy(logits.double().flatten(0, 1), y.flatten()).exp()
    torch.testing.assert_close(model.val_ppl.compute().double(), reference, rtol=1e-5, atol=0)


@pytest.mark.parametrize(("kw", "message"), [
    (dict(n_embd=100), "n_embd=100 is not a multiple of 32"),
    (dict(vocab_size=250), "vocab_size=250 is not a multiple of 32"),
    (dict(n_embd=64, n_head=3), "not divisible by n_head=3"),
])
def test_bad_dimensions_fail_with_the_fix(kw, message):
    args = dict(vocab_size=256, n_embd=64, n_head=4, mlp_ratio=4) | kw
    with pytest.raises(ValueError, match=message):
        check_gpt_dims(**args)


def test_too_long_sequence_is_rejected():
    with pytest.raises(ValueError, match="exceeds block_size=32"):
        tiny()(torch.zeros(1, 33, dtype=torch.long))


def test_optimizer_partial_gets_decay_and_no_decay_groups():
    model = tiny(optimizer=functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.1))
    opt = model.configure_optimizers()
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    n_params = sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert n_params == model.num_parameters()


def test_scheduler_partial_is_stepped_per_optimizer_step():
    model = tiny(optimizer=functools.partial(torch.optim.SGD, lr=1.0),
                 scheduler=functools.partial(warmup_cosine, warmup_steps=2, total_steps=10))
    configured = model.configure_optimizers()
    assert configured["lr_scheduler"]["interval"] == "step"
    assert configured["optimizer"].param_groups[0]["lr"] == pytest.approx(0.5)  # step 0 of a 2-step warm-up


def test_missing_optimizer_says_what_to_pass():
    with pytest.raises(ValueError, match="optimizer=adamw"):
        tiny().configure_optimizers()


def test_warmup_cosine_follows_the_formula():
    w, total, floor = 10, 110, 0.1
    assert warmup_cosine_factor(0, w, total, floor) == pytest.approx(0.1)
    assert warmup_cosine_factor(9, w, total, floor) == pytest.approx(1.0)
    assert warmup_cosine_factor(10, w, total, floor) == pytest.approx(1.0)
    assert warmup_cosine_factor(60, w, total, floor) == pytest.approx(floor + (1 - floor) * 0.5)  # half-way: cos=0
    assert warmup_cosine_factor(110, w, total, floor) == pytest.approx(floor)
    assert warmup_cosine_factor(500, w, total, floor) == pytest.approx(floor)


def test_warmup_cosine_rejects_bad_arguments():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="total_steps=0"):
        warmup_cosine(opt, total_steps=0)
