"""Hugging Face model families from random-init configs (no download) trained through ``Trainer(precision=...)``
for every FP8 string: which layers convert, and the final loss next to the float32 run's from the same seed.

    python -m benchmarks tried-with [--steps 30] [--out benchmarks/results/tried-with-YYYYMMDD.md]

A single CPU process; the learnable task is the test suite's Markov-chain token stream. The numbers say that the
family runs and learns in FP8 like in float32, not how fast.
"""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path

import lightning as L
import torch
import transformers
from torch.utils.data import DataLoader, DistributedSampler

import fp8_lightning  # noqa: F401
from fp8_lightning import fp8_modules
from fp8_lightning.lightning.strings import PRECISION_RECIPES
from fp8_lightning.lightning.testing import CausalLM
from fp8_lightning.testing import VOCAB, loader, trainer_kwargs

TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
FAMILIES = {
    "Llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)),
    "Qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY)),
    "Qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY, head_dim=16)),
    "GPT-NeoX": lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64)),
    "GPT-2 (Conv1D)": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0)),
}  # fmt: skip


def train(factory, precision: str, steps: int, ranks: int = 1, **trainer_overrides) -> tuple[CausalLM, L.Trainer]:
    """``steps`` steps from seed 0 on the first ``steps * 16`` sequences of the Markov stream, 16 per step. On
    ``ranks`` processes (``torch.distributed`` initialized) each takes every ``ranks``-th sequence of the step's 16
    (in order: Lightning's own distributed sampler would shuffle), so the ranks together see the one-process
    batch."""
    L.seed_everything(0, verbose=False)
    module = CausalLM(factory)
    if ranks > 1:
        trainer_overrides.update(devices=ranks, use_distributed_sampler=False)
    trainer = L.Trainer(max_steps=steps, precision=precision, **trainer_kwargs(**trainer_overrides))
    data = loader(n=steps * 16, batch_size=16 // ranks)
    if ranks > 1:
        sampler = DistributedSampler(data.dataset, ranks, trainer.global_rank, shuffle=False)
        data = DataLoader(data.dataset, batch_size=16 // ranks, sampler=sampler)
    trainer.fit(module, data)
    return module, trainer


def fit(factory, precision: str, steps: int) -> tuple[float, int, int]:
    """(mean loss of the last 5 steps, FP8 layers, all linear-like layers)."""
    module, trainer = train(factory, precision, steps)
    report = getattr(trainer.precision_plugin, "conversion_report", None)
    total = len(report.converted) + len(report.skipped) if report else 0
    return sum(module.losses[-5:]) / 5, len(list(fp8_modules(module))), total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = ["| family | precision | FP8 layers / linear layers | final loss | fp32 final loss | ratio |",
            "|---|---|---|---|---|---|"]  # fmt: skip
    start = time.perf_counter()
    for family, factory in FAMILIES.items():
        base, _, _ = fit(factory, "32-true", args.steps)
        for precision in PRECISION_RECIPES:
            loss, fp8, total = fit(factory, precision, args.steps)
            rows.append(f"| {family} | {precision} | {fp8} / {total} | {loss:.4f} | {base:.4f} | {loss / base:.4f} |")
            print(rows[-1], flush=True)
    text = "\n".join([
        f"# Tried with: Hugging Face families through Trainer(precision=...) ({datetime.date.today()})", "",
        f"Command: `python -m benchmarks tried-with --steps {args.steps}`; CPU, 1 thread, transformers "
        f"{transformers.__version__}, torch {torch.__version__}, lightning {L.__version__}; "
        f"{time.perf_counter() - start:.0f} s in all. Final loss: mean of the last 5 of {args.steps} steps.", "",
        *rows, ""])  # fmt: skip
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
