"""One layer's scaling for one recipe: its operands' scaling states and the per-step FP8 weight cache.

A training forward casts the weight once per optimizer step and reuses the cast across micro-batches. The cache is
keyed on the parameter's version counter, its storage and the weight scales' generation; edits through
``weight.data`` keep all three, so a reuse first compares a checksum of the weight's bits (on a CPU; on a GPU, where
that would stall the host, a reuse casts again). :class:`~fp8_lightning.linear.FP8Linear` holds one per recipe it
has run under; the grouped GEMM's :class:`~fp8_lightning.grouped.gemm.GroupedScaling` extends it per expert.
"""

from __future__ import annotations

from typing import Callable

import torch

from fp8_lightning.quantize import Quantized
from fp8_lightning.recipes import Recipe
from fp8_lightning.scaling import OperandScaling, advance_histories
from fp8_lightning.settings import settings


class LayerScaling:
    """Everything one layer keeps for one recipe: operand scaling states and the per-step FP8 weight cache.

    A training forward casts the weight once per optimizer step and reuses the cast across micro-batches (keyed on
    the parameter's version counter, which in-place updates of the parameter bump; on a GPU only with
    ``FP8_LIGHTNING_WEIGHT_CHECKSUM=0``, see below). An edit through ``weight.data``
    (an EMA swap, ``p.data.copy_``) leaves the version counter and the data pointer as they were, so a reuse first
    compares a checksum of the weight's bits with the one taken at the cast (:meth:`bits_checksum`; off with
    ``FP8_LIGHTNING_WEIGHT_CHECKSUM=0``). A layer takes checksums only once it has reused a cast: the first reuse
    casts again instead, so training without accumulation pays nothing. On a GPU, where comparing would make the
    host wait for the device, a reuse casts again instead (a cast reads the weight about as often as the checksum
    does). Evaluation and inference never keep or reuse a cast (inference tensors have no version counter at all).
    """

    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        fmt = recipe.fp8_format
        self.forward_dtype, self.backward_dtype = fmt.forward_dtype, fmt.backward_dtype
        self.operands: dict[str, OperandScaling] = recipe.operand_states(self.forward_dtype, self.backward_dtype)
        self._weight_key: tuple | None = None
        self._weight_cache: tuple[Quantized, Quantized | None] | None = None
        self._weight_checksum: tuple | None = None
        self.check_weight_bits = settings().weight_checksum  # False: trust the version counter alone
        self._reuses_casts = False  # a cast was once reused (gradient accumulation): casts take checksums
        self.weight_casts = 0

    @property
    def dirty(self) -> bool:
        return any(s.dirty for s in self.operands.values())

    @property
    def booked(self) -> bool:
        """:attr:`dirty` as eager casts know it (no tensor read: the hot path's check)."""
        return any(s._dirty for s in self.operands.values())

    def update(self) -> None:
        advance_histories(list(self.operands.values()))

    def move_to(self, device: torch.device) -> None:
        """Keep the scaling states on the weight's device (a meta weight has no values to follow)."""
        if device.type != "meta":
            for state in self.operands.values():
                state.move_to(device)

    def step_boundary_passed(self, weight: torch.Tensor, parameter: torch.Tensor | None = None) -> bool:
        """True when the weight changed in place (an optimizer step) since the cached cast. ``parameter``: whose
        version counter tells, where ``weight`` is its local shard (a DTensor's in-place updates do not bump the
        shard's own counter)."""
        version = (weight if parameter is None else parameter)._version
        return self._weight_key is not None and self._weight_key[:2] != (version, weight.data_ptr())

    # -- casts ------------------------------------------------------------------------------------------------

    def cast(
        self, role: str, x: torch.Tensor, record: bool, columnwise: bool = False, columnwise_f32: bool = True
    ) -> tuple[Quantized, Quantized | None]:
        """FP8 copies of a 2-D operand: rowwise (K last) and, when ``columnwise``, the copy of ``x.T`` where the
        recipe makes one from the high-precision tensor (MX, rowwise, blockwise: quantized along x's first
        dimension, from the same read of ``x``). Per-tensor recipes have no columnwise copy (None): they transpose
        the rowwise bytes, which with ``columnwise`` the cast kernels (CUDA) write in the same pass
        (``OperandCache.transposed``). ``columnwise_f32=False``: the columnwise copy is only saved."""
        dtype = self.backward_dtype if role == "grad_output" else self.forward_dtype
        return self.recipe.cast(role, x, dtype, columnwise, columnwise_f32, self.operands.get(role), record)

    def weight_operands(
        self, weight: torch.Tensor, record: bool, regathered: bool = False, parameter: torch.Tensor | None = None,
        replay: bool = False,
    ) -> tuple[Quantized, Quantized | None]:
        """(rowwise W, columnwise W where the recipe makes one): in training cast once per weight version and scale
        generation, in evaluation (``record=False``) cast afresh.

        ``regathered``: the weight was just all-gathered into a reused buffer (FSDP2 in high precision), which
        keeps its version counter: the cache cannot tell a new step's weight from the last one, so cast afresh.
        ``parameter``: as for :meth:`step_boundary_passed`. ``replay``: an activation-checkpoint recompute
        (:mod:`fp8_lightning.recompute`): the forward's cached cast while it is valid, else a cast that keeps nothing.
        """
        provided = getattr(weight, "fp8_weight_operands", None)  # already FP8 (e.g. gathered in FP8 by FSDP2)
        if provided is not None:  # W.T's copy only where backward cannot make it from the re-gathered weight
            regathered = getattr(weight, "fp8_regathered_for_backward", None)
            return provided(self, record, columnwise=regathered is None or not regathered(self))
        if regathered:
            self._weight_cache = None
        w_state = self.operands.get("weight")
        generation = w_state.generation if w_state else 0
        if replay and (forward := self.forward_cast(weight, generation, parameter)) is not None:
            return forward
        if not record:  # evaluation, inference and replays: cast afresh, keep nothing (see the class docstring)
            return self.cast("weight", weight.detach(), False, columnwise=True)
        cast = lambda: self.cast("weight", weight.detach(), record, True)  # noqa: E731
        return self.cached_weight(weight, generation, cast, parameter)

    def forward_cast(self, weight: torch.Tensor, generation, parameter: torch.Tensor | None = None):
        """The cached training cast while it is the cast of ``weight`` as it is now (same version, storage and scale
        generation), else None: what an activation-checkpoint recompute replays (the forward's own cast)."""
        key = ((weight if parameter is None else parameter)._version, weight.data_ptr(), generation, weight.device)
        return self._weight_cache if self._weight_cache is not None and key == self._weight_key else None

    def cached_weight(
        self, weight: torch.Tensor, generation, cast: Callable[[], tuple], parameter: torch.Tensor | None = None
    ) -> tuple:
        """The training cast of ``weight``: the cached one while nothing changed the weight or its scale since, else
        ``cast()``, kept as the new cache.

        Args:
            weight: the high-precision weight the GEMMs read.
            generation: the weight scales' generation (anything comparable; a new one means new scales).
            cast: makes the FP8 operands of ``weight``.
            parameter: the parameter whose version counter tells of in-place updates, where ``weight`` is its local
                shard (as for :meth:`step_boundary_passed`).

        Returns:
            What ``cast()`` returned, now or for the cached cast.
        """
        version = (weight if parameter is None else parameter)._version
        key = (version, weight.data_ptr(), generation, weight.device)
        if self._weight_cache is not None and key == self._weight_key:
            if not self.check_weight_bits:
                return self._weight_cache
            saved = self._weight_checksum
            if saved is not None:  # (the weight's views, their sums at the cast)
                views, sums = saved
                if all(torch.equal(now, then) for now, then in zip(_checksums(*views), sums)):
                    return self._weight_cache
            else:  # the first reuse: nothing to compare with, so cast again; checksum every cast from now on
                self._reuses_casts = True
        self._weight_checksum = None
        if self._reuses_casts and self.check_weight_bits and weight.is_cpu:
            views = _checksum_views(weight)
            self._weight_checksum = (views, _checksums(*views))
        self._weight_cache = cast()
        self._weight_key = key
        self.weight_casts += 1
        return self._weight_cache

    @staticmethod
    def bits_checksum(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two sums of ``weight``, each a single read in the weight's own width: its bit patterns added as integers
        (wrapping), which any change of one element moves, and its float sum, which scaling every element moves
        where the integer sum can wrap back. What neither sees is an edit that
        only permutes elements or whose changes cancel exactly in both sums.

        Args:
            weight: a floating-point tensor of 2, 4 or 8 bytes per element.

        Returns:
            The two sums, 0-d tensors on the weight's device (a NaN in the weight makes the float sum NaN, which
            equals nothing: such a weight is cast at every forward).
        """
        return _checksums(*_checksum_views(weight))

    # -- persistence ------------------------------------------------------------------------------------------

    def __getstate__(self) -> dict:
        """For pickle and deepcopy: the FP8 weight caches stay behind (float8 tensors do not unpickle; the next
        forward casts again)."""
        state = self.__dict__.copy()
        state["_weight_cache"] = state["_weight_key"] = state["_weight_checksum"] = None
        return state

    def state_dict(self) -> dict:
        return {"recipe": self.recipe.to_dict(), "operands": {k: s.state_dict() for k, s in self.operands.items()}}

    def load_state_dict(self, state: dict) -> None:
        loaded: set[int] = set()
        for role, s in self.operands.items():
            if id(s) in loaded:  # one state serving several roles (NVFP4's) loads once, from its first role
                continue
            s.load_state_dict(state["operands"][role])
            loaded.add(id(s))
        self._weight_cache = self._weight_key = self._weight_checksum = None


_SAME_WIDTH_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # the integer views bits_checksum sums


def _checksum_views(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight (detached) and its bits as integers of the same width: what :meth:`LayerScaling.bits_checksum`
    sums (made once per cast, then summed again at each reuse)."""
    w = weight.detach()
    return w, w.view(_SAME_WIDTH_INT[w.element_size()])


def _checksums(w: torch.Tensor, bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return bits.sum(dtype=bits.dtype), w.sum()


__all__ = ["LayerScaling"]
