"""Each hot cast, decode and MX quantization on the backend that runs the tensor, with the reference's bits.

``quantize.py``, ``mx.py`` and ``fine_grained.py`` hold the reference math in plain PyTorch. The ``fast_*``
functions here compute exactly what the reference of the same name computes (``fast_amax`` is ``quantize.amax``),
handing the tensor to:

=================  ===============================================================================================
implementation     used for
=================  ===============================================================================================
Triton kernels     CUDA tensors of float32/bf16/fp16 when Triton runs on the device (sm89+) and
                   ``FP8_LIGHTNING_DISABLE_TRITON`` is not set (:func:`cuda_kernels`; the ops of
                   :mod:`fp8_lightning.ops.triton_ops`)
C codec            plain CPU tensors of float32/bf16 when a C compiler built it and ``FP8_LIGHTNING_DISABLE_CPU_CODEC``
                   is not set, never while ``torch.compile`` traces (:func:`cpu_codec`)
PyTorch            everything else: the reference functions, plus two exact shortcuts of the CPU's slow float8
                   casts (skipped clamps where the cast saturates, decoding by integer shifts)
=================  ===============================================================================================

The choice depends only on the tensor (device, dtype, type) and the process's settings (:mod:`fp8_lightning.settings`,
read once). These are functions, not custom ops: in eager code they call the chosen implementation directly; under
``torch.compile`` the Triton ops and the traced step's ops (:mod:`fp8_lightning.ops.layer`) are what the graph holds.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from fp8_lightning import fine_grained, mx, quantize
from fp8_lightning.blockwise import COLUMN_TILE
from fp8_lightning.formats import Format, fp8_dtype
from fp8_lightning.kernels import cpu_codec as codec_module
from fp8_lightning.kernels.availability import MX_BLOCK_SIZES, kernels_usable
from fp8_lightning.kernels.fine_grained_layout import ROWWISE_TILES
from fp8_lightning.ops import triton_ops
from fp8_lightning.quantize import MX, OperandCache, Quantized, TENSOR, _check_floating, is_transposed_2d

# --------------------------------------------------------------------------------------------------------
# Which implementation
# --------------------------------------------------------------------------------------------------------


def cuda_kernels(x: torch.Tensor):
    """The Triton ops (:mod:`fp8_lightning.ops.triton_ops`) for a CUDA tensor they take, else None (always None on
    CPU)."""
    return triton_ops if kernels_usable(x) and triton_ops.supports_input(x) else None


def cpu_codec(x: torch.Tensor | None = None):
    """The C codec when it is built and enabled, for a CPU tensor ``x`` it takes (float32/bf16 input to quantize;
    any tensor with ``x=None``), else None. Never while ``torch.compile`` traces (the codec reads raw memory), nor
    for tensor subclasses (FSDP2's FP8 weights, DTensor), which may have no memory of their own to read."""
    if x is not None and not x.is_cpu or torch.compiler.is_compiling():  # is_cpu: a flag, .device an object
        return None
    if x is not None and (type(x) not in codec_module.PLAIN_TYPES or x.dtype not in codec_module.INPUT_DTYPES):
        return None
    return codec_module if codec_module.enabled() else None


def nvfp4_codec(x: torch.Tensor, global_scale, tile_rows: int, uniform):
    """The C codec when it can cast ``x`` to NVFP4 (``nvfp4.quantize_nvfp4``) with the same bits as the reference:
    a non-empty 2-D float32/bf16 CPU ``x`` (:func:`cpu_codec`), a global scale that is None or one float32 CPU
    element, and ``uniform`` None or a plain float32 CPU tensor of the padded shape; else None."""
    codec = cpu_codec(x)
    if codec is None or x.dim() != 2 or x.numel() == 0:
        return None
    if global_scale is not None and not (torch.is_tensor(global_scale) and global_scale.numel() == 1
                                         and global_scale.is_cpu and global_scale.dtype == torch.float32):
        return None
    if uniform is not None:
        padded = (-(-x.shape[0] // tile_rows) * tile_rows, -(-x.shape[1] // 16) * 16)
        if type(uniform) not in codec.PLAIN_TYPES or not uniform.is_cpu or uniform.dtype != torch.float32 \
                or tuple(uniform.shape) != padded:
            return None
    return codec


def nvfp4_kernels(x: torch.Tensor, global_scale, tile_rows: int, uniform, rht_signs):
    """The Triton ops (``triton_ops.triton_nvfp4_cast``) when they can cast ``x`` to NVFP4 (``nvfp4.quantize_nvfp4``)
    with the reference's bits: a non-empty 2-D CUDA ``x`` the kernels take (:func:`cuda_kernels`), no explicit
    uniform numbers (the kernel draws its own from a key), a global scale that is None or one float32 element and
    RHT signs that are None or 16 float32 values, both on ``x``'s device; else None."""
    if uniform is not None or x.dim() != 2 or x.numel() == 0 or cuda_kernels(x) is None:
        return None
    if global_scale is not None and not (one_float32_scale(global_scale) and global_scale.device == x.device):
        return None
    if rht_signs is not None and not (rht_signs.dtype == torch.float32 and rht_signs.numel() == 16
                                      and rht_signs.device == x.device):
        return None
    return triton_ops


def one_float32_scale(scale) -> bool:
    """Whether ``scale`` is one float32 element (what the per-tensor kernels and the codec take)."""
    return torch.is_tensor(scale) and scale.dtype == torch.float32 and scale.numel() == 1


def cast_codec(x: torch.Tensor, scale):
    """The C codec when it can cast ``x`` with ``scale`` (a float32/bf16 CPU tensor, one float32 CPU scale)."""
    return cpu_codec(x) if one_float32_scale(scale) and scale.is_cpu else None


# --------------------------------------------------------------------------------------------------------
# Per-tensor
# --------------------------------------------------------------------------------------------------------


def fast_amax(x: torch.Tensor) -> torch.Tensor:
    """:func:`fp8_lightning.quantize.amax`."""
    return amax_and_value(x)[0]


def amax_and_value(x: torch.Tensor) -> tuple[torch.Tensor, float | None]:
    """:func:`~fp8_lightning.quantize.amax`, and its value as a Python float where reading it costs no device
    synchronisation (CPU; else None). On CPU one ``aminmax`` pass gives both ends; the larger magnitude is picked
    on the host."""
    on_cpu = x.is_cpu
    if x.numel() == 0:
        return quantize.amax(x), (0.0 if on_cpu else None)
    kernels = cuda_kernels(x)
    if kernels is not None:
        return kernels.triton_amax(x.detach()), None
    if not on_cpu:
        return quantize.amax(x), None
    low, high = torch.aminmax(x.detach())
    lo, hi = low.item(), high.item()
    top, value = (high, hi) if math.isnan(hi) or hi >= -lo else (low.neg(), -lo)  # NaN anywhere: both ends NaN
    if top.dtype != torch.float32:
        top = top.float()
        value = top.item()
    return top, value


def fast_to_fp8_saturated(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`fp8_lightning.quantize.to_fp8_saturated`; the CPU cast to E4M3 saturates by itself (infinities
    included; ``tests/core/test_formats_bits.py`` holds it to that), so the clamp, a full pass, is skipped there."""
    if dtype == torch.float8_e4m3fn and x.is_cpu:
        return x.to(dtype)
    return quantize.to_fp8_saturated(x, dtype)


def fast_quantize_with_scale(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, saturate: bool = True
) -> torch.Tensor:
    """:func:`fp8_lightning.quantize.quantize_with_scale`."""
    kernels, codec = cuda_kernels(x), cast_codec(x, scale)
    if kernels is not None and one_float32_scale(scale):
        return kernels.triton_cast(x.detach(), scale.to(x.device), dtype, record_amax=False)[0]
    if codec is not None:
        return codec.fp8_cast(x, scale.item(), dtype)[0]  # saturates always: equal bits when the caller skips it
    scaled = quantize.wide(x) * scale
    return fast_to_fp8_saturated(scaled, dtype) if saturate else scaled.to(dtype)


def quantize_operand(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, saturate: bool = True, nan_free: bool = False,
    scale_value: float | None = None,
) -> Quantized:
    """:func:`quantize_with_scale` as a GEMM operand. With the C codec, the codes' float32 values (what the CPU
    GEMM multiplies) come from the same pass and ride on the operand. ``scale_value``: the scale as a Python
    float, when the caller has read it already."""
    codec = cast_codec(x, scale)
    if codec is not None:
        data, values, _ = codec.fp8_cast(x, scale.item() if scale_value is None else scale_value, dtype)
        return Quantized(data, scale, TENSOR, OperandCache(values, nan_free))
    data = fast_quantize_with_scale(x, scale, dtype, saturate)
    return Quantized(data, scale, TENSOR, OperandCache(nan_free=nan_free))


class FusedCast(NamedTuple):
    """A CPU cast that also measured the input's amax in the same pass over it."""

    data: torch.Tensor
    amax: torch.Tensor
    host_amax: float  # the same amax as a Python float (reading it is free on CPU)
    values: torch.Tensor  # the codes' float32 values, made in the same pass


def fused_cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> FusedCast | None:
    """The cast with a known (delayed) scale and the amax from one pass over a CPU ``x`` (the C codec); None where
    no implementation fuses them."""
    codec = cast_codec(x, scale)
    if codec is None:
        return None
    data, values, host_amax = codec.fp8_cast(x, scale.item(), dtype, with_amax=True)
    return FusedCast(data, torch.scalar_tensor(host_amax, dtype=torch.float32), host_amax, values)


def delayed_state_cast(state, x: torch.Tensor, record: bool, transpose: bool):
    """A delayed-scaled operand's whole cast with its bookkeeping in one Triton kernel (CUDA), after its first, just
    in time scaled cast, instead of four to ten scalar tensor operations per cast, each a launch that costs more host
    time than it computes. Returns the kernel's outputs (see ``triton_ops.triton_delayed_operand_cast``), or None."""
    kernels = cuda_kernels(x)
    if kernels is None or not state.initialized:
        return None
    return kernels.triton_delayed_operand_cast(
        x.detach(), state.scale, state.pending_amax, state.nonfinite_count, state.dtype, record, transpose
    )


def tensorwise_state_cast(state, x: torch.Tensor, transpose: bool, eps: float, power_of_2: bool):
    """A tensorwise-scaled operand's whole cast with its bookkeeping in two Triton launches (CUDA); returns the
    kernel's outputs (see ``triton_ops.triton_tensorwise_operand_cast``), or None where the kernels do not run."""
    kernels = cuda_kernels(x)
    if kernels is None:
        return None
    return kernels.triton_tensorwise_operand_cast(
        x.detach(), state.scale, state.nonfinite_count, state.dtype, eps, power_of_2, transpose
    )


def fast_quantize_tensorwise(
    x: torch.Tensor, fp8_format: "Format | str | torch.dtype" = Format.E4M3, eps: float = 1e-12
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fp8_lightning.quantize.quantize_tensorwise` (``(data, scale)``)."""
    _check_floating(x, "quantize_tensorwise")
    dtype = fp8_dtype(fp8_format)
    kernels = cuda_kernels(x)
    if kernels is not None:
        return kernels.triton_tensorwise_cast(x.detach(), dtype, eps)
    scale = quantize.current_scale(fast_amax(x), dtype, eps)
    return fast_quantize_with_scale(x, scale, dtype), scale


# --------------------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------------------

_DECODE_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
_TABLE_DECODE_BELOW = 16384  # elements; measured crossover of the two E4M3 decodes on one CPU thread


def _decode_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The float32 value of each of the 256 codes of a float8 ``dtype`` (built once per dtype and device)."""
    key = (dtype, device)
    if key not in _DECODE_TABLES:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
        _DECODE_TABLES[key] = codes.float().to(device)
    return _DECODE_TABLES[key]


def fast_fp8_to_float32(data: torch.Tensor, nan_free: bool = False) -> torch.Tensor:
    """``data.float()``, bit for bit, for any tensor; float8 on CPU is decoded with vectorized integer operations.

    The CPU cast from float8 converts element by element (about 4 ns each, more than a float32 matmul of the
    same operand at small sizes). Both common formats are a float16 in disguise:

    * E5M2 is the upper byte of a float16 (same exponent bias): shift it up by 8 bits.
    * E4M3 ``s eeee mmm`` shifted up by 7 bits is the float16 ``s 0eeee mmm0000000``, whose value is the E4M3
      value times 2**-8 (float16's exponent bias is 15, E4M3's 7; the subnormals line up as well). E4M3 has no
      infinity and its NaN codes (0x7F, 0xFF) would decode as 480: data holding them goes through a 256-entry
      table instead, as do tensors under 16K elements (one gather beats five small operations there).
      ``nan_free=True`` (the caller knows there are none) skips looking for NaN codes.

    Both give exactly the values of ``data.float()`` several times faster; the C codec does it in one pass. A
    transposed 2-D view is decoded through its contiguous base and stays a transposed view.
    """
    if not data.is_cpu or data.dtype.itemsize != 1 or not data.is_floating_point():
        return data.float()
    transposed = is_transposed_2d(data)
    codec = cpu_codec()
    if codec is not None and data.dtype in codec.FORMATS:  # one vectorized pass, any size
        return codec.fp8_decode(data.t()).t() if transposed else codec.fp8_decode(data)
    if transposed:
        return fast_fp8_to_float32(data.t(), nan_free).t()
    codes = data.contiguous().view(torch.uint8)
    if data.dtype == torch.float8_e5m2:
        return codes.to(torch.int16).mul_(256).view(torch.float16).float()
    small = codes.numel() < _TABLE_DECODE_BELOW  # a gather costs fewer operations; the shifts win on more data
    if data.dtype == torch.float8_e4m3fn and not small and (nan_free or (codes & 0x7F).max() < 0x7F):
        sign_extended = codes.view(torch.int8).to(torch.int16)  # bits 15..8 all copy the sign bit
        half = sign_extended.bitwise_left_shift_(7).bitwise_and_(~0x4000)  # drop the copy that lands in bit 14
        return half.view(torch.float16).float().mul_(256.0)
    flat = codes.reshape(-1).to(torch.int64)  # int64 indices: index_select slows down badly with int32 ones
    return _decode_table(data.dtype, data.device).index_select(0, flat).view(data.shape)


def fast_dequantize_with_scale(data: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32):
    """:func:`fp8_lightning.quantize.dequantize_with_scale`."""
    return (fast_fp8_to_float32(data) * scale.float().reciprocal()).to(out_dtype)


def fast_dequantize_tensorwise(data: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32):
    """:func:`fp8_lightning.quantize.dequantize_tensorwise`."""
    return fast_dequantize_with_scale(data, scale, out_dtype)


def operand_f32(q: Quantized) -> torch.Tensor:
    """The operand in float32 for a float GEMM (``q.cache.f32``: the codes' exact values where the GEMM scales its
    product, per-tensor and rowwise; the dequantized values for MX and blockwise; its kind says which), made on the
    first call and kept in the operand's cache for its other GEMMs."""
    cache = q.cache
    if cache.f32 is None:
        cache.f32 = q.kind.to_f32(q)
    return cache.f32


def dequantize_operand(q: Quantized, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The high-precision values an operand stands for."""
    return q.kind.dequantize(q, out_dtype)


# --------------------------------------------------------------------------------------------------------
# MXFP8
# --------------------------------------------------------------------------------------------------------


def _mx_kernels(x: torch.Tensor, block_size: int):
    kernels = cuda_kernels(x)
    return kernels if kernels is not None and block_size in MX_BLOCK_SIZES and x.numel() > 0 else None


def fast_quantize_mxfp8(
    x: torch.Tensor, *, block_size: int = 32, scale_rounding: str = "rceil",
    fp8_format: "Format | str | torch.dtype" = Format.E4M3,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fp8_lightning.mx.quantize_mxfp8` (``(data, scale)``)."""
    k = mx.check_mx_input(x, block_size, "quantize_mxfp8", scale_rounding)
    dtype = fp8_dtype(fp8_format)
    kernels, codec = _mx_kernels(x, block_size), cpu_codec(x)
    if kernels is not None:
        rows, _ = kernels.triton_mx_quantize(x.detach().reshape(-1, k), block_size, scale_rounding, dtype)
        return rows.data.reshape(x.shape), rows.scale.reshape(*x.shape[:-1], k // block_size)
    if codec is not None and x.numel() > 0:
        data, scale, _ = codec.mx_quantize(x.reshape(-1, k), block_size, scale_rounding, dtype)[0]
        return data.reshape(x.shape), scale.reshape(*x.shape[:-1], k // block_size)
    return mx.quantize_mxfp8(x, block_size=block_size, scale_rounding=scale_rounding, fp8_format=dtype)


def fast_quantize_mx_operand(x: torch.Tensor, block_size: int, scale_rounding: str, dtype: torch.dtype) -> Quantized:
    """:func:`fp8_lightning.mx.quantize_mx_operand`."""
    data, scale = fast_quantize_mxfp8(x, block_size=block_size, scale_rounding=scale_rounding, fp8_format=dtype)
    return Quantized(data, scale, MX)


def fast_quantize_mx_operands(
    x: torch.Tensor, block_size: int, scale_rounding: str, dtype: torch.dtype, columnwise: bool = True,
    columnwise_f32: bool = True,
) -> tuple[Quantized, Quantized | None]:
    """:func:`fp8_lightning.mx.quantize_mx_operands`. ``columnwise_f32=False``: the columnwise copy is only kept
    for later (saved for backward), so the C codec does not make its float32 GEMM form now."""
    kernels, codec = _mx_kernels(x, block_size), cpu_codec(x)
    if kernels is not None:
        x = x.detach()
        return kernels.triton_mx_quantize(x, block_size, scale_rounding, dtype, rowwise=True, columnwise=columnwise)
    if codec is not None and x.numel() > 0:
        row, col = codec.mx_quantize(x, block_size, scale_rounding, dtype, True, columnwise, columnwise_f32)
        return Quantized(row[0], row[1], MX, OperandCache(row[2])), (None if col is None else _transposed_operand(*col))
    return mx.quantize_mx_operands(x, block_size, scale_rounding, dtype, columnwise)


def fast_quantize_mx_columns(x: torch.Tensor, block_size: int, scale_rounding: str, dtype: torch.dtype) -> Quantized:
    """:func:`fp8_lightning.mx.quantize_mx_columns`."""
    kernels, codec = _mx_kernels(x, block_size), cpu_codec(x)
    if kernels is not None:
        x = x.detach()
        return kernels.triton_mx_quantize(x, block_size, scale_rounding, dtype, rowwise=False, columnwise=True)[1]
    if codec is not None and x.numel() > 0:
        return _transposed_operand(*codec.mx_quantize(x, block_size, scale_rounding, dtype, False, True)[1])
    return mx.quantize_mx_columns(x, block_size, scale_rounding, dtype)


def _transposed_operand(data: torch.Tensor, scale: torch.Tensor, values: torch.Tensor | None) -> Quantized:
    """The MX operand of x.T from columnwise blocks quantized in x's layout (views, no copy)."""
    return Quantized(data.t(), scale.t(), MX, OperandCache(None if values is None else values.t()))


def fast_dequantize_mxfp8(data: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32):
    """:func:`fp8_lightning.mx.dequantize_mxfp8`."""
    k, n_blocks = mx.check_mx_scales(data, scale)
    codec = cpu_codec() if data.is_cpu and data.numel() > 0 else None
    if codec is None or data.dtype not in codec.FORMATS:
        return mx.dequantize_mxfp8(data, scale, out_dtype, decode=fast_fp8_to_float32)
    if is_transposed_2d(data):  # blocks down base rows
        return codec.mx_decode(data.t(), scale.t(), True).to(out_dtype).t()
    values = codec.mx_decode(data.reshape(-1, k), scale.reshape(-1, n_blocks), False)
    return values.view(data.shape).to(out_dtype)



# --------------------------------------------------------------------------------------------------------
# Rowwise and blockwise
# --------------------------------------------------------------------------------------------------------


def fast_fine_operands(recipe, role: str, x: torch.Tensor, dtype: torch.dtype, columnwise: bool):
    """:func:`fp8_lightning.fine_grained.fine_operands`, each copy it casts in one pass over ``x``: on CUDA one Triton
    launch (``triton_ops.triton_fine_cast``) that also writes ``1 / scale`` and both in cuBLAS's layouts, with the
    wgrad copies
    (``x.T``, ``g.T``) written transposed and a weight's ``W.T`` blocks from the same launch as ``W``'s; on CPU one
    call of the C codec (:func:`codec_fine_cast`), which also makes the float32 values the CPU GEMM multiplies."""
    cast = fine_caster(x)
    if cast is None:
        return fine_grained.fine_operands(recipe, role, x, dtype, columnwise)
    return fine_grained.fine_operands(recipe, role, x.detach(), dtype, columnwise, cast)


def fine_caster(x: torch.Tensor):
    """The rowwise/blockwise cast for ``x``, with ``triton_ops.triton_fine_cast``'s signature: the Triton kernel
    (CUDA), the C
    codec (plain CPU tensors, :func:`cpu_codec`), or None for the reference."""
    if x.dim() != 2 or x.numel() == 0:
        return None
    if cuda_kernels(x) is not None:
        return triton_ops.triton_fine_cast
    return codec_fine_cast if cpu_codec(x) is not None else None


def grouped_column_caster(x: torch.Tensor):
    """The one-launch cast of every group's columnwise copy of ``x`` (rows sorted into groups):
    ``triton_ops.triton_grouped_column_cast`` where the Triton kernels run on ``x``, else None (pure torch)."""
    if x.dim() != 2 or x.numel() == 0 or cuda_kernels(x) is None:
        return None
    return triton_ops.triton_grouped_column_cast


def codec_fine_cast(
    x: torch.Tensor, dtype: torch.dtype, tile: tuple[int, int], power_of_2: bool, eps: float = 1e-12,
    transpose: bool = False,
) -> tuple[Quantized, Quantized | None]:
    """``triton_ops.triton_fine_cast`` on a CPU tensor through the C codec: one copy of a 2-D ``x`` as an operand of
    kind
    ``"row"`` (tiles ``(1, 0)``, ``(0, 1)``) or ``"block"``, the copies scaled down x's columns handed out as the
    operand of ``x.T`` (transposed views), and with ``transpose`` (128x128 blocks) the operand of ``x.T`` from the
    same blocks. ``OperandCache.f32`` holds what the CPU GEMM multiplies: the codes' values (rowwise), the dequantized
    values (blockwise); ``OperandCache.inverse`` the ``1 / scale`` the rowwise GEMM scales its product with."""
    data, scale, inverse, values = codec_module.fine_quantize(x, tile, dtype, power_of_2, eps)
    kind = fine_grained.tile_kind(tile)
    if tile in (ROWWISE_TILES[1], COLUMN_TILE):
        return _fine_columns(data, scale, kind, values, inverse), None
    row = Quantized(data, scale, kind, OperandCache(values, inverse=inverse))
    return row, (_fine_columns(data, scale, kind, values, inverse) if transpose else None)


def _fine_columns(data, scale, kind, values, inverse) -> Quantized:
    """The operand of x.T from copies quantized in x's layout (transposed views, no copy)."""
    return Quantized(data.t(), scale.t(), kind, OperandCache(values.t(), inverse=inverse.t()))
