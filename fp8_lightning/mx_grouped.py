"""MXFP8 grouped GEMMs on CUDA sm_100: the arguments of ``torch._scaled_grouped_mm`` for the three expert GEMMs, as
pure functions of the operands the MXFP8 recipe casts, and the one grouped launch per GEMM that takes them.

torch 2.11 (``_scaled_grouped_mm_cuda`` in ``GroupedBlas.cpp``; MSLK's ``mx8mx8bf16_grouped_mm`` and
``set_grouped_gemm_args_kernel``, built into the cu130 wheel for sm_100a and sm_103a) runs an MXFP8 grouped GEMM when
both operands are ``float8_e4m3fn``, both scales ``float8_e8m0fnu`` (blocks of 32 along K) and the device is compute
capability 10.x; the output is bf16 only. Every scale tensor is in the blocked ``SWIZZLE_32_4_4`` layout, per group:

* 2-D x 3-D (fprop, dgrad): ``mat_a`` (M, K) row-major; its scales are each group's (m_g, K/32) block padded to
  (round_up(m_g, 128), round_up(K/32, 4)) and swizzled, groups back to back (an empty group takes none);
  ``mat_b`` (E, K, N) column-major with scales (E, round_up(N, 128) * round_up(K/32, 4)), each expert swizzled;
* 2-D x 2-D (wgrad): ``mat_a`` (N, M_pad), ``mat_b`` (M_pad, K) column-major, split along the tokens by ``offs``;
  every group a multiple of 32 tokens (a device-side assert), so each group is zero-padded to whole MX blocks (an
  empty group to 32 zero tokens, so that its output, which the kernel leaves unwritten for an empty group, is zero);
  scales per group (rows padded to 128, block columns to 4, swizzled), groups back to back.

The layouts are built by device operations from ``offs`` (no host loop over experts, one scatter per scale tensor).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from fp8_lightning.groups import GroupBounds, GroupOperands, StackedWeights, group_ends, host_token_layout, token_layout
from fp8_lightning.ops import dispatch
from fp8_lightning.quantize import MX, Quantized

MX_BLOCK = 32  # the kernel's block of K elements per E8M0 scale
ROW_TILE, COL_TILE = 128, 4  # the swizzled layout's tile: 128 rows by 4 block columns, 512 bytes
MX_MAX_GROUPS = 1024  # set_grouped_gemm_args_kernel<<<1, G>>>: one thread per group, in one block
MX_GROUPED_GEMM = "MSLK MXFP8 grouped GEMM (torch._scaled_grouped_mm, e8m0 SWIZZLE_32_4_4 scales)"


def _round_up(x, multiple: int):
    return (x + multiple - 1) // multiple * multiple


def tile_offsets(row: torch.Tensor, col: torch.Tensor, col_tiles) -> torch.Tensor:
    """Where scale (row, col) of a (rows, cols) block lies in its ``SWIZZLE_32_4_4`` layout with ``col_tiles`` tiles
    per tile row: 128x4 tiles in row-major order, each stored as 32x16 with row ``r`` at ``(r % 32, r // 32)``."""
    tile = (row // ROW_TILE) * col_tiles + col // COL_TILE
    inner = row % ROW_TILE
    return tile * (ROW_TILE * COL_TILE) + (inner % 32) * 16 + (inner // 32) * COL_TILE + col % COL_TILE


def _scatter(scale: torch.Tensor, offsets: torch.Tensor, size: int) -> torch.Tensor:
    out = torch.zeros(size, dtype=torch.uint8, device=scale.device)
    out.scatter_(0, offsets.reshape(-1), scale.contiguous().view(torch.uint8).reshape(-1))
    return out.view(scale.dtype)


def _group_starts(offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ends = offs.to(torch.int64)
    return F.pad(ends[:-1], (1, 0)), ends


def grouped_row_scales(scale: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The 2-D x 3-D ``scale_a``: ``scale`` (M, K/32) with rows grouped by ``offs``, each group's block at the sum of
    the previous groups' rows rounded up to 128, swizzled; (rows, round_up(K/32, 4)) with rows an upper bound of
    that sum that depends on M and the number of groups only (device operations, no read of ``offs``)."""
    rows, blocks = scale.shape
    cols = _round_up(blocks, COL_TILE)
    starts, ends = _group_starts(offs)
    padded_starts_ = torch.cumsum(_round_up(ends - starts, ROW_TILE), 0) - _round_up(ends - starts, ROW_TILE)
    row = torch.arange(rows, device=scale.device)
    group = torch.searchsorted(ends, row, right=True)
    local = (row - starts[group]).unsqueeze(1)
    base = (padded_starts_[group] * cols).unsqueeze(1)
    col = torch.arange(blocks, device=scale.device).unsqueeze(0)
    bound = _round_up(rows, ROW_TILE) + ROW_TILE * offs.shape[0]
    return _scatter(scale, base + tile_offsets(local, col, cols // COL_TILE), bound * cols).view(bound, cols)


def stacked_scales(scale: torch.Tensor, experts: int) -> torch.Tensor:
    """The 3-D ``scale_b``: ``scale`` (E * R, K/32) of stacked experts, each expert's (R, K/32) block padded to
    (round_up(R, 128), round_up(K/32, 4)) and swizzled: (E, round_up(R, 128) * round_up(K/32, 4))."""
    rows, blocks = scale.shape
    per_expert, cols = rows // experts, _round_up(blocks, COL_TILE)
    chunk = _round_up(per_expert, ROW_TILE) * cols
    row = torch.arange(rows, device=scale.device).unsqueeze(1)
    col = torch.arange(blocks, device=scale.device).unsqueeze(0)
    offsets = (row // per_expert) * chunk + tile_offsets(row % per_expert, col, cols // COL_TILE)
    return _scatter(scale, offsets, experts * chunk).view(experts, chunk)


def grouped_column_scales(scale: torch.Tensor, padded_offs: torch.Tensor, chunk_cols: int) -> torch.Tensor:
    """The 2-D x 2-D scales: ``scale`` (R, M_pad/32) whose block columns are grouped by ``padded_offs`` (token ends,
    multiples of 32), each group's (R, c_g) block padded to (round_up(R, 128), round_up(c_g, 4)) and swizzled,
    groups back to back: (round_up(R, 128), ``chunk_cols``), ``chunk_cols`` the sum of the rounded c_g."""
    rows, blocks = scale.shape
    rows_padded = _round_up(rows, ROW_TILE)
    starts, ends = _group_starts(padded_offs)
    block_starts, block_counts = starts // MX_BLOCK, (ends - starts) // MX_BLOCK
    chunk = _round_up(block_counts, COL_TILE)
    chunk_starts = torch.cumsum(chunk, 0) - chunk
    col = torch.arange(blocks, device=scale.device)
    group = torch.searchsorted(ends // MX_BLOCK, col, right=True)
    local = (col - block_starts[group]).unsqueeze(0)
    base = (rows_padded * chunk_starts[group]).unsqueeze(0)
    row = torch.arange(rows, device=scale.device).unsqueeze(1)
    offsets = base + tile_offsets(row, local, (chunk[group] // COL_TILE).unsqueeze(0))
    return _scatter(scale, offsets, rows_padded * chunk_cols).view(rows_padded, chunk_cols)


class MXGroupedColumns(GroupOperands):
    """Every group's MX copy of ``x[start:end].T`` (blocks along the group's tokens) from one cast: a sequence of
    per-group operands (None for an empty group), as :meth:`~fp8_lightning.recipes.base.Recipe.grouped_operands`
    returns them, made on first use, and the whole layout the 2-D x 2-D grouped GEMM reads: ``codes_t`` (K, M_pad)
    with each group's tokens at its padded start (multiples of 32) and zeros between, ``scale`` (K, M_pad/32), ``offs``
    the padded ends (int32, on the device), ``index`` (device) each token's position in the layout,
    ``starts``/``sizes``/``padded`` on the host."""

    def __init__(self, codes_t, scale, offs, starts, sizes, padded, index=None):
        self.codes_t, self.scale, self.offs, self.index = codes_t, scale, offs, index
        self.starts, self.sizes, self.padded = starts, sizes, padded

    @functools.cached_property
    def _views(self) -> list[Quantized | None]:
        block = self.codes_t.shape[1] // max(self.scale.shape[1], 1)
        return [Quantized(self.codes_t[:, s : s + p].contiguous(), self.scale[:, s // block : (s + p) // block]
                          .contiguous(), MX) if m else None
                for s, m, p in zip(self.starts, self.sizes, self.padded)]  # fmt: skip

    def __len__(self) -> int:
        return len(self.sizes)

    def token_values(self) -> torch.Tensor:
        """The float32 values (K, M) of every group's operand side by side in ``x``'s row order, from one
        dequantization of the whole layout: the groups' values as the weight-gradient GEMM reduces them."""
        values = dispatch.operand_f32(Quantized(self.codes_t, self.scale, MX))
        return values.index_select(1, self.index)

    def scale_columns(self) -> int:
        """The block columns of :func:`grouped_column_scales`: each group's blocks rounded up to 4."""
        block = self.codes_t.shape[1] // max(self.scale.shape[1], 1)
        return sum(_round_up(p // block, COL_TILE) for p in self.padded)


def grouped_mx_columns(
    x: torch.Tensor, bounds: GroupBounds, dtype: torch.dtype, block_size: int, scale_rounding: str
) -> MXGroupedColumns:
    """Every group's columnwise MX copy of ``x`` (M, K) from one cast, whatever the number of groups: the rows copied
    into a layout where each group starts at a multiple of ``block_size`` (an empty group holding one block of zeros)
    and that layout cast along the tokens, so every block lies in one group: the bits of casting each group's
    ``x[start:end]`` on its own (zero-padded to whole blocks)."""
    sizes, padded, starts = host_token_layout(bounds, block_size)
    layout = token_layout(group_ends(bounds, x.device), block_size, x.shape[0])
    layout_rows = x.detach().new_zeros(sum(padded), x.shape[1]).index_copy_(0, layout.dest, x.detach())
    q = dispatch.fast_quantize_mx_columns(layout_rows, block_size, scale_rounding, dtype)  # (K, M_pad), along M
    return MXGroupedColumns(q.data.contiguous(), q.scale.contiguous(), layout.ends.to(torch.int32), starts, sizes,
                            padded, layout.dest)  # fmt: skip


def mx_fprop_args(x: Quantized, weights: StackedWeights, offs: torch.Tensor):
    """``(mat_a, mat_b, scale_a, scale_b)`` of ``y_e = x_e @ W_e.T``: the (M, K) codes with per-group swizzled
    scales, and the (E, K, N) column-major view of the stacked (E * N, K) weight codes with per-expert scales."""
    rows, experts = weights.rows, weights.experts
    n = rows.data.shape[0] // experts
    mat_b = rows.data.reshape(experts, n, -1).transpose(1, 2)
    return x.data.contiguous(), mat_b, grouped_row_scales(x.scale, offs), stacked_scales(rows.scale, experts)


def mx_dgrad_args(g: Quantized, weights: StackedWeights, offs: torch.Tensor):
    """``(mat_a, mat_b, scale_a, scale_b)`` of ``dx_e = g_e @ W_e``: the (M, N) gradient codes, and the (E, N, K)
    column-major view of the stacked transposed weights (E * K, N), blocks along N."""
    columns, experts = weights.columns, weights.experts
    k = columns.data.shape[0] // experts
    mat_b = columns.data.reshape(experts, k, -1).transpose(1, 2)
    return g.data.contiguous(), mat_b, grouped_row_scales(g.scale, offs), stacked_scales(columns.scale, experts)


def mx_wgrad_args(g_columns: MXGroupedColumns, x_columns: MXGroupedColumns):
    """``(mat_a, mat_b, scale_a, scale_b, offs)`` of ``dW_e = g_e.T @ x_e``: the (N, M_pad) gradient codes, the
    (M_pad, K) column-major view of the input's (K, M_pad) codes, their per-group swizzled scales and the padded
    group ends."""
    chunk_cols = g_columns.scale_columns()
    scale_a = grouped_column_scales(g_columns.scale, g_columns.offs, chunk_cols)
    scale_b = grouped_column_scales(x_columns.scale, x_columns.offs, chunk_cols)
    return g_columns.codes_t, x_columns.codes_t.t(), scale_a, scale_b, g_columns.offs


class MXGroupedGemm:
    """The three expert GEMMs of the MXFP8 recipe as one ``torch._scaled_grouped_mm`` launch each (bf16 out, the
    kernel's only output dtype, converted to the requested one)."""

    def fprop(self, x: Quantized, weights: StackedWeights, offs: torch.Tensor, out_dtype: torch.dtype):
        return _launch(*mx_fprop_args(x, weights, offs), offs).to(out_dtype)

    def dgrad(self, g: Quantized, weights: StackedWeights, offs: torch.Tensor, out_dtype: torch.dtype):
        return _launch(*mx_dgrad_args(g, weights, offs), offs).to(out_dtype)

    def wgrad(self, g_columns: MXGroupedColumns, x_columns: MXGroupedColumns, out_dtype: torch.dtype):
        return _launch(*mx_wgrad_args(g_columns, x_columns)).to(out_dtype)


def _launch(mat_a, mat_b, scale_a, scale_b, offs) -> torch.Tensor:
    return torch._scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16)


@functools.lru_cache(maxsize=None)
def _device_reason(device: torch.device) -> str | None:
    """Why this device cannot run torch's MXFP8 grouped GEMM, from torch's API, the capability and one 32-token probe
    call (a build without MSLK / FBGEMM GenAI raises, a kernel not built for the device fails to launch)."""
    if not (hasattr(torch, "_scaled_grouped_mm") and hasattr(torch, "float8_e8m0fnu")):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm with float8_e8m0fnu scales"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 10:
        return (f"sm_{major}{minor}: torch's MXFP8 grouped GEMM (MSLK, CUTLASS sm_100 block-scaled) needs compute "
                "capability 10.x")
    try:
        out = probe(device)
    except (RuntimeError, NotImplementedError, ValueError) as err:
        return f"this torch build cannot run the MXFP8 grouped GEMM: {str(err).splitlines()[0]}"
    if not bool((out == MX_BLOCK).all()):
        return "the MXFP8 grouped GEMM's probe call gave wrong values (32 expected)"
    return None


def probe(device: torch.device) -> torch.Tensor:
    """One 2-D x 3-D call of 32 tokens, K = N = 32, codes and scales of 1: every output is 32."""
    one = torch.ones(32, 32, device=device).to(torch.float8_e4m3fn)
    unit = torch.full((ROW_TILE * COL_TILE,), 127, dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu)
    offs = torch.tensor([32], dtype=torch.int32, device=device)
    out = _launch(one, one.t().unsqueeze(0), unit.view(ROW_TILE, COL_TILE), unit.view(1, -1), offs)
    torch.cuda.synchronize(device)
    return out


def mx_native_unavailable_reason(device: torch.device, experts: int) -> str | None:
    """Why the MXFP8 grouped GEMMs cannot run as ``torch._scaled_grouped_mm`` on ``device``, or None."""
    if device.type != "cuda":
        return f"{device.type}: the MXFP8 grouped kernel is CUDA's"
    if experts > MX_MAX_GROUPS:
        return f"{experts} experts: torch's MXFP8 grouped kernel takes at most {MX_MAX_GROUPS} groups"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_reason(torch.device("cuda", index))
