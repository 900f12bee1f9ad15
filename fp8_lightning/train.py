"""``fp8-train`` (also ``python -m fp8_lightning.train``): the Hydra front door of the project.

One command trains a GPT under any precision and prints what happened::

    fp8-train                                           # tiny GPT, stdlib bytes, fp8-hybrid, CPU
    fp8-train precision=fp8_mxfp8 model.n_layer=4 trainer.max_steps=50
    fp8-train precision=fp8_hybrid precision.recipe.amax_history_len=32 precision.recipe.margin=1
    fp8-train experiment=gpt_small_gpu precision=fp8_tensorwise
    fp8-train -m precision=fp32,bf16_mixed,fp8_hybrid    # a sweep (or: fp8-compare)

Design:

* Configs live in ``conf/`` (one group per concern). A checkout uses its ``conf/`` folder, so edits show up
  at once; an installed wheel uses the same files packaged as ``fp8_lightning.conf``.
* The precision group decides between Lightning's own flag (``precision.lightning``: ``32-true``,
  ``bf16-mixed``) and the FP8 plugin (``precision.plugin``, built from the recipe fields in
  ``precision.recipe``). Nothing FP8-specific exists in the model or the data modules.
* Bad configuration fails before any work starts, with the offending key, what is allowed and how to fix it,
  and exit status 2 (:class:`ConfigError`); unknown group options and keys are rejected by Hydra itself.
* The closing summary (validation loss and perplexity, tokens/s, peak memory, converted and skipped layers,
  checkpoint path) is printed and written to ``summary.json`` in the run folder, which ``fp8-compare`` reads.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import resource
import time

import hydra
import lightning.pytorch as pl
import torch
from omegaconf import DictConfig, OmegaConf

from fp8_lightning.train_config import (  # noqa: F401  (importable from here, as before the split)
    GPU_ACCELERATORS, ConfigError, check_config, check_data_root, check_parallelism, check_precision_choice,
    check_recipe, check_run_folder, check_trainer_accelerator, configured_tp_size,
)
from hydra_plugins.fp8_lightning_searchpath.fp8_lightning_searchpath import register_resolvers

register_resolvers()  # ${fp8.pid:} in the run folder's name (conf/hydra/default.yaml)

CHECKOUT_CONF = Path(__file__).resolve().parent.parent / "conf"
CONFIG_NAME = "train"


def config_path() -> str:
    """The checkout's ``conf/`` when present (live edits), else the configs packaged in the wheel."""
    if (CHECKOUT_CONF / f"{CONFIG_NAME}.yaml").is_file():
        return str(CHECKOUT_CONF)
    return "pkg://fp8_lightning.conf"


# ----------------------------------------------------------------------------------------------------------
# Measuring the run
# ----------------------------------------------------------------------------------------------------------


class RunMonitor(pl.Callback):
    """Training throughput and loss curves for the summary, measured the same way for every precision.

    Tokens/s counts the tokens of every training batch on every rank, divided by the time from batch start to
    batch end (forward, backward, optimizer step; data loading and validation excluded), skipping the first
    ``warmup_steps`` steps (allocations, first-use scaling, lazy initialisation).
    """

    def __init__(self, log_every_n_steps: int = 10, warmup_steps: int = 3):
        self.log_every_n_steps, self.warmup_steps = max(1, log_every_n_steps), warmup_steps
        self.train_curve: list[tuple[int, float]] = []
        self.val_curve: list[tuple[int, float]] = []
        self.last_val_step = -1
        self.tokens, self.seconds, self._start = 0, 0.0, 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        step = trainer.global_step
        if step > self.warmup_steps:
            self.seconds += time.perf_counter() - self._start
            self.tokens += batch[0].numel() * trainer.world_size
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None and (step % self.log_every_n_steps == 0 or step == 1):
            self.train_curve.append((step, float(loss)))

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or "val/loss" not in trainer.callback_metrics:
            return
        self.last_val_step = trainer.global_step
        self.val_curve.append((trainer.global_step, float(trainer.callback_metrics["val/loss"])))

    def tokens_per_second(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None


def peak_memory_mib(device: torch.device) -> float:
    """Peak CUDA memory allocated by tensors on a GPU; the peak resident set of this process on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# ----------------------------------------------------------------------------------------------------------
# Building the run from the config
# ----------------------------------------------------------------------------------------------------------


def instantiate(node: Any, key: str, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` that reports a failure as a :class:`ConfigError` naming ``key``."""
    try:
        return hydra.utils.instantiate(node, **kwargs)
    except Exception as err:  # noqa: BLE001 - re-raised with the config key that caused it
        cause = err.__cause__ or err
        raise ConfigError(f"{key} could not be built: {type(cause).__name__}: {cause}") from err


def has_target(node: Any) -> bool:
    return isinstance(node, DictConfig) and "_target_" in node


def build_precision(cfg: DictConfig) -> tuple[str | None, list]:
    """``(Trainer precision flag, plugins)`` from the precision group."""
    plugin_cfg = cfg.precision.get("plugin")
    if plugin_cfg is None:
        return str(cfg.precision.lightning), []
    dtype = plugin_cfg.get("dtype")
    overrides = {"dtype": plugin_dtype(dtype)} if isinstance(dtype, str) else {}
    return None, [instantiate(plugin_cfg, "precision.plugin", **overrides)]


def plugin_dtype(name: str) -> torch.dtype:
    """The torch dtype ``precision.plugin.dtype`` names, or a :class:`ConfigError` saying what is allowed."""
    from fp8_lightning.lightning.plugin_base import parse_dtype

    try:
        return parse_dtype(name)
    except ValueError:
        raise ConfigError(
            f"precision.plugin.dtype={name!r} is not a dtype for the non-FP8 parts; allowed: float32, bfloat16, "
            "float16 (or fp32, bf16, fp16). Override it like precision.plugin.dtype=bfloat16, or precision.plugin."
            "dtype=null for the device default (bf16 autocast on CUDA, float32 on CPU)."
        ) from None


def build_strategy(cfg: DictConfig) -> Any:
    node = cfg.get("strategy")
    tp = configured_tp_size(cfg)
    if tp > 1:  # check_parallelism allowed only auto and fp8_fsdp
        dp = cfg.parallelism.get("data_parallel_size", "auto")
        dp = "auto" if str(dp) == "auto" else int(dp)
        if has_target(node):
            return instantiate(node, "strategy", tensor_parallel_size=tp, data_parallel_size=dp)
        from lightning.pytorch.strategies import ModelParallelStrategy

        if dp == "auto":
            devices = cfg.trainer.get("devices", 1)
            world = int(cfg.trainer.get("num_nodes", 1) or 1) * (int(devices) if str(devices).isdigit() else 1)
            dp = max(1, world // tp)
        if dp > 1:
            raise ConfigError(
                f"parallelism.tensor_parallel_size={tp} with data_parallel_size={dp} under strategy=auto: Lightning's "
                "ModelParallelStrategy leaves data-parallel sharding to the model. Use strategy=fp8_fsdp for "
                "TP x FSDP2, or trainer.devices equal to the tensor-parallel size."
            )
        return ModelParallelStrategy(tensor_parallel_size=tp, data_parallel_size=1)
    if node is None:
        return "auto"
    if isinstance(node, str):
        return node
    return instantiate(node, "strategy") if has_target(node) else str(node.get("name", "auto"))


def build_group_items(cfg: DictConfig, group: str, skip: tuple[str, ...] = ()) -> list:
    node = cfg.get(group) or {}
    return [instantiate(v, f"{group}.{k}") for k, v in node.items() if has_target(v) and k not in skip]


def build(cfg: DictConfig) -> dict[str, Any]:
    """Instantiate data, model, precision, strategy, callbacks, loggers and the trainer (in that order)."""
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = instantiate(cfg.data, "data")
    optimizer = instantiate(cfg.optimizer, "optimizer") if has_target(cfg.get("optimizer")) else None
    scheduler = instantiate(cfg.scheduler, "scheduler") if has_target(cfg.get("scheduler")) else None
    model = instantiate(cfg.model, "model", optimizer=optimizer, scheduler=scheduler)
    precision, plugins = build_precision(cfg)
    is_fp8 = bool(plugins)
    callbacks = build_group_items(cfg, "callbacks", skip=() if is_fp8 else ("fp8_stats",))
    if cfg.trainer.get("enable_progress_bar") is False:  # trainer.enable_progress_bar=false wins over the group
        callbacks = [c for c in callbacks if not isinstance(c, pl.callbacks.ProgressBar)]
    monitor = RunMonitor(log_every_n_steps=int(cfg.trainer.get("log_every_n_steps") or 10))
    loggers = build_group_items(cfg, "logger")
    trainer_kwargs: dict[str, Any] = dict(
        callbacks=callbacks + [monitor], logger=loggers or False, plugins=plugins, strategy=build_strategy(cfg)
    )
    if precision is not None:
        trainer_kwargs["precision"] = precision
    trainer = instantiate(cfg.trainer, "trainer", **trainer_kwargs)
    return dict(trainer=trainer, model=model, datamodule=datamodule, monitor=monitor, plugins=plugins)


# ----------------------------------------------------------------------------------------------------------
# Running and summarising
# ----------------------------------------------------------------------------------------------------------


def conversion_summary(model: torch.nn.Module, plugins: list) -> dict[str, Any]:
    report = next((p.conversion_report for p in plugins if getattr(p, "conversion_report", None)), None)
    if report is not None:
        summary = {"converted": list(report.converted), "skipped": dict(report.skipped)}
        if report.experts or report.experts_skipped:  # mixtures of experts: the fused expert modules too
            summary.update(experts=list(report.experts), experts_skipped=dict(report.experts_skipped))
        return summary
    from fp8_lightning.convert import fp8_modules

    return {"converted": [name for name, _ in fp8_modules(model)], "skipped": {}}


def checkpoint_path(trainer) -> str | None:
    ckpt = trainer.checkpoint_callback
    if ckpt is None:
        return None
    return ckpt.best_model_path or ckpt.last_model_path or None


def check_data(model: Any, datamodule: Any) -> None:
    """Read the data before training (a :class:`ConfigError` for an empty folder, empty files or text shorter than a
    block, instead of a traceback from inside ``fit``), and check the model's vocabulary covers the data's."""
    try:
        datamodule.setup("fit")  # idempotent: fit's own call reuses what this read
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(f"the data cannot be used: {err}") from None
    data_vocab = getattr(datamodule, "vocab_size", None)
    model_vocab = getattr(getattr(model, "hparams", {}), "get", lambda _: None)("vocab_size")
    if data_vocab is not None and model_vocab is not None and int(model_vocab) < int(data_vocab):
        raise ConfigError(
            f"model.vocab_size={model_vocab} is smaller than the data's vocabulary ({data_vocab} token ids, "
            f"{type(datamodule).__name__}): token ids from {model_vocab} up would index past the embedding. Set "
            f"model.vocab_size={data_vocab} (or larger, a multiple of 32)."
        )


def prepare_resume(ckpt_path: str | None, plugins: list) -> str | None:
    """Check the checkpoint file to resume from (one clear :class:`ConfigError` for a missing, truncated or corrupted
    file, instead of the reader's EOFError) and tell the FP8 plugin its path, which its load errors name."""
    if not ckpt_path or str(ckpt_path) in ("last", "best", "hpc", "registry"):  # Lightning resolves these itself
        return ckpt_path
    from fp8_lightning.lightning.checkpoint import CheckpointFileError, check_checkpoint_file

    try:
        check_checkpoint_file(ckpt_path)
    except CheckpointFileError as err:
        raise ConfigError(f"ckpt_path={str(ckpt_path)!r}: {err}") from None
    for plugin in plugins:
        if hasattr(plugin, "checkpoint_path"):
            plugin.checkpoint_path = str(ckpt_path)
    return ckpt_path


def run(cfg: DictConfig) -> dict[str, Any]:
    """Train (and finally validate) as configured; return the summary dict."""
    check_config(cfg)
    parts = build(cfg)
    trainer, model, datamodule, monitor = parts["trainer"], parts["model"], parts["datamodule"], parts["monitor"]
    check_data(model, datamodule)
    ckpt_path = prepare_resume(cfg.get("ckpt_path"), parts["plugins"])
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    if cfg.get("validate_at_end") and monitor.last_val_step != trainer.global_step:
        trainer.validate(model, datamodule=datamodule, verbose=False)
    val_loss = _metric(trainer, "val/loss")
    summary = {
        "precision": cfg.precision.get("name"),
        "recipe": OmegaConf.to_container(cfg.precision.recipe, resolve=True) if cfg.precision.get("recipe") else None,
        "steps": trainer.global_step,
        "world_size": trainer.world_size,
        "val_loss": val_loss,
        "val_ppl": _metric(trainer, "val/ppl") or (math.exp(val_loss) if val_loss is not None else None),
        "tokens_per_s": monitor.tokens_per_second(),
        "peak_memory_mib": peak_memory_mib(model.device),
        "peak_memory_kind": "cuda_max_allocated" if model.device.type == "cuda" else "process_peak_rss",
        "parameters": sum(p.numel() for p in model.parameters()),
        "layers": conversion_summary(model, parts["plugins"]),
        "checkpoint": checkpoint_path(trainer),
        "train_loss_curve": monitor.train_curve,
        "val_loss_curve": monitor.val_curve,
        "data": getattr(datamodule, "stats", {}),
        "output_dir": str(cfg.paths.output_dir),
    }
    if trainer.is_global_zero:
        print(format_summary(summary))
        if cfg.get("summary_file"):
            Path(cfg.summary_file).parent.mkdir(parents=True, exist_ok=True)
            Path(cfg.summary_file).write_text(json.dumps(summary, indent=2))
    return summary


def _metric(trainer, key: str) -> float | None:
    value = trainer.callback_metrics.get(key)
    return None if value is None else float(value)


def format_summary(s: dict[str, Any]) -> str:
    def num(x, fmt):
        return "n/a" if x is None else format(x, fmt)

    layers = s["layers"]
    lines = [
        "",
        f"==== fp8-train summary ({s['precision']}, {s['steps']} steps) ====",
        f"validation loss   {num(s['val_loss'], '.4f')}   perplexity {num(s['val_ppl'], '.3f')}",
        f"throughput        {num(s['tokens_per_s'], ',.0f')} tokens/s (training steps)",
        f"peak memory       {num(s['peak_memory_mib'], ',.0f')} MiB ({s['peak_memory_kind']})",
        f"FP8 layers        {len(layers['converted'])} converted, {len(layers['skipped'])} skipped",
    ]
    if layers["converted"]:
        lines.append("  converted: " + ", ".join(layers["converted"]))
    lines += [f"  skipped {name}: {reason}" for name, reason in layers["skipped"].items()]
    if layers.get("experts"):
        lines.append("  experts converted: " + ", ".join(layers["experts"]))
    lines += [f"  experts skipped {name}: {reason}" for name, reason in layers.get("experts_skipped", {}).items()]
    lines += [f"checkpoint        {s['checkpoint'] or 'none (no ModelCheckpoint callback)'}",
              f"outputs           {s['output_dir']}", ""]
    return "\n".join(lines)


@hydra.main(version_base="1.3", config_path=config_path(), config_name=CONFIG_NAME)
def main(cfg: DictConfig) -> float | None:
    """Hydra entry point; returns the final validation loss (for sweepers)."""
    try:
        return run(cfg)["val_loss"]
    except ConfigError as err:
        print(f"fp8-train: configuration error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
