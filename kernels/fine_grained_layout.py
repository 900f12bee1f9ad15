"""Where the rowwise and blockwise cast kernels write: the shapes and strides of their outputs, without Triton.

The kernels (:mod:`fp8_lightning.kernels.fine_grained_cast`) allocate their outputs from :func:`output_layouts`, and
the ``torch.library`` op's fake implementation (:mod:`fp8_lightning.kernels.ops`) describes them from it too, so
that tracing needs no Triton. A tile ``(rows, cols)`` is the window of the source ``x`` (M, K) that shares one
scale, 0 meaning the whole dimension: ``(1, 0)`` one scale per row, ``(0, 1)`` one per column (rowwise);
``(1, 128)``, ``(128, 1)``, ``(128, 128)`` (blockwise). Copies whose windows run down the columns of ``x`` come out
as the operand of ``x.T``: codes (K, M) row-major.

The scale layouts are those ``torch._scaled_mm`` reads on CUDA (``fp8_lightning.blockwise.blockwise_scaled_mm_args``
and ``fp8_lightning.rowwise.rowwise_scaled_mm_args``; ``tests/core`` checks them against torch's meta
implementation): one scale per row (lines, 1) contiguous; 1x128 and 128x1 tiles "outer-dim-major" (column-major);
128x128 blocks "inner-dim-major" with each row of scales padded to 16 bytes.
"""

from __future__ import annotations

BLOCKWISE_EDGE = 128  # a blockwise tile's long edge (fp8_lightning.blockwise.TILE)
ROWWISE_TILES = ((1, 0), (0, 1))  # one scale per row / per column
BLOCKWISE_TILES = ((1, BLOCKWISE_EDGE), (BLOCKWISE_EDGE, 1), (BLOCKWISE_EDGE, BLOCKWISE_EDGE))
TILES = ROWWISE_TILES + BLOCKWISE_TILES
SCALE_ROW_MULTIPLE = 4  # 128x128 scales: rows padded to 16 bytes


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def piece(tile: tuple[int, int], along_rows: bool) -> tuple[int, int]:
    """(BLOCK_LINES, CHUNK) of a launch: 4,096 elements, laid out so that the source's contiguous dimension is long
    (rows read 16 x 256, 32 x 128 for 1x128 tiles; columns 64 x 64; 128x128 blocks 128 lines x 32)."""
    if tile == (BLOCKWISE_EDGE, BLOCKWISE_EDGE):
        return BLOCKWISE_EDGE, 32
    if tile == (1, BLOCKWISE_EDGE):
        return 32, BLOCKWISE_EDGE
    return (16, 256) if along_rows else (64, 64)


def scale_layout(lines: int, windows: int, tile: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """(shape, strides) of the float32 scales of an operand with ``lines`` rows and ``windows`` windows per row, as
    cuBLAS reads them: (lines, 1) contiguous (rowwise), column-major (1x128, 128x1), inner-dim-major with rows
    padded to 16 bytes (128x128)."""
    if BLOCKWISE_EDGE not in tile:
        return (lines, windows), (windows, 1)
    if tile == (BLOCKWISE_EDGE, BLOCKWISE_EDGE):
        return (lines, windows), (ceil_div(windows, SCALE_ROW_MULTIPLE) * SCALE_ROW_MULTIPLE, 1)
    return (lines, windows), (1, lines)


def along_rows(tile: tuple[int, int]) -> bool:
    """Whether a tile's windows run along the rows of ``x`` (codes in x's layout), not down its columns."""
    return tile[0] == 1 or tile == (BLOCKWISE_EDGE, BLOCKWISE_EDGE)


def window_length(tile: tuple[int, int], length: int) -> int:
    """How many positions of a line of ``length`` share one scale."""
    edge = tile[1] if along_rows(tile) else tile[0]
    return length if edge == 0 else edge


def output_layouts(shape: tuple[int, int], tile: tuple[int, int], transpose: bool) -> dict:
    """(shape, strides) of each output of ``fine_grained_cast.fine_cast``: ``data`` and ``scale`` (its inverse has
    the same layout) and, with ``transpose`` (128x128 blocks), ``data_t`` and ``scale_t`` of the transposed copy."""
    rows, cols = shape
    lines, length = (rows, cols) if along_rows(tile) else (cols, rows)
    windows = ceil_div(length, window_length(tile, length)) if length else 0
    line_blocks = ceil_div(lines, BLOCKWISE_EDGE) if tile == (BLOCKWISE_EDGE, BLOCKWISE_EDGE) else lines
    layouts = {"data": ((lines, length), (length, 1)), "scale": scale_layout(line_blocks, windows, tile)}
    if transpose:
        layouts["data_t"] = ((length, lines), (lines, 1))
        layouts["scale_t"] = scale_layout(windows, line_blocks, tile)
    return layouts
