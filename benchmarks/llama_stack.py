"""A stack of Llama-3-8B-shaped decoder layers, for the GPT suite's comparison at the shapes published results use.

Why: torchao publishes its float8 training speed-ups for Llama-3-8B, whose linear layers are far wider than the
350M GPT's (hidden 4096, FFN 14336, grouped-query attention with 8 KV heads of 128). A few such layers, fed random
hidden states and trained on a mean-square loss, reproduce those GEMM shapes and their share of a step without
the 128K-token embedding and head (which no FP8 recipe converts). The layer: RMSNorm, attention (no rotary
embedding: it changes no GEMM shape), RMSNorm, SwiGLU feed-forward; no biases, as in Llama.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

LLAMA3_8B = dict(n_embd=4096, n_head=32, n_kv_head=8, ffn=14336)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class LlamaLayer(nn.Module):
    def __init__(self, n_embd: int, n_head: int, n_kv_head: int, ffn: int):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, n_embd // n_head
        kv = n_kv_head * self.head_dim
        self.attn_norm, self.ffn_norm = RMSNorm(n_embd), RMSNorm(n_embd)
        self.wq, self.wk, self.wv = (nn.Linear(n_embd, d, bias=False) for d in (n_embd, kv, kv))
        self.wo = nn.Linear(n_embd, n_embd, bias=False)
        self.w1, self.w3 = nn.Linear(n_embd, ffn, bias=False), nn.Linear(n_embd, ffn, bias=False)
        self.w2 = nn.Linear(ffn, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(h).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.wv(h).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, c))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class LlamaStack(nn.Module):
    """``n_layer`` decoder layers; input and output are hidden states (batch, tokens, n_embd)."""

    def __init__(self, n_layer: int, n_embd: int, n_head: int, n_kv_head: int, ffn: int):
        super().__init__()
        self.layers = nn.ModuleList(LlamaLayer(n_embd, n_head, n_kv_head, ffn) for _ in range(n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
