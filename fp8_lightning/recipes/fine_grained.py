"""What rowwise and blockwise scaling share: several copies of each operand, each cast from the high-precision
tensor along its own GEMM's reduction dimension, and no state between steps.

A subclass names its copies (:meth:`FineGrainedRecipe.fine_copies`); this family casts them with the backend's
``kernels.fine_cast`` (Triton, the C codec or the reference) in eager mode and with one custom op per copy when
traced, so both paths run the same casts.
"""

from __future__ import annotations

import dataclasses

from fp8_lightning.ops import dispatch
from fp8_lightning.ops.layer import traced_tile_cast
from fp8_lightning.recipes.base import Recipe
from fp8_lightning.traced import plan_for


@dataclasses.dataclass(frozen=True)
class FineGrainedRecipe(Recipe):
    """Base of the rowwise and blockwise recipes."""

    def fine_copies(self, role, x, dtype, columnwise, cast):
        """(operand of ``x``, operand of ``x.T`` when ``columnwise``) of a 2-D ``x`` in GEMM ``role``, each copy made
        by ``cast``, a function with ``kernels.fine_cast``'s signature."""
        raise NotImplementedError(f"{type(self).__name__} does not define fine_copies()")

    def cast(self, role, x, dtype, columnwise, columnwise_f32, state, record):
        return dispatch.fast_fine_operands(self, role, x, dtype, columnwise)

    def traced_plan(self, device, out_dtype, emulate):
        return self.fine_plan(device, out_dtype, emulate)

    def fine_plan(self, device, out_dtype, emulate, **fields):
        """The plan: the casts hand the GEMMs their inverse scales in the layouts they were written in."""
        return plan_for(self, device, out_dtype, emulate, inverses=True, **fields)

    def traced_cast(self, x, state, plan, role, dtype, columnwise, record):
        """The copies of :meth:`cast`, each through the traced op, with their inverse scales (None where a copy has
        none: a high-precision ``x.T`` or a tensorwise ``W.T``); the ones that are views (a weight's transposed
        blocks off CUDA, a high-precision ``x.T``) are made outside the ops, whose outputs may not alias."""
        row, col = self.fine_copies(role, x, dtype, columnwise, traced_tile_cast)
        if col is None:
            return row.data, row.scale, None, None, row.cache.inverse, None
        return row.data, row.scale, col.data, col.scale, row.cache.inverse, col.cache.inverse

    def cast_bytes_per_element(self) -> float:
        """Two copies per operand, each an amax pass and a cast pass over bf16 plus the codes, and a float32 scale
        per row or per 128 elements (counted as 4/128; a blockwise weight's second copy is a transpose of codes,
        which costs less)."""
        return 2 * (2 + 2 + 1 + 4 / 128)


__all__ = ["FineGrainedRecipe"]
