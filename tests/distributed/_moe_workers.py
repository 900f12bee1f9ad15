"""A transformers mixture-of-experts LightningModule and the process body of the 2-process MoE strategy tests
(importable by spawned children)."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from fp8_lightning.testing import end_worker, markov_tokens

STEPS, ROWS = 4, 16  # optimizer steps, global batch


def make_module():
    import lightning.pytorch as pl

    from tests.helpers.moe import tiny_moe

    class MoELM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_moe("qwen3_moe")
            self.losses: list[torch.Tensor] = []

        def training_step(self, batch, batch_idx):
            (seq,) = batch
            loss = self.model(input_ids=seq, labels=seq).loss
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    return MoELM()


def loader(rank: int | None) -> DataLoader:
    """This rank's half of each global batch (the whole batch when ``rank`` is None)."""
    seq = markov_tokens(STEPS * ROWS)
    if rank is not None:
        seq = torch.cat([chunk.chunk(2)[rank] for chunk in seq.split(ROWS)])
    return DataLoader(TensorDataset(seq), batch_size=ROWS if rank is None else ROWS // 2)


def fit(module, strategy, devices: int, rank: int | None, recipe: str = "delayed", layers: dict | None = None):
    import lightning.pytorch as pl

    from fp8_lightning import FP8Precision

    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, plugins=[FP8Precision(recipe=recipe, layers=layers)],
        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(module, loader(rank))
    return trainer


def experts_of(module) -> dict:
    return {name: m for name, m in module.named_modules() if name.endswith("mlp.experts")}


def moe_strategy_worker(rank: int, world: int, port: int, out: dict) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world)
    )
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    res = {}
    for strategy in ("fp8_ddp", "fp8_fsdp"):
        module = make_module()
        trainer = fit(module, strategy, 2, rank)
        losses = torch.stack(module.losses)
        dist.all_reduce(losses)
        res[strategy] = (losses / 2).tolist()
        res[f"{strategy}_experts"] = sorted(trainer.precision_plugin.conversion_report.experts)
        res[f"{strategy}_gemms"] = [dict(m.fp8_gemm_counts) for m in experts_of(module).values()]
        res[f"{strategy}_steps"] = trainer.precision_plugin.optimizer_steps
        gathers = getattr(trainer.strategy, "all_gather_report", None)
        res[f"{strategy}_gathered_high_precision"] = dict(gathers.high_precision) if gathers else None
        res[f"{strategy}_gathered_fp8"] = list(gathers.fp8) if gathers else None
    if rank == 0:
        out.update(res)
    end_worker()
