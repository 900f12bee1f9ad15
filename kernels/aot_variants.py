"""The launch space of the Triton kernels: every configuration the wrappers can launch, for ahead-of-time compiles.

:func:`launch_space` builds one :class:`Variant` per configuration from the wrappers' own constants (tile sizes,
block sizes, autotune configs), with the arguments typed and specialized the way a launch on contiguous tensors
specializes them (pointers 16-byte aligned, unit strides constant). :func:`pairwise_cover` picks a small set that
still meets every pair of option values. :mod:`fp8_lightning.kernels.aot` compiles them.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from fp8_lightning.formats import fp8_emax
from fp8_lightning.kernels.availability import SUPPORTED_INPUT_DTYPES as INPUT_DTYPES

# Ada (L4, L40, RTX 4090: FP8 mma.sync, no wgmma or TMA), Hopper, Blackwell.
TARGETS = {"sm_89": 89, "sm_90a": 90, "sm_100a": 100}
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_TYPE = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5", torch.uint8: "u8", torch.int8: "i8", torch.int16: "i16", torch.int32: "i32",
    torch.int64: "i64",
}


def ptr(dtype: torch.dtype) -> str:
    """Triton's signature type of a pointer to ``dtype``."""
    return "*" + _TYPE[dtype]


def short(dtype: torch.dtype) -> str:
    return _TYPE[dtype]


@dataclasses.dataclass(frozen=True)
class Variant:
    """One launch configuration: the kernel, each argument's type (a string) or constexpr value, and launch options."""

    kernel: str
    config: str  # human-readable: what distinguishes this variant
    args: tuple  # (name, "type" or constexpr value) in any order
    num_warps: int = 4
    num_stages: int = 3
    targets: tuple = tuple(TARGETS)  # the GPUs whose wrapper can launch it


# ----------------------------------------------------------------------------------------------------------
# The launch space, from the wrappers' constants
# ----------------------------------------------------------------------------------------------------------


def _per_tensor_variants() -> list[Variant]:
    from fp8_lightning.kernels.per_tensor import FLAT_BLOCK as BLOCK, TRANSPOSE_TILE as TILE, format_constants
    from fp8_lightning.kernels.per_tensor import PER_TENSOR_NUM_WARPS as NUM_WARPS

    out = [Variant("_amax_kernel", f"x={short(x)} BLOCK={BLOCK}",
                   (("x_ptr", ptr(x)), ("amax_bits_ptr", "*i32"), ("n", "i32"), ("BLOCK", BLOCK)))
           for x in INPUT_DTYPES]  # fmt: skip
    for x, q, rounding in itertools.product(INPUT_DTYPES, FP8, (False, True)):
        consts = tuple({**format_constants(q), "EXPLICIT_ROUNDING": rounding}.items())
        tag = f"x={short(x)} out={short(q)} explicit_rounding={int(rounding)}"
        for record in (False, True):
            out.append(Variant("_cast_kernel", f"{tag} record={int(record)} BLOCK={BLOCK}", (
                ("x_ptr", ptr(x)), ("scale_ptr", "*fp32"), ("out_ptr", ptr(q)), ("amax_bits_ptr", "*i32"),
                ("n", "i32"), *consts, ("RECORD_AMAX", record), ("BLOCK", BLOCK))))
            out.append(Variant("_cast_transpose_kernel", f"{tag} record={int(record)} TILE={TILE}", (
                ("x_ptr", ptr(x)), ("scale_ptr", "*fp32"), ("out_ptr", ptr(q)), ("out_t_ptr", ptr(q)),
                ("amax_bits_ptr", "*i32"), ("M", "i32"), ("K", "i32"), ("stride_xm", "i32"), ("stride_xk", 1),
                *consts, ("RECORD_AMAX", record), ("TILE", TILE))))
            for transpose in (False, True):
                out.append(Variant("_delayed_cast_kernel", f"{tag} record={int(record)} transpose={int(transpose)}", (
                    ("x_ptr", ptr(x)), ("scale_ptr", "*fp32"), ("out_ptr", ptr(q)), ("out_t_ptr", ptr(q)),
                    ("sync_ptr", "*i32"), ("pending_ptr", "*fp32"), ("count_ptr", "*i64"),
                    ("pending_out_ptr", "*fp32"), ("count_out_ptr", "*i64"), ("inverse_out_ptr", "*fp32"),
                    ("M", "i32"), ("K", "i32"), *consts, ("RECORD", record), ("TRANSPOSE", transpose),
                    ("BLOCK", BLOCK), ("TILE", TILE))))
        for pow2, keep, transpose in itertools.product((False, True), repeat=3):
            count = "*i64" if keep else "*i32"
            out.append(Variant("_tensorwise_cast_kernel",
                               f"{tag} power_of_2={int(pow2)} keep_previous={int(keep)} transpose={int(transpose)}", (
                ("x_ptr", ptr(x)), ("amax_bits_ptr", "*i32"), ("out_ptr", ptr(q)), ("out_t_ptr", ptr(q)),
                ("scale_out_ptr", "*fp32"), ("prev_scale_ptr", "*fp32"), ("count_ptr", count),
                ("count_out_ptr", count), ("inverse_out_ptr", "*fp32"), ("M", "i32"), ("K", "i32"), ("eps", "fp32"),
                *consts, ("POWER_OF_2", pow2), ("KEEP_PREVIOUS", keep), ("TRANSPOSE", transpose), ("BLOCK", BLOCK),
                ("TILE", TILE))))  # fmt: skip
    return [dataclasses.replace(variant, num_warps=NUM_WARPS) for variant in out]


def _mx_quantize_variants() -> list[Variant]:
    from fp8_lightning.kernels.availability import MX_BLOCK_SIZES
    from fp8_lightning.kernels.mxfp8 import launches, quantize_num_warps, tile_shape
    from fp8_lightning.kernels.per_tensor import format_constants

    out = []
    requests = ((True, False), (False, True), (True, True))
    for x, q, bs, rceil, rounding in itertools.product(INPUT_DTYPES, FP8, MX_BLOCK_SIZES, (False, True), (False, True)):
        for row, col in dict.fromkeys(d for request in requests for d in launches(bs, *request)):
            tile = tile_shape(bs, row, col)
            consts = {**format_constants(q), "EXPLICIT_ROUNDING": rounding}
            out.append(Variant("_mx_quantize_kernel", (
                f"x={short(x)} out={short(q)} block={bs} tile={tile[0]}x{tile[1]} rceil={int(rceil)} "
                f"rowwise={int(row)} colwise={int(col)} explicit_rounding={int(rounding)}"), (
                ("x_ptr", ptr(x)), ("row_ptr", ptr(q)), ("row_scale_ptr", "*u8"), ("col_ptr", ptr(q)),
                ("col_scale_ptr", "*u8"), ("R", "i32"), ("C", "i32"), ("R_PAD", "i32"), ("C_PAD", "i32"),
                ("stride_r", "i32"), ("stride_c", 1), ("BLOCK_SIZE", bs), ("EMAX", fp8_emax(q)), ("RCEIL", rceil),
                *consts.items(), ("ROWWISE", row), ("COLWISE", col), ("BLOCK_R", tile[0]), ("BLOCK_C", tile[1])),
                num_warps=quantize_num_warps(tile)))  # fmt: skip
    return out


def _mx_gemm_variants() -> list[Variant]:
    from fp8_lightning.kernels.availability import GEMM_OUT_DTYPES, MX_GEMM_BLOCK_SIZES
    from fp8_lightning.kernels.block_gemm import _config_key, mx_gemm_configs

    selected = {t: {_config_key(c) for c in mx_gemm_configs(divmod(cap, 10))} for t, cap in TARGETS.items()}
    out = []
    for a, b, c, bs, cfg in itertools.product(FP8, FP8, GEMM_OUT_DTYPES, MX_GEMM_BLOCK_SIZES, mx_gemm_configs()):
        meta = cfg.kwargs
        bm, bn = meta["BLOCK_M"], meta["BLOCK_N"]
        out.append(Variant("_mx_gemm_kernel", (
            f"a={short(a)} b={short(b)} out={short(c)} block={bs} "
            f"config={bm}x{bn}/warps{cfg.num_warps}/stages{cfg.num_stages}"), (
            ("a_desc", f"tensordesc<{short(a)}[{bm}, {bs}]>"), ("a_scale_ptr", "*u8"),
            ("b_desc", f"tensordesc<{short(b)}[{bn}, {bs}]>"), ("b_scale_ptr", "*u8"), ("c_ptr", ptr(c)),
            ("M", "i32"), ("N", "i32"), ("K", "i32"), ("stride_asm", "i32"), ("stride_ask", 1),
            ("stride_bsn", "i32"), ("stride_bsk", 1), ("stride_cm", "i32"), ("stride_cn", 1), ("BLOCK_K", bs),
            *meta.items()),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            targets=tuple(t for t in TARGETS if _config_key(cfg) in selected[t])))
    return out


def _gluon_mx_gemm_variants() -> list[Variant]:
    """The Hopper-only Gluon MX GEMM (opt-in): every tile it can pick at each block size, for sm_90a alone; none
    when this Triton has no usable Gluon. Its descriptors carry their shared-memory layout in their type."""
    from fp8_lightning.kernels.availability import GEMM_OUT_DTYPES, MX_GEMM_BLOCK_SIZES
    from fp8_lightning.kernels.availability import gluon_status

    if not gluon_status()[0]:
        return []
    from fp8_lightning.kernels.block_gemm_gluon import GROUP_M, shared_layout, tiles_for_block

    def desc(dtype, rows, bs):
        return f"tensordesc<{short(dtype)}[{rows}, {bs}],{shared_layout(rows, bs, dtype)!r}>"

    out = []
    for a, b, c, bs in itertools.product(FP8, FP8, GEMM_OUT_DTYPES, MX_GEMM_BLOCK_SIZES):
        out += [Variant("_gluon_mx_gemm_kernel", (
            f"a={short(a)} b={short(b)} out={short(c)} block={bs} tile={bm}x{bn}/warps{warps}"), (
            ("a_desc", desc(a, bm, bs)), ("a_scale_ptr", "*u8"), ("b_desc", desc(b, bn, bs)), ("b_scale_ptr", "*u8"),
            ("c_ptr", ptr(c)), *((name, "i32") for name in ("M", "N", "K", "stride_asm", "stride_bsn", "stride_cm")),
            ("BLOCK_M", bm), ("BLOCK_N", bn), ("BLOCK_K", bs), ("GROUP_M", GROUP_M), ("num_warps", warps)),
            num_warps=warps, targets=("sm_90a",)) for bm, bn, warps in tiles_for_block(bs)]  # fmt: skip
    return out


def _fp8_adam_variants() -> list[Variant]:
    from fp8_lightning.kernels.fp8_adam import (
        MASTER_CODES, MAX_BLOCK, MIN_BLOCK, adam_num_warps, kernel_formats, state_constants,
    )

    masters = {  # master kind -> (param pointer, master pointer)
        "none": ("*fp32", "*fp32"), "fp32": ("*bf16", "*fp32"), "bf16_remainder": ("*i16", "*i16"),
        "bf16_int8_remainder": ("*i16", "*i8"),
    }
    blocks = [1 << p for p in range(MIN_BLOCK.bit_length() - 1, MAX_BLOCK.bit_length())]
    out = []
    for block, master, m, v, v_sqrt, rounding in itertools.product(
        blocks, masters, FP8, (torch.float16, *FP8), (False, True), (False, True)
    ):
        param, master_ptr = masters[master]
        grad = "*fp32" if master == "none" else "*bf16"
        out.append(Variant("_fp8_adam_kernel", (
            f"BLOCK={block} master={master} m={short(m)} v={short(v)} v_sqrt={int(v_sqrt)} "
            f"explicit_rounding={int(rounding)}"), (
            ("param_ptr", param), ("grad_ptr", grad), ("master_ptr", master_ptr), ("m_ptr", ptr(m)),
            ("m_scale_ptr", "*fp32"), ("v_ptr", ptr(v)), ("v_scale_ptr", "*fp32"), ("n", "i32"),
            *((name, "fp32") for name in ("lr", "beta1", "beta2", "eps", "weight_decay", "step_size",
                                          "bias_correction2_sqrt")),
            ("BLOCK", block), ("MASTER", MASTER_CODES[master]), ("DECOUPLED", True), ("MAXIMIZE", False),
            *kernel_formats(state_constants(m), state_constants(v)).items(), ("V_FP8", v != torch.float16),
            ("V_SQRT", v_sqrt), ("EXPLICIT_ROUNDING", rounding)), num_warps=adam_num_warps(block)))  # fmt: skip
    return out


def _fine_cast_variants() -> list[Variant]:
    """The rowwise and blockwise casts: every tile, with the scale strides a launch on a contiguous x passes (a
    stride of 1 is specialized)."""
    from fp8_lightning.kernels.fine_grained_cast import NUM_WARPS
    from fp8_lightning.kernels.fine_grained_layout import BLOCKWISE_EDGE as TILE, TILES, along_rows, piece
    from fp8_lightning.kernels.per_tensor import format_constants

    def scale_strides(tile, transpose):  # (line, window) strides of scale, then of scale_t
        own = {(TILE, TILE): ("i32", 1), (1, TILE): (1, "i32"), (TILE, 1): (1, "i32")}.get(tile, (1, 1))
        return own + (("i32", 1) if transpose else ("i32", "i32"))

    requests = [(tile, False) for tile in TILES] + [((TILE, TILE), True)]
    out = []
    for x, q, (tile, transpose), pow2, rounding in itertools.product(
        INPUT_DTYPES, FP8, requests, (False, True), (False, True)
    ):
        rows = along_rows(tile)
        block_lines, chunk = piece(tile, rows)
        s_line, s_window, t_window, t_line = scale_strides(tile, transpose)
        out.append(Variant("_fine_cast_kernel", (
            f"x={short(x)} out={short(q)} tile={tile[0]}x{tile[1]} transpose={int(transpose)} power_of_2={int(pow2)} "
            f"explicit_rounding={int(rounding)}"), (
            ("x_ptr", ptr(x)), ("data_ptr", ptr(q)), ("data_t_ptr", ptr(q)), ("scale_ptr", "*fp32"),
            ("inverse_ptr", "*fp32"), ("scale_t_ptr", "*fp32"), ("inverse_t_ptr", "*fp32"), ("LINES", "i32"),
            ("LENGTH", "i32"), ("WINDOW", "i32"), ("stride_line", "i32" if rows else 1),
            ("stride_pos", 1 if rows else "i32"), ("stride_scale_line", s_line), ("stride_scale_window", s_window),
            ("stride_scale_t_window", t_window), ("stride_scale_t_line", t_line), ("eps", "fp32"),
            *{**format_constants(q), "EXPLICIT_ROUNDING": rounding}.items(), ("POWER_OF_2", pow2),
            ("BLOCKWISE", TILE in tile), ("SQUARE", tile == (TILE, TILE)), ("TRANSPOSE", transpose),
            ("BLOCK_LINES", block_lines), ("CHUNK", chunk)), num_warps=NUM_WARPS))  # fmt: skip
    return out


def _grouped_cast_variants() -> list[Variant]:
    """The grouped columnwise casts: tokens (groups padded to 16) and stacked weights (unpadded), contiguous x."""
    from fp8_lightning.kernels.grouped_cast import BLOCK_COLUMNS, CHUNK, NUM_WARPS
    from fp8_lightning.kernels.per_tensor import format_constants

    out = []
    for x, q, align, pow2, rounding in itertools.product(INPUT_DTYPES, FP8, (1, 16), (False, True), (False, True)):
        out.append(Variant("_grouped_column_cast_kernel", (
            f"x={short(x)} out={short(q)} align={align} power_of_2={int(pow2)} explicit_rounding={int(rounding)}"), (
            ("x_ptr", ptr(x)), ("data_ptr", ptr(q)), ("scale_ptr", "*fp32"), ("inverse_ptr", "*fp32"),
            ("starts_ptr", "*i32"), ("rows_ptr", "*i32"), ("out_starts_ptr", "*i64"), ("COLUMNS", "i32"),
            ("stride_row", "i32"), ("stride_column", 1), ("out_line_stride", "i32"), ("eps", "fp32"),
            *{**format_constants(q), "EXPLICIT_ROUNDING": rounding}.items(), ("POWER_OF_2", pow2),
            ("ALIGN", align), ("BLOCK", BLOCK_COLUMNS), ("CHUNK", CHUNK)), num_warps=NUM_WARPS))  # fmt: skip
    return out


def _grouped_gemm_variants() -> list[Variant]:
    """The grouped GEMMs: every tile, operand formats (e4m3 x e4m3; e5m2 gradients times e4m3), output dtypes,
    both weight storages (E, K, N) and (E, N, K) of fprop/dgrad, rowwise and per-expert scales (index stride 0);
    K, N and the operands' strides divisible by 16, as the recipes' shape rule and the padded token layout make them."""
    from fp8_lightning.kernels.grouped_gemm import OUT_DTYPES, _config_key, grouped_gemm_configs

    selected = {t: {_config_key(c) for c in grouped_gemm_configs(divmod(cap, 10))} for t, cap in TARGETS.items()}
    pairs = ((FP8[0], FP8[0]), (FP8[1], FP8[0]))
    out = []
    for (a, b), c, cfg, scales in itertools.product(pairs, OUT_DTYPES, grouped_gemm_configs(), ("row", "tensor")):
        meta, row = cfg.kwargs, scales == "row"
        tile = f"{meta['BLOCK_M']}x{meta['BLOCK_N']}x{meta['BLOCK_K']}/warps{cfg.num_warps}/stages{cfg.num_stages}"
        common = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                      targets=tuple(t for t in TARGETS if _config_key(cfg) in selected[t]))
        head = (("a_ptr", ptr(a)), ("b_ptr", ptr(b)), ("c_ptr", ptr(c)), ("sa_ptr", "*fp32"), ("sb_ptr", "*fp32"),
                ("offs_ptr", "*i32"))
        for weight, even_k, fast in itertools.product(("kn", "nk"), (True, False), (False, True)):
            out.append(Variant("_grouped_mm_2d3d_kernel", (
                f"a={short(a)} b={short(b)} out={short(c)} tile={tile} weight={weight} scales={scales} "
                f"even_k={int(even_k)} fast_accum={int(fast)}"), (*head, ("M", "i32"), ("N", "i32:16"),
                ("K", "i32:16"), ("M_BUCKET", "i32:16"), ("stride_am", "i32:16"), ("stride_ak", 1),
                ("stride_be", "i32:16"), ("stride_bk", "i32:16" if weight == "kn" else 1),
                ("stride_bn", 1 if weight == "kn" else "i32:16"), ("stride_cm", "i32:16"), ("stride_cn", 1),
                ("stride_sam", 1 if row else "i32"), ("stride_sbe", "i32"), ("stride_sbn", 1 if row else "i32"),
                ("E", 128), ("E_PAD", 128), ("EVEN_K", even_k), ("FAST_ACCUM", fast), *meta.items()),
                **common))  # fmt: skip
        for fast in (False, True):
            out.append(Variant("_grouped_mm_2d2d_kernel", f"a={short(a)} b={short(b)} out={short(c)} tile={tile} "
                               f"scales={scales} fast_accum={int(fast)}", (*head, ("N", "i32:16"), ("K", "i32:16"),
                ("M_BUCKET", "i32:16"), ("stride_an", "i32:16"), ("stride_am", 1), ("stride_bm", 1),
                ("stride_bk", "i32:16"), ("stride_ce", "i32:16"), ("stride_cn", "i32:16"), ("stride_ck", 1),
                ("stride_sae", "i32"), ("stride_san", 1 if row else "i32"), ("stride_sbe", "i32"),
                ("stride_sbk", 1 if row else "i32"), ("ALIGNED", True), ("FAST_ACCUM", fast), *meta.items()),
                **common))  # fmt: skip
    return out


def _nvfp4_cast_variants() -> list[Variant]:
    """The NVFP4 cast (1x16 blocks and 16x16 tiles, RHT on/off, both roundings) and its amax pass, on a contiguous x
    (unit column stride) or a transposed view (unit row stride: the wgrad copies read ``x.T`` as it lies)."""
    from fp8_lightning.kernels.nvfp4_cast import BLOCK_K, BLOCK_R, NVFP4_NUM_WARPS
    from fp8_lightning.kernels.per_tensor import format_constants

    e4m3 = torch.float8_e4m3fn
    strides = {"row_major": (("stride_r", "i32"), ("stride_k", 1)), "column_major": (("stride_r", 1),
                                                                                      ("stride_k", "i32"))}
    out = []
    for x, layout, rht in itertools.product(INPUT_DTYPES, strides, (False, True)):
        out.append(Variant("_nvfp4_amax_kernel", f"x={short(x)} layout={layout} rht={int(rht)}", (
            ("x_ptr", ptr(x)), ("signs_ptr", "*fp32"), ("amax_bits_ptr", "*i32"), ("R", "i32"), ("K", "i32"),
            *strides[layout], ("RHT", rht), ("BLOCK_R", BLOCK_R), ("BLOCK_K", BLOCK_K)), num_warps=NVFP4_NUM_WARPS))
    for x, layout, tile, rht, sr, rounding in itertools.product(
        INPUT_DTYPES, strides, (1, 16), (False, True), (False, True), (False, True)
    ):
        out.append(Variant("_nvfp4_cast_kernel", (
            f"x={short(x)} layout={layout} tile_rows={tile} rht={int(rht)} stochastic={int(sr)} "
            f"explicit_rounding={int(rounding)}"), (
            ("x_ptr", ptr(x)), ("gscale_ptr", "*fp32"), ("signs_ptr", "*fp32"), ("key_ptr", "*i64"),
            ("codes_ptr", "*u8"), ("scales_ptr", ptr(e4m3)), ("R", "i32"), ("K", "i32"), ("PR", "i32"),
            ("PK", "i32"), *strides[layout], ("TILE_ROWS", tile), ("RHT", rht), ("STOCHASTIC", sr),
            *{**format_constants(e4m3), "EXPLICIT_ROUNDING": rounding}.items(), ("BLOCK_R", BLOCK_R),
            ("BLOCK_K", BLOCK_K)), num_warps=NVFP4_NUM_WARPS))  # fmt: skip
    return out


def launch_space() -> list[Variant]:
    """Every configuration the wrappers can launch (dtypes, constexprs, every autotune config)."""
    return (
        _per_tensor_variants() + _mx_quantize_variants() + _mx_gemm_variants() + _gluon_mx_gemm_variants()
        + _fp8_adam_variants() + _fine_cast_variants() + _grouped_cast_variants() + _grouped_gemm_variants()
        + _nvfp4_cast_variants()
    )


def axes(variant: Variant) -> dict:
    """The variant's configuration as ``{axis: value}`` (parsed from its ``config`` string)."""
    return dict(item.split("=", 1) for item in variant.config.split())


# Axes naming data types: each value is compiled at least once, not with every value of every other axis.
DTYPE_AXES = frozenset({"x", "out", "a", "b", "m", "v", "master"})


def pairwise_cover(variants: list[Variant]) -> list[tuple[Variant, str]]:
    """A small set of (variant, target) jobs in which every pair of values of a kernel's shape and option axes (the
    target being one more) occurs at least once, and every value of its data-type axes: what the test suite
    compiles (about 100 jobs, where the full sweep is 4,650 and takes 45 minutes)."""
    jobs = [(v, t) for v in variants for t in v.targets]

    def facts(job):
        variant, target = job
        items = {**axes(variant), "target": target}
        shape = sorted((k, v) for k, v in items.items() if k not in DTYPE_AXES)
        return {(variant.kernel, *pair) for pair in itertools.combinations(shape, 2)} | {
            (variant.kernel, k, v) for k, v in items.items() if k in DTYPE_AXES
        }

    chosen = []
    for kernel in dict.fromkeys(v.kernel for v, _ in jobs):
        candidates = [(job, facts(job)) for job in jobs if job[0].kernel == kernel]
        uncovered = set().union(*(f for _, f in candidates))
        while uncovered:
            job, covered = max(candidates, key=lambda c: len(c[1] & uncovered))
            chosen.append(job)
            uncovered -= covered
    return chosen
