"""LightningModules and process bodies of the tensor-parallel tests (importable by spawned children).

Three models, sized so that every recipe's scale blocks fit a rank's shard under TP=2 (blockwise needs 128): the
project's GPT (``fused_qkv=False``), and random-init transformers Llama and Qwen3 (2 layers, per-head q/k norms),
both with grouped-query attention and split by their own ``base_model_tp_plan``. Each trains a few SGD steps on a
fixed global batch; :func:`fit` returns the per-step losses (averaged over the data-parallel replicas) and every
rank's FP8 scaling state. A wider GPT (:data:`RESUME_SIZE`) resumes checkpoints under TP=4.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from fp8_lightning.testing import markov_tokens

RECIPES = ("delayed", "tensorwise", "rowwise", "blockwise", "mxfp8")
STEPS, ROWS, SEQ, VOCAB, LR = 3, 8, 32, 256, 0.5
GPT_SIZE = dict(vocab_size=VOCAB, block_size=SEQ, n_layer=1, n_head=2, n_embd=256, mlp_ratio=2, fused_qkv=False)
LLAMA_SIZE = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=128, max_position_embeddings=SEQ)
# Qwen3: per-head q_norm / k_norm (replicated_with_grad_allreduce in its plan); TP=2 gives each rank 2 of the 4 query
# heads and 1 of the 2 key/value heads, and shards of 256 (q), 128 (k, v, MLP) and 256 / 128 input features (o, down)
QWEN3_SIZE = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=128, max_position_embeddings=SEQ)


def tokens(rows: int, seed: int) -> torch.Tensor:
    """Learnable sequences (a fixed Markov chain over 64 of the 256 ids), SEQ + 1 long."""
    return markov_tokens(rows, seed)


def train_loader(dp_rank: int = 0, dp: int = 1) -> DataLoader:
    """This data-parallel rank's share of each global batch of ROWS sequences (all of it for dp=1)."""
    data = tokens(STEPS * ROWS, seed=3).view(STEPS, dp, ROWS // dp, SEQ + 1)[:, dp_rank].flatten(0, 1)
    return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=ROWS // dp)


HELD_OUT = tokens(ROWS, seed=7)


def make_gpt(lr: float = LR, **size):
    from fp8_lightning.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(functools.partial(torch.optim.SGD, lr=lr), **{**GPT_SIZE, **size})
    model.step_losses, model.step_batches = [], []
    return model


def make_causal_lm(config: str, model: str, size: dict):
    """A random-init transformers causal LM (``transformers.<config>(**size)``, ``transformers.<model>``) as a
    LightningModule whose ``configure_model`` splits it by
    :func:`~fp8_lightning.distributed.tp_plans.transformers_tp_plan` on a tensor-parallel mesh of over one rank."""
    import lightning.pytorch as pl
    import transformers

    class CausalLM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            cfg = getattr(transformers, config)(**size, attn_implementation="sdpa")
            self.model = getattr(transformers, model)(cfg)
            self.step_losses, self.step_batches = [], []

        def forward(self, idx):
            return self.model(input_ids=idx).logits

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self(x).float().flatten(0, 1), y.flatten())
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

        def configure_model(self):
            from torch.distributed.tensor.parallel import parallelize_module

            from fp8_lightning.distributed.tp_plans import transformers_tp_plan

            mesh = self.device_mesh
            if mesh is not None and mesh["tensor_parallel"].size() > 1:
                tp = mesh["tensor_parallel"]
                parallelize_module(self.model, tp, transformers_tp_plan(self.model, tp.size()))

    return CausalLM()


make_llama = functools.partial(make_causal_lm, "LlamaConfig", "LlamaForCausalLM", LLAMA_SIZE)
make_qwen3 = functools.partial(make_causal_lm, "Qwen3Config", "Qwen3ForCausalLM", QWEN3_SIZE)


MODELS = {"gpt": make_gpt, "llama": make_llama, "qwen3": make_qwen3}
# a GPT whose every split keeps whole scale blocks at TP=4 too (blockwise: 512 / 4 = 128 features a shard)
RESUME_SIZE = dict(n_embd=512, n_head=4, lr=0.1)  # lr: 6 steps that keep falling at this width
FACTORIES = {**MODELS, "gpt_resume": functools.partial(make_gpt, **RESUME_SIZE),
             "gpt_resume_2_layers": functools.partial(make_gpt, **RESUME_SIZE, n_layer=2)}


class RecordLoss:
    """A callback that keeps each training step's loss on the module (the logged value, this rank's) and a checksum
    of the batch it trained on (which data-parallel replica's share it was)."""

    def __new__(cls):
        import lightning.pytorch as pl

        class _Record(pl.Callback):
            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
                module.step_losses.append(float(outputs["loss"]))
                module.step_batches.append(int(batch[0].sum()))

        return _Record()


def held_out_loss(module) -> float:
    from fp8_lightning import fp8_autocast

    module.eval()
    with torch.no_grad(), fp8_autocast():
        logits = module(HELD_OUT[:, :-1])
    return float(F.cross_entropy(logits.float().flatten(0, 1), HELD_OUT[:, 1:].flatten()))


def fit(kind: str, recipe: str, strategy, devices: int, dp: int = 1, rank: int = 0, epochs: int | None = None,
        ckpt_path: str | None = None, callbacks=(), precision_kwargs: dict | None = None):
    """Train ``kind`` under ``recipe`` as global rank ``rank``: STEPS steps, or up to the end of epoch ``epochs`` (of
    STEPS batches), resuming from ``ckpt_path`` when given; returns (module, trainer, losses of the steps it trained).

    A resumed run counts epochs: Lightning 2.6, resuming a run that stopped at ``max_steps`` on the last batch of an
    epoch with a larger ``max_steps``, trains the first batch of the epoch twice.

    The rank is the caller's (the spawned process index): the process group does not exist before the first
    ``trainer.fit`` of a process, so it cannot be asked here, and asking would give every rank of a first run
    data-parallel replica 0's batches.
    """
    import lightning.pytorch as pl

    from fp8_lightning import FP8Precision

    module = FACTORIES[kind]()
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy,
        plugins=[FP8Precision(recipe=recipe, **(precision_kwargs or {}))], max_steps=-1 if epochs else STEPS,
        max_epochs=epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[RecordLoss(), *callbacks], num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    # ranks are (data_parallel, tensor_parallel)
    trainer.fit(module, train_loader(rank // (devices // dp), dp), ckpt_path=ckpt_path)
    return module, trainer, module.step_losses


def single_process_losses(kinds=("gpt", "llama"), recipes=RECIPES, epochs: int | None = None) -> dict:
    """The reference: one process, the whole global batch per step (STEPS steps, or ``epochs`` epochs)."""
    out = {}
    for kind in kinds:
        for recipe in recipes:
            module, _, out[kind, recipe] = fit(kind, recipe, "auto", 1, epochs=epochs)
            out["head_norms", kind, recipe] = head_norms(module)
    return out


def head_norms(module) -> dict:
    """The weights of the norms that see only a rank's heads under TP (Qwen3's q_norm and k_norm), whole (a
    collective where they are DTensors)."""
    from torch.distributed.tensor import DTensor

    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in module.named_parameters() if name.endswith(("q_norm.weight", "k_norm.weight"))}


def same_state(a, b) -> bool:
    """Two FP8 scaling states (nested dicts of tensors) hold equal values."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.shape == b.shape and bool(torch.equal(a, b))
    return bool(a == b)


def tp_worker(rank: int, world: int, port: int, tmpdir: str, out: dict) -> None:
    """TP=2 (2 processes: ModelParallelStrategy) or TP=2 x DP=2 (4 processes: fp8_fsdp along DP), every recipe and
    every model of :data:`MODELS`; then a distributed checkpoint of the GPT."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0",
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from lightning.pytorch.strategies import ModelParallelStrategy

    from fp8_lightning.saved_state import fp8_state_dict
    from fp8_lightning.lightning.fsdp import FP8FSDPStrategy
    from fp8_lightning.testing import end_worker

    dp = world // 2

    def strategy():
        if dp == 1:
            return ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)
        return FP8FSDPStrategy(data_parallel_size=dp, tensor_parallel_size=2)

    res = {}
    for kind in MODELS:
        for recipe in RECIPES:
            try:
                module, trainer, losses = fit(kind, recipe, strategy(), world, dp, rank)
            except ValueError as err:  # refused at set-up
                res[kind, recipe] = {"error": str(err)}
                continue
            mean = torch.tensor(losses)
            dist.all_reduce(mean)
            states, fed = [None] * world, [None] * world
            dist.all_gather_object(states, fp8_state_dict(module))
            planned = [int(x.sum()) for x, _ in train_loader(dist.get_rank() // 2, dp)]  # the process group's rank
            dist.all_gather_object(fed, module.step_batches == planned)
            tp_peers = [states[r] for r in range(world) if r // 2 == rank // 2]  # this rank's tensor-parallel group
            report = getattr(trainer.strategy, "all_gather_report", None)
            res[kind, recipe] = {"losses": (mean / world).tolist(), "tp_states_equal": same_state(*tp_peers),
                                 "fp8_gathered": None if report is None else sorted(report.fp8),
                                 "all_states_equal": all(same_state(states[0], s) for s in states),
                                 "data_as_planned": all(fed), "head_norms": head_norms(module)}
    recipe = "delayed" if dp == 1 else "rowwise"
    module, trainer, _ = fit("gpt", recipe, strategy(), world, dp, rank)
    path = os.path.join(tmpdir, f"ckpt{world}")
    trainer.save_checkpoint(path)
    res["ckpt"] = {"path": path, "recipe": recipe, "held_out": held_out_loss(module), "state": fp8_state_dict(module)}
    if rank == 0:
        out.update(res)
    end_worker()


def full_weights(module) -> dict:
    """The module's parameters and buffers as whole tensors (DTensors gathered: a collective on every rank)."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in module.state_dict().items()}


class AtTrainStart:
    """A callback that keeps what a resumed run starts from (after Lightning restored the checkpoint): the FP8
    scaling state, the whole weights, the global step and the plugin's optimizer-step count."""

    def __new__(cls):
        import lightning.pytorch as pl

        from fp8_lightning.saved_state import fp8_state_dict

        class _Start(pl.Callback):
            def on_train_start(self, trainer, module):
                module.start = {"state": fp8_state_dict(module), "weights": full_weights(module),
                                "global_step": trainer.global_step,
                                "optimizer_steps": trainer.precision_plugin.optimizer_steps}

        return _Start()


def _gradient_operands(state: dict):
    for layer, entry in state.items():
        for scaling in entry["scalings"]:
            if "grad_output" in scaling.get("operands", {}):
                yield layer, scaling["operands"]["grad_output"]


def gradient_restarts(start: dict, saved: dict) -> list[str]:
    """The layers whose saved output-gradient scale was set and is made afresh by the resumed run (see
    :func:`~fp8_lightning.saved_state.restart_gradient_scales`)."""
    was = {layer for layer, op in _gradient_operands(saved) if op["initialized"]}
    return sorted({layer for layer, op in _gradient_operands(start) if not op["initialized"]} & was)


def without_gradient_flags(state: dict) -> dict:
    """``state`` without the output gradients' ``initialized`` flags (every tensor kept)."""
    import copy

    state = copy.deepcopy(state)
    for _, op in _gradient_operands(state):
        del op["initialized"]
    return state


RESUME_TARGETS = {"tp4": (4, 1), "tp1_dp4": (1, 4)}  # (tensor_parallel_size, data_parallel_size) on 4 processes


def keep_lm_head_high(module, name: str) -> bool:
    """A module filter that leaves the LM head unconverted (so the model holds one FP8 layer fewer)."""
    return name != "lm_head"


def resume_worker(rank: int, world: int, port: int, tmpdir: str, out: dict) -> None:
    """4 processes: for every recipe, train the GPT 3 steps (one epoch) under TP=2 x DP=2 (``fp8_fsdp`` along DP) and
    save a distributed checkpoint; resume it for one more epoch under each of :data:`RESUME_TARGETS`. Reports the
    losses of both legs, whether each resumed run started from the saved weights and from the checkpoint's scaling
    state on every rank, and the errors of resumes into models that differ from the checkpoint (strict loading)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0",
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.checkpoint.api import CheckpointException

    from fp8_lightning.saved_state import fp8_state_dict
    from fp8_lightning.lightning.fsdp import FP8FSDPStrategy
    from fp8_lightning.testing import end_worker

    def strategy(tp: int, dp: int):
        if dp == 1:
            return ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=tp)
        return FP8FSDPStrategy(data_parallel_size=dp, tensor_parallel_size=tp)

    def mean(losses):
        t = torch.tensor(losses)
        dist.all_reduce(t)
        return (t / world).tolist()

    def on_every_rank(flag: bool) -> bool:
        flags = [None] * world
        dist.all_gather_object(flags, flag)
        return all(flags)

    res, paths = {}, {}
    for recipe in RECIPES:
        module, trainer, losses = fit("gpt_resume", recipe, strategy(2, 2), world, 2, rank)
        paths[recipe] = path = os.path.join(tmpdir, f"ckpt_{recipe}")
        trainer.save_checkpoint(path)
        weights = full_weights(module)
        saved = [None] * world  # the checkpoint holds rank 0's (ranks differ only in their last local amaxes)
        dist.all_gather_object(saved, fp8_state_dict(module))
        res[recipe] = {"losses": mean(losses), "state": saved[0], "tp_states_equal": same_state(saved[0], saved[1])}
        for target, (tp, dp) in RESUME_TARGETS.items():
            try:
                module, trainer, losses = fit("gpt_resume", recipe, strategy(tp, dp), world, dp, rank, epochs=2,
                                              ckpt_path=path, callbacks=[AtTrainStart()])
            except ValueError as err:  # refused at set-up
                res[recipe, target] = {"error": str(err)}
                continue
            start = module.start
            planned = [int(x.sum()) for x, _ in train_loader(dist.get_rank() // tp, dp)]
            res[recipe, target] = {
                "losses": mean(losses),
                "state_restored": on_every_rank(same_state(*map(without_gradient_flags, (start["state"], saved[0])))),
                "gradient_restarts": gradient_restarts(start["state"], saved[0]),
                "weights_restored": on_every_rank(start["weights"].keys() == weights.keys() and all(
                    torch.equal(start["weights"][k], v) for k, v in weights.items())),
                "global_step": start["global_step"], "optimizer_steps": start["optimizer_steps"],
                "data_as_planned": on_every_rank(module.step_batches == planned),
            }
    for case, kind, kwargs in [("fp8_layers_differ", "gpt_resume", {"module_filter_fn": keep_lm_head_high}),
                               ("weights_differ", "gpt_resume_2_layers", {})]:
        try:
            fit(kind, "delayed", strategy(4, 1), world, 1, rank, epochs=2, ckpt_path=paths["delayed"],
                precision_kwargs=kwargs)
            res[case] = "loaded"
        except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
            res[case] = f"{type(err).__name__}: {err}"
    if rank == 0:
        out.update(res)
    end_worker()
