"""A small nanoGPT-style language model as an ordinary LightningModule (no FP8 code inside).

Why it looks the way it does:

* It is the workload of ``fp8-train``: a decoder-only transformer with pre-LayerNorm blocks, built only from
  ``nn.Linear``, ``nn.LayerNorm`` and ``nn.Embedding``, so that an FP8 precision plugin can swap the Linear layers
  without the model knowing. Every Linear dimension is a multiple of 32 (``n_embd`` must be, ``vocab_size``
  must be), so every FP8 recipe, including MXFP8 with blocks of 32 along K, applies to every layer.
* Attention uses :func:`torch.nn.functional.scaled_dot_product_attention` (causal); softmax, LayerNorm and the
  loss stay in the precision the trainer chooses.
* The optimizer and the optional learning-rate scheduler arrive as partials (lightning-hydra-template style):
  ``optimizer(params=...)`` and ``scheduler(optimizer=...)``, so Hydra configs pick them without code changes.
  Weight decay applies to 2-D parameters only (Linear and embedding matrices), not to biases or norms.
* Metrics: ``train/loss``, ``val/loss`` and ``val/ppl`` (torchmetrics :class:`~torchmetrics.text.Perplexity`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from torchmetrics.text import Perplexity

OptimizerFactory = Callable[..., torch.optim.Optimizer]
SchedulerFactory = Callable[..., Any]


def check_gpt_dims(vocab_size: int, n_embd: int, n_head: int, mlp_ratio: int) -> None:
    """Fail early, with the fix, when a size would give a Linear layer that FP8 recipes cannot take."""
    problems = []
    if n_embd % 32:
        problems.append(f"n_embd={n_embd} is not a multiple of 32")
    if vocab_size % 32:
        problems.append(f"vocab_size={vocab_size} is not a multiple of 32")
    if n_head < 1 or n_embd % n_head:
        problems.append(f"n_embd={n_embd} is not divisible by n_head={n_head}")
    if mlp_ratio < 1:
        problems.append(f"mlp_ratio={mlp_ratio} must be >= 1")
    if problems:
        raise ValueError(
            "GPT size is invalid: " + "; ".join(problems) + ". Every Linear dimension must be a multiple of 32 "
            "so that all FP8 recipes apply; pick e.g. n_embd=128, n_head=4, vocab_size=256."
        )


class CausalSelfAttention(nn.Module):
    """Causal self-attention. ``fused_qkv``: one ``qkv`` projection (the default); else ``q``, ``k``, ``v`` layers,
    which tensor parallelism can split by heads (a colwise split of the fused weight would not keep a rank's q, k
    and v heads together). Heads are counted from the projection's width, so a rank holding a head-aligned shard
    of the projections attends over its own heads."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool, fused_qkv: bool = True):
        super().__init__()
        self.n_head, self.head_dim = n_head, n_embd // n_head
        if fused_qkv:
            self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        else:
            self.q, self.k, self.v = (nn.Linear(n_embd, n_embd, bias=bias) for _ in range(3))
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        if hasattr(self, "qkv"):
            q, k, v = self.qkv(x).split(c, dim=2)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(b, t, -1)))


class MLP(nn.Module):
    def __init__(self, n_embd: int, mlp_ratio: int, dropout: float, bias: bool):
        super().__init__()
        self.fc = nn.Linear(n_embd, mlp_ratio * n_embd, bias=bias)
        self.proj = nn.Linear(mlp_ratio * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, n_embd: int, n_head: int, mlp_ratio: int, dropout: float, bias: bool, fused_qkv: bool = True):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias, fused_qkv)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, mlp_ratio, dropout, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(pl.LightningModule):
    """Decoder-only transformer language model over ``vocab_size`` tokens (256 for bytes).

    Batches are ``(inputs, targets)`` pairs of ``int64`` token ids of shape ``(batch, block_size)`` where
    targets are the inputs shifted by one position.
    """

    def __init__(
        self,
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 128,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        bias: bool = True,
        tie_weights: bool = True,
        fused_qkv: bool = True,
    ):
        super().__init__()
        check_gpt_dims(vocab_size, n_embd, n_head, mlp_ratio)
        self.save_hyperparameters(ignore=["optimizer", "scheduler"], logger=False)
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, mlp_ratio, dropout, bias, fused_qkv) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by depth
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))
        self.val_ppl = Perplexity()

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy`` with a tensor-parallel mesh of more than one rank, split the blocks by
        :func:`~fp8_lightning.distributed.tp_plans.gpt_tp_plan` (the strategy's data-parallel sharding follows);
        elsewhere nothing."""
        mesh = self.device_mesh
        if mesh is None or "tensor_parallel" not in (mesh.mesh_dim_names or ()) or mesh["tensor_parallel"].size() < 2:
            return
        from torch.distributed.tensor.parallel import parallelize_module

        from fp8_lightning.distributed.tp_plans import gpt_tp_plan

        tp_mesh = mesh["tensor_parallel"]
        parallelize_module(self, tp_mesh, gpt_tp_plan(self, tp_mesh.size()))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(batch, time, vocab_size)`` for token ids ``idx`` of shape ``(batch, time)``."""
        t = idx.shape[1]
        if t > self.hparams.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size={self.hparams.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = batch
        logits = self(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return loss, logits

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss, _ = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        loss, logits = self._loss(batch)
        self.val_ppl(logits.float(), batch[1])
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        self.log("val/ppl", self.val_ppl, prog_bar=True)

    def configure_optimizers(self):
        if self.optimizer_factory is None:
            raise ValueError(
                "GPT was built without an optimizer; pass optimizer=functools.partial(torch.optim.AdamW, lr=...) "
                "or select an optimizer config (optimizer=adamw)."
            )
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
        optimizer = self.optimizer_factory(params=groups)
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer=optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
