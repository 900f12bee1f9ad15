"""Helpers shared by the test suite and the benchmarks (neither imports the other; both import this).

* Two-process runs on one machine: a free rendezvous port, joining a gloo group, and the clean end of a worker.
* Counting what a rank sends at the ``torch.distributed`` calls: :class:`CollectiveCounter` (tensor bytes per
  collective kind) and :class:`WireBytes` (per-rank wire cost of each collective), and two plain DDP hooks.
* A small deterministic language-modelling task (a sparse Markov chain of tokens) and quiet CPU Trainer settings.
* A stack of Llama-3-8B-shaped decoder layers, with the speed targets the GPU measurements are read against.
* Reading PTX: the ``wgmma`` sites and the ``wait_group`` depths of a Hopper kernel.

Plain torch only: importing this module does not import Lightning.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import socket
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

# --- two-process runs ---------------------------------------------------------------------------------------------



def _rendezvous_ports() -> tuple[int, int]:
    """Ports from 20000 up to the start of the kernel's ephemeral range (Linux's default starts at 32768)."""
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return (20000, low) if low > 21000 else (10000, 20000)


_RENDEZVOUS_PORTS = _rendezvous_ports()


def free_port() -> int:
    """A free TCP port on the loopback interface for a rendezvous, drawn below the kernel's ephemeral range.

    A port the kernel hands out for ``bind(0)`` can be handed out again, between this call and the rendezvous, to a
    gloo connection or a store of another process running at the same time; the rendezvous then joins the wrong
    store and waits forever. Ports below the ephemeral range are never handed out that way.
    """
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(_RENDEZVOUS_PORTS[0], _RENDEZVOUS_PORTS[1])
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in {_RENDEZVOUS_PORTS} on 127.0.0.1 after 200 tries")


def init_gloo(rank: int, world: int, port: int) -> None:
    """Join the gloo process group of ``world`` processes on the loopback rendezvous ``port``, one CPU thread."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def end_worker() -> None:
    """Destroy the process group and leave the worker process without interpreter finalization.

    A finished gloo collective is released on gloo's own worker thread, and when it holds the last reference to a
    tensor that Python no longer references, releasing it takes the GIL. If the main thread has meanwhile returned
    and Python is finalizing, that thread is ended inside a destructor and the process aborts with "terminate called
    without an active exception" (a core dump of it: ``ProcessGroupGloo::runLoop`` ->
    ``~AsyncAllgatherCoalescedWork`` -> ``TensorImpl::decref_pyobject`` -> ``take_gil`` -> ``pthread_exit``; about
    one run in twenty of the FSDP2 optimizer test; torch's proposed fix, pytorch/pytorch#179291, was abandoned).
    Everything a worker reports is written before this is called, so skipping finalization loses nothing.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --- counting collectives -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def observed_collectives(observers: dict):
    """Within the block, each torch.distributed function named in ``observers`` (where this torch has it) calls its
    observer with the call's arguments, then runs as usual; the originals are back on exit."""
    saved = {}
    try:
        for name, observe in observers.items():
            original = getattr(dist, name, None)
            if original is None:
                continue
            saved[name] = original

            def observed(*args, _observe=observe, _original=original, **kwargs):
                _observe(*args, **kwargs)
                return _original(*args, **kwargs)

            setattr(dist, name, observed)
        yield
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)


class _ObservingCollectives:
    """A context manager that, within its block, calls ``self._observers`` (name -> observer) at the
    torch.distributed functions of those names (:func:`observed_collectives`)."""

    _observers: dict

    def __enter__(self):
        self._patch = observed_collectives(self._observers)
        self._patch.__enter__()
        return self

    def __exit__(self, *exc):
        return self._patch.__exit__(*exc)


class CollectiveCounter(_ObservingCollectives):
    """Per-collective byte counts of what this rank sends, by patching the torch.distributed functions."""

    PATCHED = {
        "all_gather": ("all_gather_single", "all_gather_into_tensor", "_all_gather_base"),
        "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base"),
        "all_reduce": ("all_reduce",),
    }

    def __init__(self):
        self.bytes = {kind: 0 for kind in self.PATCHED}
        self.calls = {kind: 0 for kind in self.PATCHED}
        self._observers = {name: self._observer(kind) for kind, names in self.PATCHED.items() for name in names}

    def _observer(self, kind: str):
        input_index = 0 if kind == "all_reduce" else 1

        def count(*args, **kwargs):
            if len(args) > input_index:
                tensor = args[input_index]
            else:
                tensor = next(v for k, v in kwargs.items() if k in ("input", "input_tensor", "tensor"))
            self.bytes[kind] += tensor.numel() * tensor.element_size()
            self.calls[kind] += 1

        return count



def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class WireBytes(_ObservingCollectives):
    """Bytes this rank puts on the wire, counted at the torch.distributed calls, with the usual per-rank cost of
    each collective: ring all-reduce ``2(w-1)/w x size``, all-to-all and reduce-scatter ``(w-1)/w x input``,
    all-gather ``(w-1) x input``."""

    COSTS = {
        "all_reduce": lambda w, t, *a, **k: 2 * (w - 1) / w * nbytes(t),
        "all_to_all_single": lambda w, out, inp, *a, **k: (w - 1) / w * nbytes(inp),
        "all_gather_single": lambda w, out, inp, *a, **k: (w - 1) * nbytes(inp),
        "all_gather_into_tensor": lambda w, out, inp, *a, **k: (w - 1) * nbytes(inp),
        "reduce_scatter_single": lambda w, output, input, *a, **k: (w - 1) / w * nbytes(input),
    }

    def __init__(self):
        self.bytes: dict[str, float] = {}
        self._observers = {name: self._observer(name, cost) for name, cost in self.COSTS.items()}

    def _observer(self, name: str, cost):
        def count(*args, **kwargs):
            world = dist.get_world_size(kwargs.get("group"))
            self.bytes[name] = self.bytes.get(name, 0.0) + cost(world, *args, **kwargs)

        return count



def _done(buffer: torch.Tensor) -> torch.futures.Future:
    future = torch.futures.Future()
    future.set_result(buffer)
    return future


def fp32_hook(state, bucket):
    """DDP hook: float32 all-reduce, then divide (the default's arithmetic, counted at dist.all_reduce)."""
    buffer = bucket.buffer()
    dist.all_reduce(buffer)
    return _done(buffer.div_(dist.get_world_size()))


def bf16_hook(state, bucket):
    """DDP hook: cast the bucket to bf16, all-reduce, divide, copy back (torch's bf16_compress_hook's steps)."""
    buffer = bucket.buffer()
    wire = buffer.to(torch.bfloat16)
    dist.all_reduce(wire)
    buffer.copy_(wire.float() / dist.get_world_size())
    return _done(buffer)


class Mixer(nn.Module):
    """Attention's projections without the attention: q, k, v read one input (colwise under tensor parallelism, one
    sequence all-gather for the three), o writes the output (rowwise)."""

    def __init__(self, width: int):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))

    def forward(self, x):
        return self.o(torch.tanh(self.q(x)) * self.k(x) + self.v(x))


# --- a small language-modelling task ------------------------------------------------------------------------------

VOCAB, SEQ = 64, 32


def markov_tokens(n: int = 512, seed: int = 1234) -> torch.Tensor:
    """Sequences from a fixed sparse Markov chain: learnable well below the uniform loss log(64)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(VOCAB, VOCAB, generator=g) * 3.0
    probs = torch.softmax(logits, dim=-1)
    seq = torch.empty(n, SEQ + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(SEQ):
        seq[:, t + 1] = torch.multinomial(probs[seq[:, t]], 1, generator=g).squeeze(1)
    return seq


def loader(n: int = 512, batch_size: int = 32) -> DataLoader:
    return DataLoader(TensorDataset(markov_tokens(n)), batch_size=batch_size, shuffle=False)


def trainer_kwargs(**overrides) -> dict:
    """Keyword arguments of a quiet one-device CPU ``Trainer`` (no logger, checkpoints, bars or validation)."""
    kwargs = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                  num_sanity_val_steps=0)  # fmt: skip
    kwargs.update(overrides)
    return kwargs


# --- Llama-3-8B-shaped layers and the GPU speed targets -----------------------------------------------------------

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
    """RMSNorm, attention (no rotary embedding: it changes no GEMM shape), RMSNorm, SwiGLU feed-forward; no biases,
    as in Llama."""

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
    """``n_layer`` Llama decoder layers; input and output are hidden states (batch, tokens, n_embd).

    With :data:`LLAMA3_8B` it has the GEMM shapes torchao publishes its float8 training speed-ups for (hidden 4096,
    FFN 14336, grouped-query attention with 8 KV heads of 128), without the 128K-token embedding and head (which no
    FP8 recipe converts)."""

    def __init__(self, n_layer: int, n_embd: int, n_head: int, n_kv_head: int, ffn: int):
        super().__init__()
        self.layers = nn.ModuleList(LlamaLayer(n_embd, n_head, n_kv_head, ffn) for _ in range(n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def linear_targets(rows: list[dict]) -> str:
    """The linear layer's GPU targets, each with what was measured: 8192 cubed tensorwise >= 1.6x bf16 (torchao's
    published float8 speed-up at that size is of that order), and no FP8 layer slower than bf16. ``rows``: dicts
    with ``size``, ``config`` and ``speedup_vs_bf16``."""
    text = ""
    square = [r["speedup_vs_bf16"] for r in rows if r["size"] == "8192" and r["config"] == "fp8 tensorwise"]
    if square:
        text += f" Target (8192 cubed, FP8 tensorwise >= 1.6x bf16): {square[0]:.2f}x, "
        text += "met." if square[0] >= 1.6 else "NOT met."
    slower = [f"{r['config']} at {r['size']} ({r['speedup_vs_bf16']:.2f}x)" for r in rows
              if r["config"].startswith("fp8") and r["speedup_vs_bf16"] < 1.0]  # fmt: skip
    text += " Target (no FP8 layer slower than bf16): " + ("met." if not slower else "NOT met: " + ", ".join(slower))
    return text


def versus_torchao(rows: list[dict]) -> str:
    """Each FP8 row's speed against torchao.float8's on the same model (target: at least as fast). ``rows``: dicts
    with ``model``, ``precision`` and ``step_ms``."""
    peer = {r["model"]: r["step_ms"] for r in rows if r["precision"] == "torchao tensorwise"}
    return "".join(
        f" {r['model']} {r['precision']}: {peer[r['model']] / r['step_ms']:.2f}x torchao.float8 speed (target >= 1)."
        for r in rows if r["precision"].startswith("fp8") and r["model"] in peer
    )  # fmt: skip


# --- PTX ------------------------------------------------------------------------------------------------------------


def wgmma_waits(ptx: str) -> tuple[int, list[int]]:
    """(wgmma instruction sites, the N of every ``wgmma.wait_group N``) in ``ptx``."""
    sites = len(re.findall(r"wgmma\.mma_async", ptx))
    return sites, [int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)]
