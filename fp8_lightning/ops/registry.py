"""How a hot operation is declared once and called two ways.

:func:`hot_op` takes an operation's implementation and its fake (meta) implementation and gives a
:class:`HotOp`: ``op.custom`` is the ``torch.library`` custom op ``torch.ops.fp8_lightning.<name>`` that
``torch.compile``, fake tensors and dispatch modes see; ``op.for_tensor(x)`` is what a caller runs on ``x``: the
implementation itself for a plain tensor in eager code (a custom op's dispatch, about 9.6 us per call against 1.3 us
for the same function measured on the 2-core CPU with torch 2.13, costs more host time than the launch it wraps,
and a layer step makes a dozen such calls), the custom op everywhere else.

Which backend runs a tensor is decided in :mod:`fp8_lightning.ops.dispatch`.
"""

from __future__ import annotations

import types
from typing import Callable

import torch
from torch.library import custom_op

NAMESPACE = "fp8_lightning"
EAGER = types.SimpleNamespace()  # op name -> its implementation, called directly by eager code on plain tensors
HOT_OPS: dict[str, "HotOp"] = {}  # op name -> its declaration


class HotOp:
    """One declared operation: its implementation (``EAGER.<name>``), its fake and its custom op."""

    __slots__ = ("name", "custom", "fake")

    def __init__(self, name: str, impl: Callable, fake: Callable):
        self.name, self.fake = name, fake
        setattr(EAGER, name, impl)
        self.custom = custom_op(f"{NAMESPACE}::{name}", impl, mutates_args=())
        self.custom.register_fake(fake)

    @property
    def impl(self) -> Callable:
        return getattr(EAGER, self.name)

    def __call__(self, *args, **kwargs):
        """Always through the custom op (the traced layer step's ops: ``torch.compile`` sees them)."""
        return self.custom(*args, **kwargs)

    def for_tensor(self, x: torch.Tensor) -> Callable:
        """The implementation for a plain tensor in eager code, else the custom op (see the module docstring)."""
        if type(x) is torch.Tensor and not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0:
            return getattr(EAGER, self.name)
        return self.custom


def hot_op(name: str, fake: Callable) -> Callable[[Callable], HotOp]:
    """Declare ``fp8_lightning::name``: the decorated function is its implementation (functional: it allocates its
    outputs and mutates nothing), ``fake`` describes the outputs' shapes and dtypes for tracing."""

    def declare(impl: Callable) -> HotOp:
        if name in HOT_OPS:
            raise ValueError(f"the hot operation {name!r} is declared twice; each operation has one declaration.")
        HOT_OPS[name] = HotOp(name, impl, fake)
        return HOT_OPS[name]

    return declare
