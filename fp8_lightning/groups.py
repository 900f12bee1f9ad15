"""Rows sorted into groups (each expert's tokens): their bounds on the host, and the padded layout of the grouped
GEMMs as device tensors derived from the same ``offs``, so that a kernel can read them without the host waiting.

``offs`` follows ``torch._grouped_mm``: int32, the cumulative end row of each group. A layout that pads each group to
a multiple of ``align`` positions gives an empty group ``align`` positions (zeros), as the grouped kernel needs each
group non-empty.
"""

from __future__ import annotations

import collections.abc
import functools
import itertools

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


def padded_starts(padded_sizes: list[int]) -> list[int]:
    """Where each group begins in the layout of :func:`padded_group_sizes` (host integers)."""
    return [0, *itertools.accumulate(padded_sizes)][:-1] if padded_sizes else []


def device_layout(
    offs: torch.Tensor, align: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(starts, rows, out_starts, out_ends)`` on ``offs``' device: each group's first row and row count (int32),
    and its first position (int64) and end (int32) in the layout padded to ``align``, from ``offs`` by device
    operations only."""
    ends = offs.to(torch.int64)
    starts = F.pad(ends[:-1], (1, 0))
    rows = ends - starts
    sizes = (rows.clamp(min=1) + align - 1) // align * align
    out_ends = torch.cumsum(sizes, 0)
    return starts.to(torch.int32), rows.to(torch.int32), out_ends - sizes, out_ends.to(torch.int32)


def padded_rows(offs: torch.Tensor, rows: int, align: int) -> tuple[torch.Tensor, int]:
    """(where each of ``rows`` rows goes in :func:`device_layout`'s layout padded to ``align``, that layout's length
    upper bound): device operations only, and a length that depends on ``rows`` and the number of groups alone, so
    a traced graph holds one shape whatever the group sizes (the rows past the last group are zeros)."""
    starts, _, out_starts, _ = device_layout(offs, align)
    row = torch.arange(rows, device=offs.device)
    group = torch.searchsorted(offs.to(torch.int64), row, right=True)  # the group of each row
    return out_starts[group] + (row - starts[group]), -(-rows // align) * align + offs.numel() * align


def uniform_layout(
    groups: int, rows: int, out_stride: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`device_layout`'s tensors for ``groups`` groups of ``rows`` rows each (the rows of stacked expert
    weights), group ``g`` written from ``g * out_stride``."""
    index = torch.arange(groups, device=device)
    return (index * rows).to(torch.int32), torch.full_like(index, rows, dtype=torch.int32), index * out_stride


class StackedWeights(collections.abc.Sequence):
    """Each expert's (W_e, W_e.T) operands (views), as
    :meth:`~fp8_lightning.recipes.base.Recipe.grouped_weight_operands` returns them, made on first use (a grouped
    kernel reads only the stacked casts), and the two stacked casts they are views of: ``rows`` (E * N, K) and
    ``columns`` (E * K, N), each with one scale row per row of codes (rowwise, MX)."""

    def __init__(self, rows: Quantized, columns: Quantized, experts: int):
        self.rows, self.columns, self.experts = rows, columns, experts

    @functools.cached_property
    def _pairs(self) -> list[tuple[Quantized, Quantized]]:
        n, k = self.rows.data.shape[0] // self.experts, self.columns.data.shape[0] // self.experts
        return [(_rows_of(self.rows, e * n, n), _rows_of(self.columns, e * k, k)) for e in range(self.experts)]

    def __getitem__(self, index):
        return self._pairs[index]

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


class ExpertTensorWeights(collections.abc.Sequence):
    """Each expert's (W_e, W_e.T) operands under one scale per expert, as
    :meth:`~fp8_lightning.recipes.base.Recipe.grouped_weight_operands` returns them, made on first use (views), and
    the one cast they come from: ``codes`` (E, N, K), ``scale`` and ``inverse`` (``1 / scale``), each (E,)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, inverse: torch.Tensor, kind):
        self.codes, self.scale, self.inverse, self.kind = codes, scale, inverse, kind

    @functools.cached_property
    def _pairs(self) -> list[tuple[Quantized, Quantized]]:
        pairs = []
        for codes, scale, inverse in zip(self.codes.unbind(0), self.scale.unbind(0), self.inverse.unbind(0)):
            q = Quantized(codes, scale, self.kind, OperandCache(inverse=inverse))
            pairs.append((q, q.t()))
        return pairs

    def __getitem__(self, index):
        return self._pairs[index]

    def __len__(self) -> int:
        return self.codes.shape[0]

    def values(self) -> torch.Tensor:
        """Every W_e's float32 values (E, N, K), in one pass: what each expert's operand dequantizes to."""
        experts, n, k = self.codes.shape
        whole = Quantized(self.codes.reshape(experts, n * k), self.scale.reshape(experts, 1), self.kind)
        return self.kind.dequantize(whole, torch.float32).reshape(experts, n, k)

    transposed_values = values  # W_e.T's operand holds the same codes and scale


class ExpertBlockWeights(collections.abc.Sequence):
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

    def __getitem__(self, index):
        return self._pairs[index]

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


class PaddedGroupColumns(collections.abc.Sequence):
    """Every group's operand of ``x[start:end].T`` (a view; None for an empty group) from one cast of ``x``'s rows laid
    out with each group padded with zeros to whole tiles of ``align`` tokens (:func:`device_layout`): ``whole``, the
    operand of that layout's transpose (K, length); ``index`` (device) each token's position in the layout."""

    def __init__(self, whole: Quantized, index: torch.Tensor, bounds: list[tuple[int, int]], align: int):
        self.whole, self.index, self.align = whole, index, align
        self.sizes = [end - start for start, end in bounds]
        self.starts = padded_starts(padded_group_sizes(bounds, align))

    @functools.cached_property
    def _views(self) -> list[Quantized | None]:
        whole, align = self.whole, self.align
        return [Quantized(whole.data[:, s : s + m], whole.scale[:, s // align : (s + m + align - 1) // align],
                          whole.kind) if m else None for s, m in zip(self.starts, self.sizes)]  # fmt: skip

    def __getitem__(self, index):
        return self._views[index]

    def __len__(self) -> int:
        return len(self.sizes)

    def token_values(self) -> torch.Tensor:
        """The float32 values (K, M) of every group's operand side by side in ``x``'s row order: the groups' values
        as the weight-gradient GEMM reduces them."""
        return self.whole.kind.dequantize(self.whole, torch.float32).index_select(1, self.index)


class RowGroupColumns(collections.abc.Sequence):
    """Every group's operand of ``x[start:end].T`` under one scale for the whole tensor: views of ``row``, the cast of
    ``x`` (M, K), made on first use (None for an empty group)."""

    def __init__(self, row: Quantized, bounds: list[tuple[int, int]]):
        self.row, self.bounds = row, bounds

    @functools.cached_property
    def _views(self) -> list[Quantized | None]:
        row = self.row
        return [None if start == end else Quantized(row.data[start:end].t(), row.scale, row.kind)
                for start, end in self.bounds]  # fmt: skip

    def __getitem__(self, index):
        return self._views[index]

    def __len__(self) -> int:
        return len(self.bounds)

    def token_values(self) -> torch.Tensor:
        """The float32 values (K, M) of every group's operand side by side: ``x``'s values, transposed."""
        row = self.row
        return row.kind.dequantize(Quantized(row.data, row.scale, row.kind), torch.float32).t()
