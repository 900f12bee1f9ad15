"""Run by test_ddp.py: 2-process DDP on CPU (gloo) through Lightning's own launcher, FP8 hybrid precision
(``precision="fp8-hybrid"``, or with ``guard`` as 2nd argument the plugin route with the divergence guard on).

Lightning re-launches this script for rank 1. Each rank saves its final parameters, FP8 scaling state and the
per-step amax of one layer's input as it saw it locally (before any reduction) to ``<out>/rank<r>.pt``.
"""

import sys

import lightning as L
import torch

import fp8_lightning  # noqa: F401  (registers precision="fp8-hybrid")
from fp8_lightning import FP8Precision, FP8StatsMonitor, fp8_state_dict
from fp8_lightning.lightning.strings import PRECISION_RECIPES
from tests.lightning.user_model import TinyTransformerLM, loader, trainer_kwargs


def main(out: str, guard: bool, steps: int = 4) -> None:
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    model = TinyTransformerLM()
    local_amax: dict[int, float] = {}

    def record(module, args):
        if module.training:
            step = model.trainer.global_step
            local_amax[step] = max(local_amax.get(step, 0.0), args[0].detach().abs().amax().float().item())

    model.blocks[0].fc1.register_forward_pre_hook(record)
    if guard:
        precision = dict(plugins=[FP8Precision(recipe=PRECISION_RECIPES["fp8-hybrid"], divergence_guard=True)])
    else:
        precision = dict(precision="fp8-hybrid")
    monitor = FP8StatsMonitor(log_every_n_steps=1, print_summary=False)
    kwargs = trainer_kwargs(strategy="ddp", devices=2, callbacks=[monitor], **precision)
    trainer = L.Trainer(max_steps=steps, **kwargs)
    trainer.fit(model, loader(n=256))
    torch.save(
        {
            "rank": trainer.global_rank,
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "fp8": fp8_state_dict(model),
            "local_amax": [local_amax[s] for s in range(steps)],
            "losses": model.losses,
            "precision": trainer.precision,
            "guard": trainer.precision_plugin.guard_state.state_dict() if guard else None,
            "monitor": {f"{k[0]}/{k[1]}": (r.max_overflow, r.max_underflow) for k, r in monitor.rows.items()},
        },
        f"{out}/rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main(sys.argv[1], guard=sys.argv[2:] == ["guard"])
