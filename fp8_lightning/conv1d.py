"""FP8 for transformers' ``Conv1D``, the projection layer of GPT-2 and its relatives (GPT, ImageGPT, ...).

``transformers.pytorch_utils.Conv1D`` is a linear layer with its weight stored transposed: ``y = x @ W + b`` with
``W`` of shape ``(in, out)`` (attributes ``nx`` = in, ``nf`` = out). It is not an ``nn.Linear``, so a converter
that looks for ``nn.Linear`` alone leaves almost all of GPT-2 in high precision.

:class:`FP8Conv1D` converts it in place, as :class:`~fp8_lightning.linear.FP8Linear` converts a Linear: the same
module object and the same parameter, stored as before, so the ``state_dict`` (keys, shapes ``(in, out)``, dtypes)
is unchanged and checkpoints interchange with the unconverted model. The GEMMs take ``W.t()``, a view of the
parameter with the ``(out, in)`` shape an ``nn.Linear`` has (same storage and version counter, so the per-step
FP8 weight cache works as for a Linear); everything else (recipes, scaling state, fallbacks, traced path) is
FP8Linear's. The module is recognised by its class name and module, so ``transformers`` is never imported here.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fp8_lightning.linear import FP8Linear
from fp8_lightning.recipes import Recipe


def is_conv1d(module: nn.Module) -> bool:
    """True for ``transformers``' ``Conv1D`` (any version that keeps its ``nx``/``nf``/``weight (nx, nf)`` form)."""
    cls = type(module)
    if cls.__name__ != "Conv1D" or not cls.__module__.startswith("transformers"):
        return False
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and tuple(weight.shape) == (module.nx, module.nf)


class FP8Conv1D(FP8Linear):
    """``Conv1D`` with FP8 GEMMs inside :func:`~fp8_lightning.autocast.fp8_autocast`; build it with
    :meth:`from_conv1d` or :func:`~fp8_lightning.convert.convert_to_fp8`."""

    in_features = property(lambda self: self.nx)
    out_features = property(lambda self: self.nf)

    @classmethod
    def from_conv1d(cls, conv: nn.Module, recipe: Recipe, emulate: bool = False) -> "FP8Conv1D":
        """Turn ``conv`` into an FP8Conv1D in place (same object, same parameters) and return it."""
        if isinstance(conv, FP8Conv1D):
            return cls._adopt(conv, recipe, emulate)
        if not is_conv1d(conv):
            raise TypeError(f"FP8Conv1D.from_conv1d expects transformers' Conv1D; got {type(conv).__name__}.")
        conv.fp8_original_class = type(conv)
        return cls._adopt(conv, recipe, emulate)

    def to_linear(self) -> nn.Module:
        """Undo the conversion in place: the module becomes the ``Conv1D`` it was."""
        original = self.__dict__.pop("fp8_original_class")
        super().to_linear()
        self.__class__ = original
        return self

    @property
    def fp8_gemm_weight(self) -> torch.Tensor:
        return self.weight.t()

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}, recipe={type(self.fp8_recipe).__name__}"
