"""The process body of the 2-process NVFP4 FP8FSDPStrategy test (importable by spawned children): a model mixing
NVFP4 and MXFP8 layers trained through ``Trainer(strategy=FP8FSDPStrategy(fp8_reduce_scatter=True))`` with FP8
optimizer states, checkpointed after epoch 1 and resumed."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

from fp8_lightning.testing import end_worker
from tests.distributed._lightning_workers import loader
from tests.distributed._workers import Net

LAYERS = {"last": 0, "net.blocks.0.up": "mxfp8"}  # NVFP4 everywhere but one MXFP8 layer, no high-precision tail


def make_module(fp8_optimizer: bool = True):
    import lightning.pytorch as pl

    from fp8_lightning.optim import fp8_adamw

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = Net()
            self.losses: list[torch.Tensor] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = ((self.net(x) - y) ** 2).mean()
            self.losses.append(loss.detach().clone())
            return loss

        def train_dataloader(self):
            return loader(2)

        def configure_optimizers(self):
            if fp8_optimizer:
                return fp8_adamw(self.parameters(), lr=1e-2)
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return Lit()


def fit(strategy, epochs: int, ckpt_path=None, fp8_optimizer: bool = True):
    import lightning.pytorch as pl

    from fp8_lightning import FP8Precision

    module = make_module(fp8_optimizer)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, plugins=[FP8Precision(recipe="nvfp4", layers=LAYERS)],
        max_epochs=epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    losses = torch.stack(module.losses)
    dist.all_reduce(losses)
    return module, trainer, (losses / 2).tolist()


def moe_run(rank: int | None, strategy="fp8_fsdp", devices: int = 2) -> dict:
    """transformers' Qwen3-MoE with every linear layer and expert module in NVFP4 (no high-precision tail), 4 SGD
    steps: its losses (mean over ranks), converted experts and their grouped GEMM counts."""
    from tests.distributed._moe_workers import experts_of, fit as moe_fit, make_module as moe_module

    module = moe_module()
    trainer = moe_fit(module, strategy, devices, rank, recipe="nvfp4", layers={"last": 0})
    losses = torch.stack(module.losses)
    if rank is not None:
        dist.all_reduce(losses)
        losses /= 2
    gathers = getattr(trainer.strategy, "all_gather_report", None)
    return {
        "moe_gathered_experts": sorted(n for n in gathers.fp8 if ".mlp.experts." in n) if gathers else [],
        "moe": losses.tolist(),
        "moe_experts": sorted(trainer.precision_plugin.conversion_report.experts),
        "moe_gemms": [dict(m.fp8_gemm_counts) for m in experts_of(module).values()],
    }


def nvfp4_strategy_worker(rank: int, world: int, port: int, tmpdir: str, out: dict) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world)
    )
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from fp8_lightning.distributed import weight_amax_reductions
    from fp8_lightning.lightning.fsdp import FP8FSDPStrategy

    def strategy(**kwargs):
        return FP8FSDPStrategy(fp8_reduce_scatter=True, **kwargs)

    res = {}
    module, trainer, res["fp8"] = fit(strategy(), epochs=2)
    res["report"] = (sorted(trainer.strategy.all_gather_report.fp8), dict(trainer.strategy.all_gather_report.high_precision))
    res["recipes"] = {name: m.fp8_recipe.name for name, m in module.named_modules() if hasattr(m, "fp8_recipe")}
    res["amax_reductions"] = weight_amax_reductions(module)
    _, _, res["hp_gather"] = fit(strategy(fp8_all_gather=False), epochs=2)

    for optimizer, fp8_optimizer in (("fp8_adamw", True), ("adamw", False)):
        path = os.path.join(tmpdir, optimizer)
        if not fp8_optimizer:
            _, _, res["adamw"] = fit(strategy(), epochs=2, fp8_optimizer=False)
        _, trainer, first = fit(strategy(), epochs=1, fp8_optimizer=fp8_optimizer)
        trainer.save_checkpoint(path)
        dist.barrier()
        resumed, _, second = fit(strategy(), epochs=2, ckpt_path=path, fp8_optimizer=fp8_optimizer)
        res[f"resume_{optimizer}"] = first + second
        res[f"resumed_sr_casts_{optimizer}"] = int(resumed.net.blocks[1].up.fp8_scaling().operands["grad_output"].sr_casts)
    res.update(moe_run(rank))
    if rank == 0:
        meta = torch.load(os.path.join(tmpdir, "adamw", "meta.pt"), weights_only=False)
        res["ckpt_fp8_state"] = sorted(meta.get("FP8Precision", {}).get("modules", [{}])[0])
        out.update(res)
    end_worker()


TP_KINDS = ("gpt", "qwen3")  # the project's GPT and transformers' Qwen3, every linear layer in NVFP4
NVFP4_EVERYWHERE = {"layers": {"last": 0}}
NVFP4_RTN = {"name": "nvfp4", "disable_stochastic_rounding": True}  # rounding noise keyed by rank left out


def tp_fsdp_worker(rank: int, world: int, port: int, out: dict) -> None:
    """TP=2 x DP=2 (4 processes, ``fp8_fsdp`` along DP): each rank's part of a split NVFP4 weight all-gathers as
    codes and block scales along DP, its global scale agreed over both groups."""
    import tests.distributed._tp_workers as tp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0",
                      WORLD_SIZE=str(world))  # fmt: skip
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from fp8_lightning.saved_state import fp8_state_dict
    from fp8_lightning.lightning.fsdp import FP8FSDPStrategy

    res = {}
    for kind in TP_KINDS:
        strategy = FP8FSDPStrategy(data_parallel_size=2, tensor_parallel_size=2)
        module, trainer, losses = tp.fit(kind, NVFP4_RTN, strategy, world, 2, rank, precision_kwargs=NVFP4_EVERYWHERE)
        mean = torch.tensor(losses)
        dist.all_reduce(mean)
        states = [None] * world
        dist.all_gather_object(states, fp8_state_dict(module))
        tp_peers = [states[r] for r in range(world) if r // 2 == rank // 2]
        report = trainer.strategy.all_gather_report
        res[kind] = {"losses": (mean / world).tolist(), "tp_states_equal": tp.same_state(*tp_peers),
                     "fp8_gathered": sorted(report.fp8), "high_precision": dict(report.high_precision)}
    if rank == 0:
        out.update(res)
    end_worker()
