"""Rows sorted into groups (each expert's tokens): their bounds on the host, the padded token layout of the grouped
GEMMs (on the host, and as device tensors derived from ``offs`` so that a kernel can read them without the host
waiting), and the containers of the grouped operands with the small protocol the emulated GEMMs call.

``offs`` follows ``torch._grouped_mm``: int32, the cumulative end row of each group. A layout that pads each group to
a multiple of ``align`` positions gives an empty group ``align`` positions (zeros), as the grouped kernel needs each
group non-empty.
"""

from __future__ import annotations

import collections.abc
import functools
import itertools
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from fp8_lightning.quantize import OperandCache, Quantized


class GroupBounds(list):
    """Each group's (start, end) row, a list of pairs on the host, with ``offs`` the int32 cumulative ends (on the
    tensors' device) they were read from."""

    def __init__(self, pairs, offs: torch.Tensor | None = None):
        super().__init__(pairs)
        self.offs = offs


def padded_group_sizes(bounds: list[tuple[int, int]], align: int) -> list[int]:
    """Each group's row count rounded up to ``align``, an empty group taking one aligned slot."""
    return [-(-max(end - start, 1) // align) * align for start, end in bounds]


class HostTokenLayout(NamedTuple):
    """The padded layout of :func:`host_token_layout`, host integers per group."""

    sizes: list[int]  # each group's rows
    padded: list[int]  # each group's length in the layout (:func:`padded_group_sizes`)
    starts: list[int]  # where each group begins in the layout


def host_token_layout(bounds: list[tuple[int, int]], align: int) -> HostTokenLayout:
    """Each group of ``bounds`` placed at a multiple of ``align``, padded to whole ``align`` positions (an empty group
    taking one aligned slot): the host's view of :func:`token_layout`, read from the bounds, not from ``offs``."""
    padded = padded_group_sizes(bounds, align)
    return HostTokenLayout([end - start for start, end in bounds], padded, [0, *itertools.accumulate(padded)][:-1])


class TokenLayout(NamedTuple):
    """The padded layout of :func:`token_layout`: int64 device tensors, per group (E,) and per row (M,)."""

    starts: torch.Tensor  # each group's first row of x
    counts: torch.Tensor  # each group's rows
    sizes: torch.Tensor  # each group's length in the layout: counts rounded up to align, an empty group align
    ends: torch.Tensor  # each group's end in the layout (ends - sizes: where it begins)
    group: torch.Tensor | None  # each row's group (None without rows)
    dest: torch.Tensor | None  # each row's place in the layout (None without rows)


def token_layout(offs: torch.Tensor, align: int, rows: int | None = None) -> TokenLayout:
    """Each group of ``offs`` (cumulative ends, on any device) placed at a multiple of ``align``, padded with zeros to
    whole ``align`` positions (an empty group taking one aligned slot), and with ``rows`` where each row goes: device
    operations only, no read of ``offs`` on the host. :func:`host_token_layout` gives the same layout from bounds."""
    ends = offs.to(torch.int64)
    starts = F.pad(ends[:-1], (1, 0))
    counts = ends - starts
    sizes = (counts.clamp(min=1) + (align - 1)) // align * align
    out_ends = torch.cumsum(sizes, 0)
    if rows is None:
        return TokenLayout(starts, counts, sizes, out_ends, None, None)
    row = torch.arange(rows, device=offs.device)
    group = torch.searchsorted(ends, row, right=True)
    return TokenLayout(starts, counts, sizes, out_ends, group, row + (out_ends - sizes - starts)[group])


def group_ends(bounds: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """The groups' cumulative ends on ``device``: the ``offs`` the bounds were read from, or (bounds without them) a
    tensor of their ends (a copy from the host, which does not wait)."""
    offs = getattr(bounds, "offs", None)
    if offs is not None:
        return offs.to(device)
    return torch.tensor([end for _, end in bounds], dtype=torch.int32, device=device)


def device_layout(
    offs: torch.Tensor, align: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(starts, rows, out_starts, out_ends)`` of :func:`token_layout` as the grouped cast kernel takes them: each
    group's first row and row count (int32), and its first position (int64) and end (int32) in the layout."""
    layout = token_layout(offs, align)
    return (layout.starts.to(torch.int32), layout.counts.to(torch.int32), layout.ends - layout.sizes,
            layout.ends.to(torch.int32))  # fmt: skip


def padded_rows(offs: torch.Tensor, rows: int, align: int) -> tuple[torch.Tensor, int]:
    """(where each of ``rows`` rows goes in :func:`token_layout`'s layout, that layout's length upper bound): device
    operations only, and a length that depends on ``rows`` and the number of groups alone, so a traced graph holds
    one shape whatever the group sizes (the rows past the last group are zeros)."""
    return token_layout(offs, align, rows).dest, -(-rows // align) * align + offs.numel() * align


def uniform_layout(
    groups: int, rows: int, out_stride: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`device_layout`'s tensors for ``groups`` groups of ``rows`` rows each (the rows of stacked expert
    weights), group ``g`` written from ``g * out_stride``."""
    index = torch.arange(groups, device=device)
    return (index * rows).to(torch.int32), torch.full_like(index, rows, dtype=torch.int32), index * out_stride


def group_bounds(offs: torch.Tensor, rows: int, experts: int) -> GroupBounds:
    """Each group's (start, end) row from ``offs``, checked: int32, 1-D, one entry per expert, non-decreasing, ending
    at the number of rows. The one read of ``offs`` on the host."""
    if not torch.is_tensor(offs) or offs.dtype != torch.int32 or offs.dim() != 1:
        got = f"{offs.dtype} tensor of shape {tuple(offs.shape)}" if torch.is_tensor(offs) else type(offs).__name__
        raise TypeError(
            f"fp8_grouped_mm: offs must be a 1-D int32 tensor of cumulative group ends (torch._grouped_mm's "
            f"convention); got a {got}. Build it with torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)."
        )
    if offs.numel() != experts:
        raise ValueError(
            f"fp8_grouped_mm: offs has {offs.numel()} entries but b holds {experts} experts; pass one cumulative "
            "end per expert (0 tokens for an expert repeats the previous end)."
        )
    if offs.device.type == "meta":
        raise ValueError("fp8_grouped_mm: offs is on the meta device, which holds no values; the group bounds are read "
                         "from it. Pass offs on the tokens' device (or the CPU).")
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if any(end < start for start, end in zip(starts, ends)) or (ends and ends[0] < 0):
        raise ValueError(
            f"fp8_grouped_mm: offs={ends} is not non-decreasing from 0; it must hold cumulative token counts, with "
            "the tokens of a sorted by expert."
        )
    if (ends[-1] if ends else 0) != rows:
        raise ValueError(
            f"fp8_grouped_mm: offs ends at {ends[-1] if ends else 0} but a has {rows} rows; the groups must cover "
            "every row of a (drop unrouted rows from a, or add them to a group)."
        )
    return GroupBounds(zip(starts, ends), offs)


# ------------------------------------------------------------------------------------------------------------
# The operand containers and their protocol: what the emulated grouped GEMMs ask of them
# ------------------------------------------------------------------------------------------------------------


class GroupOperands(collections.abc.Sequence):
    """Every group's wgrad operand of ``x[start:end].T`` (None for an empty group), as
    :meth:`~fp8_lightning.recipes.base.Recipe.grouped_operands` returns them, made on first use (``_views``) from
    casts of all the groups at once, which the weight-gradient GEMM reads whole (:meth:`wgrad_values`). A plain list
    of per-group operands is the other form a recipe may return."""

    def __getitem__(self, index):
        return self._views[index]

    def token_values(self) -> torch.Tensor:
        """The float32 values (K, M) of every group's operand side by side in ``x``'s row order."""
        raise NotImplementedError(f"{type(self).__name__} defines neither token_values() nor wgrad_values()")

    def wgrad_values(self, offs: torch.Tensor, bounds: list[tuple[int, int]]):
        """``(values, offs, bounds)`` of the weight-gradient product ``g.T @ x``: the float32 values (K, L) of every
        group's operand side by side, and the groups' ends and bounds along L that the product reduces over. By
        default the operands' values in ``x``'s row order (:meth:`token_values`) with the tokens' ``offs`` and
        ``bounds``: padding that holds zeros adds nothing to a product."""
        return self.token_values(), offs, bounds


class ExpertOperands(collections.abc.Sequence):
    """Each expert's (W_e, W_e.T) operands, as :meth:`~fp8_lightning.recipes.base.Recipe.grouped_weight_operands`
    returns them, made on first use (``_pairs``) from casts of all the experts at once, which the emulated GEMMs read
    whole (:meth:`gemm_values`). A plain list of per-expert pairs is the other form a recipe may return."""

    def __getitem__(self, index):
        return self._pairs[index]

    def values(self) -> torch.Tensor:
        """Every W_e's float32 values (E, N, K)."""
        raise NotImplementedError(f"{type(self).__name__} does not define values()")

    def transposed_values(self) -> torch.Tensor:
        """The values of every W_e.T operand, transposed back to (E, N, K)."""
        raise NotImplementedError(f"{type(self).__name__} does not define transposed_values()")

    def gemm_values(self, transposed: bool) -> torch.Tensor:
        """The experts' float32 values as the grouped GEMMs multiply them (contiguous): (E, K, N) from the W_e
        operands (fprop), or with ``transposed`` (E, N, K) from the W_e.T operands (dgrad)."""
        if transposed:
            return self.transposed_values().contiguous()
        return self.values().transpose(1, 2).contiguous()


def wgrad_values(columns, offs: torch.Tensor, bounds: list[tuple[int, int]]):
    """:meth:`GroupOperands.wgrad_values` of ``columns``; None for a plain list of per-group operands, which the
    caller multiplies group by group."""
    return columns.wgrad_values(offs, bounds) if isinstance(columns, GroupOperands) else None


def expert_gemm_values(operands, transposed: bool) -> torch.Tensor | None:
    """:meth:`ExpertOperands.gemm_values` of ``operands``; None for a plain list of per-expert pairs, which the caller
    dequantizes expert by expert."""
    return operands.gemm_values(transposed) if isinstance(operands, ExpertOperands) else None


class StackedWeights(ExpertOperands):
    """Each expert's (W_e, W_e.T) operands (views) from the two stacked casts: ``rows`` (E * N, K) and ``columns``
    (E * K, N), each with one scale row per row of codes (rowwise, MX). ``columns`` may be a function that makes
    them, called on first use (a forward that needs only ``rows`` then makes no W.T copy)."""

    def __init__(self, rows: Quantized, columns: Quantized | Callable[[], Quantized], experts: int):
        self.rows, self._columns, self.experts = rows, columns, experts

    @property
    def columns(self) -> Quantized:
        if callable(self._columns):
            self._columns = self._columns()
        return self._columns

    @functools.cached_property
    def _pairs(self) -> list[tuple[Quantized, Quantized]]:
        n, k = self.rows.data.shape[0] // self.experts, self.columns.data.shape[0] // self.experts
        return [(_rows_of(self.rows, e * n, n), _rows_of(self.columns, e * k, k)) for e in range(self.experts)]

    def __len__(self) -> int:
        return self.experts

    def values(self) -> torch.Tensor:
        """Every W_e's float32 values (E, N, K) from one dequantization of the stacked rows."""
        return self.rows.kind.dequantize(self.rows, torch.float32).reshape(self.experts, -1, self.rows.data.shape[1])

    def transposed_values(self) -> torch.Tensor:
        """The values of every W_e.T operand (its own scales), transposed back to (E, N, K)."""
        values = self.columns.kind.dequantize(self.columns, torch.float32)
        return values.reshape(self.experts, -1, values.shape[1]).transpose(1, 2)


def _rows_of(q: Quantized, start: int, count: int) -> Quantized:
    """Rows ``start`` to ``start + count`` of a stacked operand and of its scales (views): one expert's part."""
    return Quantized(q.data[start : start + count], q.scale[start : start + count], q.kind)


class ExpertTensorWeights(ExpertOperands):
    """Each expert's (W_e, W_e.T) operands under one scale per expert (views) from the one cast they come from:
    ``codes`` (E, N, K), ``scale`` and ``inverse`` (``1 / scale``), each (E,)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, inverse: torch.Tensor, kind):
        self.codes, self.scale, self.inverse, self.kind = codes, scale, inverse, kind

    @functools.cached_property
    def _pairs(self) -> list[tuple[Quantized, Quantized]]:
        pairs = []
        for codes, scale, inverse in zip(self.codes.unbind(0), self.scale.unbind(0), self.inverse.unbind(0)):
            q = Quantized(codes, scale, self.kind, OperandCache(inverse=inverse))
            pairs.append((q, q.t()))
        return pairs

    def __len__(self) -> int:
        return self.codes.shape[0]

    def values(self) -> torch.Tensor:
        """Every W_e's float32 values (E, N, K), in one pass: what each expert's operand dequantizes to."""
        experts, n, k = self.codes.shape
        whole = Quantized(self.codes.reshape(experts, n * k), self.scale.reshape(experts, 1), self.kind)
        return self.kind.dequantize(whole, torch.float32).reshape(experts, n, k)

    transposed_values = values  # W_e.T's operand holds the same codes and scale


class ExpertBlockWeights(ExpertOperands):
    """Each expert's (W_e, W_e.T) operands under 128x128 blocks (views), from one cast of the experts stacked with each
    expert's N rows padded to whole blocks: ``rows`` (E * N', K) and ``columns`` (K, E * N'), W.T's operand from the
    same blocks; ``n`` each expert's rows, ``block`` the block edge."""

    def __init__(self, rows: Quantized, columns: Quantized, experts: int, n: int, block: int):
        self.rows, self.columns, self.experts, self.n, self.block = rows, columns, experts, n, block

    @functools.cached_property
    def _pairs(self) -> list[tuple[Quantized, Quantized]]:
        padded, blocks = self.rows.data.shape[0] // self.experts, -(-self.n // self.block)
        rows, columns, kind, pairs = self.rows, self.columns, self.rows.kind, []
        for e in range(self.experts):
            first, scales = e * padded, slice(e * blocks, (e + 1) * blocks)
            pairs.append((Quantized(rows.data[first : first + self.n], rows.scale[scales], kind),
                          Quantized(columns.data[:, first : first + self.n], columns.scale[:, scales], kind)))
        return pairs

    def __len__(self) -> int:
        return self.experts

    def values(self) -> torch.Tensor:
        """Every W_e's float32 values (E, N, K) from one dequantization of the stacked cast."""
        values = self.rows.kind.dequantize(self.rows, torch.float32)
        return values.reshape(self.experts, -1, values.shape[1])[:, : self.n]

    def transposed_values(self) -> torch.Tensor:
        """The values of every W_e.T operand, transposed back to (E, N, K)."""
        values = self.columns.kind.dequantize(self.columns, torch.float32)  # (K, E * N')
        return values.reshape(values.shape[0], self.experts, -1)[:, :, : self.n].permute(1, 2, 0)


class PaddedGroupColumns(GroupOperands):
    """Every group's operand of ``x[start:end].T`` (a view; None for an empty group) from one cast of ``x``'s rows laid
    out with each group padded with zeros to whole tiles of ``align`` tokens (:func:`token_layout`): ``whole``, the
    operand of that layout's transpose (K, length); ``index`` (device) each token's position in the layout."""

    def __init__(self, whole: Quantized, index: torch.Tensor, bounds: list[tuple[int, int]], align: int):
        self.whole, self.index, self.align = whole, index, align
        self.sizes, _, self.starts = host_token_layout(bounds, align)

    @functools.cached_property
    def _views(self) -> list[Quantized | None]:
        whole, align = self.whole, self.align
        return [Quantized(whole.data[:, s : s + m], whole.scale[:, s // align : (s + m + align - 1) // align],
                          whole.kind) if m else None for s, m in zip(self.starts, self.sizes)]  # fmt: skip

    def __len__(self) -> int:
        return len(self.sizes)

    def token_values(self) -> torch.Tensor:
        """The float32 values (K, M) of every group's operand side by side in ``x``'s row order."""
        return self.whole.kind.dequantize(self.whole, torch.float32).index_select(1, self.index)


class RowGroupColumns(GroupOperands):
    """Every group's operand of ``x[start:end].T`` under one scale for the whole tensor: views of ``row``, the cast of
    ``x`` (M, K), made on first use (None for an empty group)."""

    def __init__(self, row: Quantized, bounds: list[tuple[int, int]]):
        self.row, self.bounds = row, bounds

    @functools.cached_property
    def _views(self) -> list[Quantized | None]:
        row = self.row
        return [None if start == end else Quantized(row.data[start:end].t(), row.scale, row.kind)
                for start, end in self.bounds]  # fmt: skip

    def __len__(self) -> int:
        return len(self.bounds)

    def token_values(self) -> torch.Tensor:
        """The float32 values (K, M) of every group's operand side by side: ``x``'s values, transposed."""
        row = self.row
        return row.kind.dequantize(Quantized(row.data, row.scale, row.kind), torch.float32).t()
