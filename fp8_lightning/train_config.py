"""The fail-fast checks of ``fp8-train``'s configuration, run before anything is built.

Each refuses a configuration that cannot run with a :class:`ConfigError` whose message names the key, what is
allowed and the fix (``fp8-train`` exits with status 2); :func:`check_run_folder` warns instead, where a run would
only scatter its files.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from fp8_lightning.recipes import recipe_from

GPU_ACCELERATORS = ("gpu", "cuda")


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key, what is allowed and the fix."""


def check_config(cfg: DictConfig) -> None:
    check_parallelism(cfg)
    check_recipe(cfg)
    check_precision_choice(cfg)
    check_trainer_accelerator(cfg)
    check_data_root(cfg)
    check_run_folder(cfg)


def check_run_folder(cfg: DictConfig) -> None:
    """Under torchrun or SLURM every rank composes the configuration itself, so the default run folder (named by
    the time to the microsecond and the process id, unique per run) is a different folder on every rank: warn once
    (rank 0) that ``hydra.run.dir=`` should name one folder for all of them. Lightning's own launcher
    (``trainer.devices=2`` without torchrun) hands its folder to the processes it starts, so it is not affected."""
    world = int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1)
    rank = int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0)
    if world <= 1 or rank != 0:
        return
    try:
        folder = str(cfg.paths.output_dir)
    except Exception:  # noqa: BLE001 - no Hydra runtime (a composed config): nothing to check
        return
    if folder.endswith(f"_{os.getpid()}"):
        warnings.warn(
            f"fp8-train runs as one of {world} processes started by torchrun or SLURM, and the run folder {folder} is "
            "named by this process's clock and id: every rank writes .hydra/ and its logs into a folder of its own. "
            "Pass one folder for all ranks: hydra.run.dir=outputs/<name> (examples/multinode/ does).",
            stacklevel=2,
        )


def configured_tp_size(cfg: DictConfig) -> int:
    return int((cfg.get("parallelism") or {}).get("tensor_parallel_size", 1) or 1)


def check_parallelism(cfg: DictConfig) -> None:
    tp = configured_tp_size(cfg)
    if tp < 1:
        raise ConfigError(f"parallelism.tensor_parallel_size={tp} must be >= 1 (1: no tensor parallelism).")
    if tp == 1:
        return
    if cfg.model.get("fused_qkv", False):
        raise ConfigError(
            f"parallelism.tensor_parallel_size={tp} needs model.fused_qkv=false: a colwise split of the fused qkv "
            "weight would not keep a rank's q, k and v heads together. Add model.fused_qkv=false."
        )
    strategy = cfg.get("strategy")
    target = str(strategy.get("_target_", strategy.get("name", "auto"))) if isinstance(strategy, DictConfig) else str(
        strategy or "auto")
    if not (target == "auto" or target.endswith("FP8FSDPStrategy")):
        raise ConfigError(
            f"parallelism.tensor_parallel_size={tp} works with strategy=auto (Lightning's ModelParallelStrategy) or "
            f"strategy=fp8_fsdp (TP x FSDP2); got strategy {target}. Pick one of those."
        )
    if cfg.trainer.get("gradient_clip_val"):
        raise ConfigError(
            f"parallelism.tensor_parallel_size={tp} cannot clip gradients yet (trainer.gradient_clip_val="
            f"{cfg.trainer.gradient_clip_val}): torch's total norm refuses gradients on different device meshes (the "
            "split layers' and the rest). Set trainer.gradient_clip_val=null."
        )


def check_recipe(cfg: DictConfig) -> None:
    recipe = cfg.precision.get("recipe")
    if recipe is None:
        return
    try:
        recipe_from(OmegaConf.to_container(recipe, resolve=True))
    except (ValueError, TypeError) as err:
        raise ConfigError(
            f"precision.recipe is invalid for precision={cfg.precision.get('name')}: {err} "
            f"Override a field like precision.recipe.<field>=<value>; current recipe: "
            f"{OmegaConf.to_container(recipe, resolve=True)}."
        ) from err


def check_precision_choice(cfg: DictConfig) -> None:
    flag, plugin = cfg.precision.get("lightning"), cfg.precision.get("plugin")
    if (flag is None) == (plugin is None):
        raise ConfigError(
            f"precision={cfg.precision.get('name')} sets precision.lightning={flag!r} and precision.plugin="
            f"{'<config>' if plugin is not None else None}; exactly one of them must be set (a Lightning flag such "
            "as 32-true/bf16-mixed, or the FP8 plugin)."
        )


def check_data_root(cfg: DictConfig) -> None:
    root = cfg.data.get("root")
    if root is not None and not Path(str(root)).expanduser().is_dir():
        raise ConfigError(
            f"data.root={str(root)!r} is not a folder (seen from {Path.cwd()}). Give a folder of text files "
            "(an absolute path, or relative to where fp8-train runs), or data.root=null for the standard library."
        )


def check_trainer_accelerator(cfg: DictConfig) -> None:
    accelerator = str(cfg.trainer.get("accelerator", "auto")).lower()
    if accelerator in GPU_ACCELERATORS and not torch.cuda.is_available():
        raise ConfigError(
            f"trainer.accelerator={accelerator} but this machine has no usable CUDA GPU "
            f"(torch {torch.__version__}, torch.cuda.is_available() is False). Use trainer=cpu (or trainer=ddp), "
            "or run on a machine with an NVIDIA GPU and a CUDA build of torch."
        )
