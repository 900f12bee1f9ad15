"""Hugging Face Llama and GPT-2 (random-init configs) under ``strategy="ddp"``, ``"fp8_ddp"`` and ``"fp8_fsdp"`` on
2 gloo processes (CPU), each next to a single-process run of the same global batches and precision.

    python -m benchmarks tried-with-strategies [--steps 30] [--out benchmarks/results/tried-with-strategies-YYYYMMDD.md]

Every run starts from seed 0 and takes the same 16 sequences per optimizer step: all 16 on one process, or 8 per
rank (every other sequence, so the two ranks' halves join to the single run's batch).
Reported per run: the FP8 layers (under ``fp8_fsdp``, how many of their weights gather in FP8), the mean loss of
the last 5 steps (the mean over ranks of each step's loss) and its ratio to
the single-process run's, and the checkpoint (``trainer.save_checkpoint``; a sharded torch distributed checkpoint
under ``fp8_fsdp``, read back with ``dcp_to_torch_save``) loaded with ``strict=True`` into a plain, unconverted
model, whose float32 loss on held-out sequences is compared with the same for the single-process checkpoint.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

from benchmarks.tried_with import FAMILIES, CausalLM, train
from fp8_lightning import fp8_modules
from fp8_lightning.lightning.strings import PRECISION_RECIPES
from fp8_lightning.testing import end_worker, free_port, markov_tokens

WORLD = 2
MODELS = ("Llama", "GPT-2 (Conv1D)")
RUNS = [("ddp", "32-true")] + [(s, p) for s in ("ddp", "fp8_ddp", "fp8_fsdp") for p in PRECISION_RECIPES]
TOLERANCE = 0.01  # final-loss ratio to the single-process run, and relative difference of the held-out losses


def final(losses: list[float]) -> float:
    return sum(losses[-5:]) / 5


def plain_loss(family: str, state_dict: dict) -> float:
    """Float32 loss on held-out sequences of an unconverted model that loaded ``state_dict`` strictly."""
    torch.manual_seed(0)
    plain = CausalLM(FAMILIES[family])
    plain.load_state_dict(state_dict, strict=True)
    held_out = markov_tokens(32, seed=99)
    with torch.no_grad():
        return plain.model(input_ids=held_out, labels=held_out).loss.item()


def checkpoint_state_dict(path: Path) -> dict:
    """The model weights of a Lightning checkpoint: a file, or a torch distributed checkpoint folder."""
    if path.is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(path, path.with_suffix(".pt"))
        path = path.with_suffix(".pt")
    return torch.load(path, weights_only=False)["state_dict"]


def single(steps: int, folder: Path) -> dict:
    results = {}
    for family in MODELS:
        for precision in dict.fromkeys(p for _, p in RUNS):
            module, trainer = train(FAMILIES[family], precision, steps)
            path = folder / f"single-{len(results)}.ckpt"
            trainer.save_checkpoint(path)
            results[family, precision] = (final(module.losses), plain_loss(family, checkpoint_state_dict(path)))
            print(family, precision, results[family, precision], flush=True)
    return results


def worker(rank: int, port: int, steps: int, folder: str, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0",
                      WORLD_SIZE=str(WORLD))  # fmt: skip
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    results = {}
    for family in MODELS:
        for strategy, precision in RUNS:
            module, trainer = train(FAMILIES[family], precision, steps, ranks=WORLD, strategy=strategy)
            losses = torch.tensor(module.losses)
            dist.all_reduce(losses)
            path = Path(folder) / f"{strategy}-{len(results)}.ckpt"
            trainer.save_checkpoint(path)
            dist.barrier()
            report = getattr(trainer.strategy, "all_gather_report", None)
            layers = f"{len(list(fp8_modules(module)))}" + (f" ({len(report.fp8)} gathered in FP8)" if report else "")
            if rank == 0:
                results[family, strategy, precision] = (
                    final((losses / WORLD).tolist()), plain_loss(family, checkpoint_state_dict(path)), layers)
                print(family, strategy, precision, results[family, strategy, precision], flush=True)
            dist.barrier()
    if rank == 0:
        out.update(results)
    end_worker()


def table(single_runs: dict, distributed: dict) -> tuple[list[str], bool]:
    rows = ["| family | strategy | precision | FP8 layers | final loss (2 ranks) | single process | ratio | "
            "held-out loss, plain model from the checkpoint (2 ranks / single) | within tolerance |",
            "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    ok_all = True
    for (family, strategy, precision), (loss, held_out, layers) in distributed.items():
        base, base_held_out = single_runs[family, precision]
        ok = abs(loss / base - 1) <= TOLERANCE and abs(held_out / base_held_out - 1) <= TOLERANCE
        ok_all &= ok
        rows.append(f"| {family} | {strategy} | {precision} | {layers} | {loss:.4f} | {base:.4f} | {loss / base:.4f} | "
                    f"{held_out:.4f} / {base_held_out:.4f} | {'yes' if ok else 'NO'} |")  # fmt: skip
    return rows, ok_all


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        single_runs = single(args.steps, Path(folder))
        out = mp.Manager().dict()
        mp.spawn(worker, args=(free_port(), args.steps, folder, out), nprocs=WORLD)
        rows, ok = table(single_runs, dict(out))
    text = "\n".join([
        f"# Tried with: Hugging Face Llama and GPT-2 under DDP, FP8 DDP and FP8 FSDP2 ({datetime.date.today()})", "",
        f"Command: `python -m benchmarks tried-with-strategies --steps {args.steps}`; CPU (2 cores), {WORLD} gloo "
        f"processes of 1 thread each; transformers {transformers.__version__}, torch {torch.__version__}, lightning "
        f"{L.__version__}; {time.perf_counter() - start:.0f} s in all. Final loss: mean of the last 5 of "
        f"{args.steps} steps, 16 sequences per step in both set-ups. Tolerance: {TOLERANCE:.0%} on the final-loss "
        "ratio and on the held-out loss of a plain model that loaded the checkpoint (strict).", "",
        *rows, "", f"All within tolerance: {'yes' if ok else 'NO'}", ""])  # fmt: skip
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
