"""NVFP4 numerics as pure functions: E2M1 codes, two-level block scales, the random Hadamard transform and
stochastic rounding (NVIDIA's NVFP4 training recipe, TransformerEngine's ``NVFP4BlockScaling``).

The format::

    x ~= e2m1 * s_block * s_global

* ``e2m1``: a 4-bit float, 1 sign, 2 exponent and 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
  negatives (code ``c`` has magnitude :data:`E2M1_VALUES` ``[c & 7]`` and sign bit ``c & 8``). No inf, no NaN.
  Two codes per byte, **the even element in the low nibble** (element ``2j`` in bits 0-3, ``2j + 1`` in bits 4-7):
  torch's ``float4_e2m1fn_x2`` as its CUDA tests pack it for cuBLAS, and torchao's ``pack_uint4``.
* ``s_block``: one E4M3 scale per block of 16 consecutive elements along K (1x16), or per 16x16 tile (weights).
* ``s_global``: one float32 scale per tensor, ``amax / (448 * 6)`` (torchao's ``per_tensor_amax_to_scale``; the
  inverse of TransformerEngine's encode scale ``448 * 6 / amax``), so the largest block scale lands near 448.

The design in full: ``docs/design/notes.md``, section ``fp8_lightning.nvfp4``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fp8_lightning.ops import dispatch

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_TINY = 2.0**-6  # smallest normal E4M3: torchao's E4M3_EPS, the floor of a block scale
NVFP4_BLOCK = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between consecutive magnitudes and whether the tie rounds up (to the even code above) or down.
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
_MASK32 = 0xFFFFFFFF


class NVFP4Tensor(NamedTuple):
    """A quantized NVFP4 tensor: packed codes, E4M3 block scales, the float32 global scale.

    ``codes``: uint8 ``(rows, ceil(K / 16) * 8)`` (K zero-padded to whole blocks); ``block_scales``: float8_e4m3fn
    ``(rows, ceil(K / 16))`` for 1x16 blocks, ``(ceil(rows / 16), ceil(K / 16))`` for 16x16 tiles;
    ``global_scale``: a float32 scalar; ``shape``: the unpadded (rows, K)."""

    codes: torch.Tensor
    block_scales: torch.Tensor
    global_scale: torch.Tensor
    shape: tuple[int, int]
    tile_rows: int = 1

    def as_float4(self) -> torch.Tensor:
        """``codes`` as ``torch.float4_e2m1fn_x2`` (the dtype cuBLAS's FP4 GEMM takes), where torch has it."""
        return self.codes.view(torch.float4_e2m1fn_x2)


# --------------------------------------------------------------------------------------------------------
# E2M1
# --------------------------------------------------------------------------------------------------------


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes (uint8, 0-15) of float32 ``v`` rounded to nearest E2M1, ties to even, saturating at +-6."""
    mag = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for midpoint, tie_up in _MIDPOINTS:
        code += (mag >= midpoint if tie_up else mag > midpoint).to(torch.uint8)
    code = torch.where(torch.isnan(v), _nan_codes(v), code)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def _nan_codes(v: torch.Tensor) -> torch.Tensor:
    """What torchao's bit-level cast (``_f32_to_floatx_unpacked``) makes of NaNs, which E2M1 cannot hold: its
    normal-number path applied to the NaN's bits (3 for the default quiet NaN; other payloads give other codes)."""
    bits = v.float().abs().view(torch.int32).to(torch.int64)
    mant_odd = (bits >> 22) & 1
    return (((bits + ((1 - 127) << 23) + (1 << 21) - 1 + mant_odd) >> 22) & 0xFF).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """The float32 value of each 4-bit code (uint8, 0-15)."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=codes.device)
    return table.index_select(0, codes.reshape(-1).long()).view(codes.shape)  # a lookup fake CUDA tensors take too


def stochastic_e2m1_codes(v: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Codes of ``v`` (float32, within +-6) rounded down or up to its E2M1 neighbours: up when ``uniform`` (in
    [0, 1)) is below ``(|v| - lower) / (upper - lower)``, so the expected value is ``v``."""
    mag = v.abs()
    lower = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)  # the largest code whose magnitude <= |v|
    for value in E2M1_VALUES[1:]:
        lower += (mag >= value).to(torch.uint8)
    table = torch.tensor(E2M1_VALUES + (E2M1_VALUES[-1],), device=v.device)
    low, high = table[lower.long()], table[lower.long() + 1]
    gap = torch.where(high > low, high - low, torch.ones_like(high))
    up = (uniform < (mag - low) / gap) & (lower < 7)
    code = torch.where(torch.isnan(v), _nan_codes(v), lower + up.to(torch.uint8))
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte along the last dimension (even length): the even element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_e2m1`."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# --------------------------------------------------------------------------------------------------------
# Two-level scales
# --------------------------------------------------------------------------------------------------------


def global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """``amax / (448 * 6)`` in float32; 1 where amax is 0 or not finite (see the module docstring)."""
    amax = amax.float()
    fine = torch.isfinite(amax) & (amax > 0)
    return torch.where(fine, amax / (E4M3_MAX * E2M1_MAX), torch.ones_like(amax))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    extra_rows, extra_cols = (-x.shape[0]) % rows, (-x.shape[1]) % cols
    if extra_rows or extra_cols:
        x = torch.nn.functional.pad(x, (0, extra_cols, 0, extra_rows))
    return x


def quantize_nvfp4(
    x: torch.Tensor,
    global_scale: torch.Tensor | None = None,
    tile_rows: int = 1,
    uniform: torch.Tensor | None = None,
    *,
    rht_signs: torch.Tensor | None = None,
    sr_key: "int | torch.Tensor | None" = None,
) -> NVFP4Tensor:
    """NVFP4 codes, E4M3 block scales and the global scale of a 2-D ``x`` (K last).

    ``global_scale``: the per-tensor scale (default :func:`global_scale_from_amax` of ``x``'s amax; torchao's
    ``per_tensor_amax_to_scale`` for finite, non-zero amaxes). ``tile_rows=16``: 16x16 tiles (weights) instead
    of 1x16 blocks. ``uniform``: numbers in [0, 1) of the padded shape for stochastic rounding (default: round to
    nearest even). K and the rows are zero-padded to whole blocks (zeros change no amax). ``rht_signs``: cast
    :func:`rht_blocks` of the padded ``x`` with these 16 signs. ``sr_key``: round stochastically with
    :func:`uniform_like` of the padded shape and this key (instead of ``uniform``).

    A CUDA ``x`` is cast by one Triton launch (two without a global scale) when the kernels run there
    (``kernels/nvfp4_cast.py``, :func:`fp8_lightning.ops.dispatch.nvfp4_kernels`); a plain CPU float32/bfloat16
    ``x`` by the C codec when it is built and enabled (``cpu_codec.nvfp4_quantize``,
    :func:`fp8_lightning.ops.dispatch.nvfp4_codec`); both with the bits of the pure-torch reference.
    """
    _check_nvfp4_arguments(x, tile_rows)
    global_scale = _checked_global_scale(global_scale, x)
    _check_rounding_arguments(x, tile_rows, uniform, rht_signs)
    if sr_key is not None and uniform is not None:
        raise ValueError("quantize_nvfp4 takes uniform numbers or a stochastic-rounding key, not both; pass one.")
    kernels = dispatch.nvfp4_kernels(x, global_scale, tile_rows, uniform, rht_signs)
    if kernels is not None:
        codes, scales, global_scale = kernels.triton_nvfp4_cast(x, global_scale, tile_rows, rht_signs, sr_key)
        k = x.shape[1] if rht_signs is None else _round_up(x.shape[1], NVFP4_BLOCK)  # the RHT fills the padding
        return NVFP4Tensor(codes, scales, global_scale, (x.shape[0], k), tile_rows)
    if rht_signs is not None:
        x = rht_blocks(_pad_to(x.float(), 1, NVFP4_BLOCK), rht_signs)
    if sr_key is not None:
        uniform = uniform_like((_round_up(x.shape[0], tile_rows), _round_up(x.shape[1], NVFP4_BLOCK)), sr_key,
                               x.device)
    codec = dispatch.nvfp4_codec(x, global_scale, tile_rows, uniform)
    if codec is None:
        return _quantize_reference(x, global_scale, tile_rows, uniform)
    if global_scale is None:
        global_scale = global_scale_from_amax(codec.nvfp4_amax(x))
    global_scale = global_scale.float()
    codes, scales = codec.nvfp4_quantize(x, global_scale.item(), tile_rows, uniform)
    return NVFP4Tensor(codes, scales, global_scale, tuple(x.shape), tile_rows)


def _check_nvfp4_arguments(x: torch.Tensor, tile_rows: int) -> None:
    if not torch.is_tensor(x):
        raise TypeError(f"quantize_nvfp4 takes a 2-D floating-point tensor (K last); got {type(x).__name__}.")
    if x.dim() != 2:
        raise ValueError(f"quantize_nvfp4 takes a 2-D tensor (K last); got shape {tuple(x.shape)}. Reshape it to "
                         "(-1, K) first (blocks of 16 run along the last dimension) and back afterwards.")
    if not x.is_floating_point():
        raise TypeError(f"quantize_nvfp4 takes a floating-point tensor; got {x.dtype}.")
    if tile_rows not in (1, NVFP4_BLOCK):
        raise ValueError(f"tile_rows={tile_rows} is invalid; allowed: 1 (1x16 blocks) or 16 (16x16 tiles).")


def _checked_global_scale(global_scale, x: torch.Tensor) -> torch.Tensor | None:
    """``global_scale`` as a float32 tensor of one element (a Python number is taken as one), or None. Its value is
    not read (that would wait on a GPU): it must be finite and > 0, as :func:`global_scale_from_amax` gives."""
    if global_scale is None:
        return None
    if isinstance(global_scale, (int, float)) and not isinstance(global_scale, bool):
        return torch.tensor(float(global_scale), dtype=torch.float32, device=x.device)
    if not (torch.is_tensor(global_scale) and global_scale.is_floating_point() and global_scale.numel() == 1):
        what = (f"shape {tuple(global_scale.shape)}, {global_scale.dtype}" if torch.is_tensor(global_scale)
                else type(global_scale).__name__)
        raise ValueError(f"quantize_nvfp4: global_scale must be one positive finite number (a float or a one-element "
                         f"floating-point tensor, e.g. global_scale_from_amax(x.abs().amax())); got {what}.")
    return global_scale


def _check_rounding_arguments(x: torch.Tensor, tile_rows: int, uniform, rht_signs) -> None:
    padded = (_round_up(x.shape[0], tile_rows), _round_up(x.shape[1], NVFP4_BLOCK))
    if uniform is not None and (not torch.is_tensor(uniform) or tuple(uniform.shape) != padded):
        what = tuple(uniform.shape) if torch.is_tensor(uniform) else type(uniform).__name__
        raise ValueError(f"quantize_nvfp4: uniform must be a tensor of numbers in [0, 1) of the padded shape {padded} "
                         f"(rows to whole tiles, K to whole 16-blocks); got {what}. Or pass sr_key= instead.")
    if rht_signs is not None and (not torch.is_tensor(rht_signs) or tuple(rht_signs.shape) != (NVFP4_BLOCK,)):
        what = tuple(rht_signs.shape) if torch.is_tensor(rht_signs) else type(rht_signs).__name__
        raise ValueError(f"quantize_nvfp4: rht_signs must be a tensor of 16 signs (+1 or -1, e.g. rht_signs(seed)); "
                         f"got {what}.")


def _quantize_reference(
    x: torch.Tensor,
    global_scale: torch.Tensor | None = None,
    tile_rows: int = 1,
    uniform: torch.Tensor | None = None,
) -> NVFP4Tensor:
    """:func:`quantize_nvfp4` in pure torch, on any device: the reference the C codec is held to."""
    _check_nvfp4_arguments(x, tile_rows)
    rows, k = x.shape
    xf = _pad_to(x.float(), tile_rows, NVFP4_BLOCK)
    if global_scale is None:
        global_scale = global_scale_from_amax(xf.abs().amax() if xf.numel() else xf.new_zeros(()))
    global_scale = global_scale.float()
    codes, scales = nvfp4_encode_blocks(xf, global_scale, tile_rows, uniform)
    return NVFP4Tensor(codes, scales, global_scale, (rows, k), tile_rows)


def nvfp4_encode_blocks(
    xf: torch.Tensor, global_scale: torch.Tensor, tile_rows: int = 1, uniform: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes, E4M3 block scales) of float32 ``xf`` (rows a multiple of ``tile_rows``, K of 16) under
    ``global_scale``: a float32 scalar, or a tensor that broadcasts to the (row tiles, K blocks) block scales (one
    global scale per expert or group of a stacked tensor: each block's arithmetic is that of its own cast)."""
    pr, pk = xf.shape
    tiles = xf.reshape(pr // tile_rows, tile_rows, pk // NVFP4_BLOCK, NVFP4_BLOCK)
    block_amax = tiles.abs().amax(dim=(1, 3))  # (row tiles, K blocks)
    block_scale = block_amax / E2M1_MAX / global_scale
    scales = torch.clamp(block_scale, min=E4M3_TINY, max=E4M3_MAX).to(torch.float8_e4m3fn)
    # x * ((1 / s_global) / s_block), each step rounded to float32: torchao 0.18's and TE's encode arithmetic
    encode = (1.0 / global_scale) / scales.float()
    factors = encode.repeat_interleave(tile_rows, dim=0).unsqueeze(-1)
    scaled = torch.clamp(xf.reshape(pr, pk // NVFP4_BLOCK, NVFP4_BLOCK) * factors, -E2M1_MAX, E2M1_MAX).reshape(pr, pk)
    codes = e2m1_codes(scaled) if uniform is None else stochastic_e2m1_codes(scaled, uniform)
    return pack_e2m1(codes), scales


def block_multipliers(q: NVFP4Tensor) -> torch.Tensor:
    """``s_global * s_block`` per element block, float32 of shape (padded rows, K blocks): each block's factor."""
    factors = q.global_scale * q.block_scales.float()
    return factors.repeat_interleave(q.tile_rows, dim=0)


def dequantize_nvfp4(q: NVFP4Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values an NVFP4 tensor stands for, ``e2m1 * (s_global * s_block)`` in float32, unpadded, in
    ``out_dtype``."""
    if not isinstance(q, NVFP4Tensor):
        raise TypeError(f"dequantize_nvfp4 takes the NVFP4Tensor quantize_nvfp4 returns; got {type(q).__name__}.")
    if not (isinstance(out_dtype, torch.dtype) and out_dtype.is_floating_point and out_dtype.itemsize >= 2):
        raise ValueError(f"dequantize_nvfp4: out_dtype={out_dtype} is invalid; allowed: torch.float32, torch.bfloat16, "
                         "torch.float16 or torch.float64.")
    values = e2m1_values(unpack_e2m1(q.codes))
    factors = block_multipliers(q).repeat_interleave(NVFP4_BLOCK, dim=1)
    rows, k = q.shape
    return (values * factors[: values.shape[0]])[:rows, :k].to(out_dtype)


# --------------------------------------------------------------------------------------------------------
# Random Hadamard transform
# --------------------------------------------------------------------------------------------------------


def hadamard_16(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 16x16 Sylvester Hadamard matrix (entries +-1; ``H @ H.T = 16 I``)."""
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < NVFP4_BLOCK:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def rht_signs(seed: int) -> torch.Tensor:
    """The random sign vector (16 entries of +-1, float32) of seed ``seed``: the same on every machine."""
    bits = _hash32(torch.arange(NVFP4_BLOCK, dtype=torch.int64), seed)
    return torch.where(bits & 1 == 1, -1.0, 1.0).float()


def rht_matrix(signs: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``diag(signs) @ H16 / 4``: orthonormal, so ``R @ R.T = I``. Built elementwise (every entry is +-1/4, exact),
    without reading the signs on the host, so a compiled graph traces it."""
    return signs.to(dtype)[:, None] * hadamard_16(dtype).to(signs.device) / 4.0


def rht_blocks(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rht` of ``x`` (K last, K a multiple of 16) with ``rht_matrix(signs)``, computed in float32 in a
    fixed order that every backend repeats: each block times the signs, the four butterfly stages of the fast
    Walsh-Hadamard transform (pairs ``i``, ``i + h`` for h = 1, 2, 4, 8 become ``a + b``, ``a - b``), then times 1/4.
    A matrix product sums in an order the library picks; this is the form the Triton cast is held to bit for bit."""
    rows, k = x.shape
    v = x.float().reshape(-1, NVFP4_BLOCK) * signs.float().to(x.device)
    for h in (1, 2, 4, 8):
        pairs = v.reshape(-1, 2, h)
        a, b = pairs[:, 0], pairs[:, 1]
        v = torch.stack((a + b, a - b), dim=1)
    return (v.reshape(rows, k) * 0.25)


def apply_rht(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``x`` (K last, K a multiple of 16) with each 16-element block along K multiplied by ``matrix``."""
    rows, k = x.shape
    return (x.reshape(rows, k // NVFP4_BLOCK, NVFP4_BLOCK) @ matrix.to(x.dtype)).reshape(rows, k)


# --------------------------------------------------------------------------------------------------------
# Counter-based uniform numbers (stochastic rounding)
# --------------------------------------------------------------------------------------------------------


def _hash32(index: torch.Tensor, seed: "int | torch.Tensor") -> torch.Tensor:
    """A 32-bit hash (murmur3's finaliser) of ``index * golden + seed``, as int64 in [0, 2**32)."""
    h = (index * 0x9E3779B1 + seed) & _MASK32
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def _is_fake(key) -> bool:
    """Whether ``key`` is a tensor without data to read on the host (a meta or fake tensor)."""
    return torch.is_tensor(key) and (key.is_meta or type(key) is not torch.Tensor)


def mix_seed(*parts: "int | torch.Tensor") -> "int | torch.Tensor":
    """One 32-bit key from several (seed, rank, counter): each part hashed into the running key."""
    key = 0
    for i, part in enumerate(parts):
        key = _hash32(torch.as_tensor(part, dtype=torch.int64) + i * 0x632BE5AB, key)
    return key


def uniform_like(shape: tuple[int, int], key: "int | torch.Tensor", device: torch.device | str = "cpu") -> torch.Tensor:
    """Float32 numbers in [0, 1) (24 random bits each) for every position of ``shape``, from ``key`` alone (on
    the CPU, by the C codec when it is enabled: ``cpu_codec.nvfp4_uniform``, the same bits)."""
    if torch.device(device).type == "cpu" and dispatch.cpu_codec() is not None and not _is_fake(key):
        return dispatch.cpu_codec().nvfp4_uniform(shape, int(key))
    return _uniform_reference(shape, key, device)


def _uniform_reference(shape: tuple[int, int], key: "int | torch.Tensor", device: torch.device | str = "cpu"):
    """:func:`uniform_like` in pure torch, on any device: the reference the C codec is held to."""
    index = torch.arange(shape[0] * shape[1], dtype=torch.int64, device=device).reshape(shape)
    key = key.to(device) if torch.is_tensor(key) else key
    return uniform_at(index, key)


def uniform_at(index: torch.Tensor, key: "int | torch.Tensor") -> torch.Tensor:
    """The number of :func:`uniform_like` at each flat position ``index`` (int64) under ``key`` (a key per position
    where ``key`` is a tensor that broadcasts to ``index``): elementwise, so many casts' noise comes in one pass."""
    return (_hash32(index, key) >> 8).float() * 2.0**-24


__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "NVFP4_BLOCK",
    "NVFP4Tensor",
    "apply_rht",
    "block_multipliers",
    "dequantize_nvfp4",
    "e2m1_codes",
    "e2m1_values",
    "global_scale_from_amax",
    "hadamard_16",
    "mix_seed",
    "nvfp4_encode_blocks",
    "pack_e2m1",
    "quantize_nvfp4",
    "rht_blocks",
    "rht_matrix",
    "rht_signs",
    "stochastic_e2m1_codes",
    "uniform_like",
    "uniform_at",
    "unpack_e2m1",
]
