"""LightningModules and the process body of the 2-process FP8FSDPStrategy tests (importable by spawned children)."""

from __future__ import annotations

import functools
import os
import warnings

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from tests.distributed._workers import Net, batches
from fp8_lightning.testing import end_worker

ROWS = 64  # global batch


def make_module(configure: bool = False, momentum: float = 0.9):
    import lightning.pytorch as pl

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = Net()
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = ((self.net(x) - y) ** 2).mean()
            self.losses.append(loss.detach().clone())
            return loss

        def train_dataloader(self):
            return loader(self.train_steps)

        def configure_optimizers(self):  # runs inside the strategy's setup
            self.hook_added_by_strategy = "configure_model" in vars(self)
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=momentum)

    class UserSharded(Lit):
        def configure_model(self):
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.net.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    return UserSharded() if configure else Lit()


def loader(steps: int) -> DataLoader:
    """This rank's half of each global batch (the same split as the plain FSDP2 tests)."""
    rank = dist.get_rank()
    data = [(x.chunk(2)[rank], y.chunk(2)[rank]) for x, y in batches(steps, ROWS)]
    return DataLoader(TensorDataset(torch.cat([d[0] for d in data]), torch.cat([d[1] for d in data])), batch_size=ROWS // 2)


def fit(module, strategy, recipe="delayed", steps_per_epoch=2, epochs=2, ckpt_path=None, accumulate=1):
    import lightning.pytorch as pl

    from fp8_lightning import FP8Precision

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        plugins=[FP8Precision(recipe=recipe)],
        max_epochs=epochs,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    module.train_steps = steps_per_epoch * accumulate
    trainer.fit(module, ckpt_path=ckpt_path)
    losses = torch.stack(module.losses)
    dist.all_reduce(losses)
    return trainer, (losses / 2).tolist()


def strategy_worker(rank: int, world: int, port: int, tmpdir: str, out: dict) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world)
    )
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from fp8_lightning.distributed import FP8GatheredWeight, weight_amax_reductions
    from fp8_lightning.lightning.fsdp import FP8FSDPStrategy

    res = {}
    # A: default policy (no configure_model), uninterrupted 2 epochs x 2 steps
    module = make_module()
    trainer, res["default"] = fit(module, FP8FSDPStrategy())
    strategy = trainer.strategy
    res["default_report"] = (len(strategy.all_gather_report.fp8), len(strategy.all_gather_report.high_precision))
    res["default_amax_reductions"] = weight_amax_reductions(module)
    res["default_sharded_blocks"] = sum(type(m).__name__.startswith("FSDP") for m in module.modules())
    res["default_hook_added"] = module.hook_added_by_strategy

    # B: stop after epoch 1, save a sharded checkpoint, resume in a fresh module and trainer
    path = os.path.join(tmpdir, "ckpt")
    first = make_module()
    trainer, losses_1 = fit(first, FP8FSDPStrategy(), epochs=1)
    trainer.save_checkpoint(path)
    dist.barrier()
    resumed = make_module()
    _, losses_2 = fit(resumed, FP8FSDPStrategy(), epochs=2, ckpt_path=path)
    res["resume"] = losses_1 + losses_2
    if rank == 0:
        meta = torch.load(os.path.join(path, "meta.pt"), weights_only=False)
        res["ckpt_files"] = sorted(os.listdir(path))
        res["ckpt_fp8_state"] = sorted(meta.get("FP8Precision", {}).get("modules", [{}])[0])

    # C: a user's configure_model that shards by itself
    module = make_module(configure=True)
    trainer, res["user"] = fit(module, "fp8_fsdp")
    res["user_report"] = (len(trainer.strategy.all_gather_report.fp8), len(trainer.strategy.all_gather_report.high_precision))

    # D: gradient accumulation, with and without activation checkpointing (recomputed in FP8)
    seen = []
    original = FP8GatheredWeight.fp8_weight_operands

    def spy(self, scaling, record, **kwargs):
        seen.append(1)
        return original(self, scaling, record, **kwargs)

    FP8GatheredWeight.fp8_weight_operands = spy
    module = make_module()
    _, res["accum"] = fit(module, FP8FSDPStrategy(), recipe="tensorwise", accumulate=2, epochs=1)
    res["accum_amax_reductions"] = weight_amax_reductions(module)
    res["accum_fp8_weight_uses"] = len(seen)
    seen.clear()
    module = make_module()
    _, res["accum_ac"] = fit(module, FP8FSDPStrategy(activation_checkpointing=True), recipe="tensorwise", accumulate=2, epochs=1)
    res["accum_ac_fp8_weight_uses"] = len(seen)
    FP8GatheredWeight.fp8_weight_operands = original

    # E: high-precision all-gather, bf16 gradient reduce-scatter, MXFP8
    module = make_module()
    _, res["hp_bf16"] = fit(module, FP8FSDPStrategy(fp8_all_gather=False, reduce_dtype="bf16"), recipe="mxfp8")
    res["hp_bf16_fp8_gathers"] = sum(isinstance(p._local_tensor, torch.Tensor) and type(p._local_tensor).__name__ == "FP8ShardedWeight" for p in module.parameters())
    module = make_module()
    _, res["mx"] = fit(module, FP8FSDPStrategy(), recipe="mxfp8")

    # F: the project's GPT (tied embedding/head, layers directly on the LightningModule) by the strategy string,
    # with no FP8 precision given: the strategy installs FP8Precision(recipe) itself
    res.update(fit_gpt())
    res["conv1d_reasons"] = conv1d_gather_reasons()
    if rank == 0:
        out.update(res)
    end_worker()


def fit_gpt() -> dict:
    import lightning.pytorch as pl

    from fp8_lightning.lightning.precision import FP8Precision
    from fp8_lightning.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(functools.partial(torch.optim.AdamW, lr=1e-3), vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64)
    tokens = torch.randint(0, 256, (16, 33), generator=torch.Generator().manual_seed(3))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="fp8_fsdp", max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, data)
    report = trainer.strategy.all_gather_report
    return {
        "gpt_plugin": isinstance(trainer.precision_plugin, FP8Precision),
        "gpt_fp8_weights": len(report.fp8),
        "gpt_high_precision": dict(report.high_precision),
        "gpt_root_sharded": type(model).__name__.startswith("FSDP"),
        "gpt_loss": float(trainer.callback_metrics["train/loss"]),
    }


def conv1d_gather_reasons() -> list[str] | None:
    """Why a transformers Conv1D weight gathers in high precision, asked before and after ``fully_shard`` (the
    strategy asks both times; the second answer is the one it reports). None without transformers."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    from torch.distributed.fsdp import fully_shard

    from fp8_lightning import convert_to_fp8, recipe_from
    from fp8_lightning.distributed import enable_fp8_all_gather

    model = torch.nn.Sequential(Conv1D(64, 64))
    convert_to_fp8(model, recipe_from("tensorwise"))
    before = enable_fp8_all_gather(model, 2).high_precision
    fully_shard(model)
    after = enable_fp8_all_gather(model, 2).high_precision
    return [before["0"], after["0"]]
