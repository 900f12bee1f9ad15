"""Process body of the 2-process tests of ``torch.compile`` over FSDP2 with FP8 all-gather (importable by spawned
children): each model trained the same steps eagerly and compiled, on the same data, every recipe."""

from __future__ import annotations

import torch
import torch.nn as nn

from fp8_lightning import GroupedExperts, convert_to_fp8, fp8_autocast
from fp8_lightning.distributed import enable_fp8_all_gather, shard_model
from fp8_lightning.testing import end_worker, init_gloo
from tests.helpers.distributed_steps import finish_step
from tests.helpers.moe import VOCAB, tiny_moe

RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise", "mxfp8", "nvfp4")
STEPS, TOKENS, DIM = 3, 32, 128
OFFS = (8, 8, 20, 32)  # per-expert group ends; expert 1 gets no token


class HandMoE(nn.Module):
    """A linear layer into GroupedExperts (torchtitan's layout: weights (E, H, D) and (E, D, H))."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.experts = GroupedExperts(DIM, DIM, len(OFFS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(self.inp(x), torch.tensor(OFFS, dtype=torch.int32))


def _model(kind: str) -> tuple[nn.Module, callable]:
    """(model, loss of a batch index) of ``kind``: "mlp", "narrow_mlp" (64 wide), "hand_moe" or "qwen3_moe"
    (transformers' fused experts)."""
    torch.manual_seed(0)
    if kind == "qwen3_moe":
        model = tiny_moe("qwen3_moe")
        ids = torch.randint(0, VOCAB, (STEPS, 2, 16), generator=torch.Generator().manual_seed(1))
        return model, lambda run, step: run(input_ids=ids[step], labels=ids[step]).loss
    dim = DIM // 2 if kind == "narrow_mlp" else DIM
    model = HandMoE() if kind == "hand_moe" else nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(),
                                                               nn.Linear(2 * dim, dim))
    xs = torch.randn(STEPS, TOKENS, dim, generator=torch.Generator().manual_seed(1))
    return model, lambda run, step: run(xs[step]).square().mean()


USES = {"operands": 0}  # the FP8 operands taken from gathered weights, counted (see count_gathered_uses)


def count_gathered_uses() -> None:
    """Count each use of a gathered weight's FP8 operands (linear layers and experts): a compiled step that traced
    the layer instead would cast the gathered weight again and take none."""
    from fp8_lightning.distributed.expert_weight import FP8GatheredExperts
    from fp8_lightning.distributed.weight import FP8GatheredWeight

    for cls, name in ((FP8GatheredWeight, "fp8_weight_operands"), (FP8GatheredExperts, "fp8_expert_operands")):
        def counted(self, *args, _method=getattr(cls, name), **kwargs):
            USES["operands"] += 1
            return _method(self, *args, **kwargs)

        setattr(cls, name, counted)


def train(kind: str, recipe: str, world: int, compiled: bool) -> dict:
    """Losses and last gradients of ``STEPS`` steps, the weights gathered in FP8 and the uses of their operands."""
    USES["operands"] = 0
    model, loss_of = _model(kind)
    convert_to_fp8(model, recipe)
    report = enable_fp8_all_gather(model, world)
    shard_model(model)
    run = torch.compile(model, backend="aot_eager") if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], {}
    for step in range(STEPS):
        with fp8_autocast():
            loss = loss_of(run, step)
        loss.backward()
        grads = {name: p.grad.full_tensor().clone() for name, p in model.named_parameters() if p.grad is not None}
        losses.append(finish_step(model, opt, loss))
    return {"losses": losses, "grads": grads, "gathered": list(report.fp8), "uses": USES["operands"]}


def compile_worker(rank: int, world: int, port: int, out: dict, kinds: tuple[str, ...]) -> None:
    init_gloo(rank, world, port)
    count_gathered_uses()
    results = {}
    for kind in kinds:
        for recipe in RECIPES:
            try:
                compiled = train(kind, recipe, world, True)  # first: an eager run first hid the linear layers' failure
                results[kind, recipe] = {"compiled": compiled, "eager": train(kind, recipe, world, False)}
            except Exception as error:  # reported to the test, which names it
                results[kind, recipe] = {"error": f"{type(error).__name__}: {str(error)[:2000]}"}
    if rank == 0:
        out.update(results)
    end_worker()
