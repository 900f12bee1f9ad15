"""Storage formats for optimizer states: how one state tensor is kept between steps.

An optimizer state (Adam's first moment ``m``, second moment ``v``, SGD's momentum buffer) is read once and
written once per step, so it can live in a narrow format as long as each step decodes it to float32, updates it
in float32 and encodes it again. A :class:`StateFormat` names that narrow format:

``float32`` / ``bfloat16`` / ``float16`` with ``block_size=0``
    a plain cast (no scale).
``float8_e4m3fn`` / ``float8_e5m2`` / ``float16`` with ``block_size=B``
    the state is flattened and cut into blocks of ``B`` consecutive elements; each block gets one float32
    multiplier ``scale = dtype_max / amax(block)`` (the amax of the block's finite values: a NaN or infinite
    element stays NaN or saturates on its own) and ``data = saturate(x * scale)``; decoding computes
    ``data / scale``. Per-block scales keep the relative error bounded by the format's mantissa (E4M3: 2**-4)
    for every element whose magnitude is within the format's dynamic range of its block maximum, which is what a
    per-tensor scale cannot promise for states whose magnitudes span many binades across a tensor.
    The last block is zero-padded; the scale of a block without a nonzero finite value is 1.

The design in full: ``docs/design/notes.md``, section ``fp8_lightning.optim.state_formats``.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from fp8_lightning.ops.dispatch import fast_fp8_to_float32, fast_to_fp8_saturated
from fp8_lightning.quantize import max_over_amax

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
_ALIASES = {
    "fp32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "e4m3": "float8_e4m3fn",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "e5m2": "float8_e5m2",
    "fp8_e5m2": "float8_e5m2",
}
_TRANSFORMS = ("none", "sqrt")
_FP8 = ("float8_e4m3fn", "float8_e5m2")


def canonical_dtype_name(name: "str | torch.dtype") -> str:
    """``"e4m3"``/``"fp16"``/``torch.float16``... to the canonical name used in :class:`StateFormat`."""
    if isinstance(name, torch.dtype):
        name = str(name).removeprefix("torch.")
    key = _ALIASES.get(str(name).lower(), str(name).lower())
    if key not in _DTYPES:
        raise ValueError(
            f"Unknown optimizer state dtype {name!r}; allowed: {sorted(_DTYPES)} (or aliases {sorted(_ALIASES)})."
        )
    return key


@dataclasses.dataclass(frozen=True)
class StateFormat:
    """How one optimizer state is stored: dtype, block size of the scales (0 = unscaled), value transform."""

    dtype: str = "float32"
    block_size: int = 0
    transform: str = "none"

    def __post_init__(self):
        object.__setattr__(self, "dtype", canonical_dtype_name(self.dtype))
        if self.transform not in _TRANSFORMS:
            raise ValueError(f"transform={self.transform!r} is invalid; allowed: {_TRANSFORMS}.")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 0:
            raise ValueError(
                f"block_size={self.block_size!r} is invalid; allowed: an integer >= 0 (the elements that share one "
                "scale, e.g. 128; 0 means one cast without a scale)."
            )
        if self.dtype in _FP8 and self.block_size == 0:
            raise ValueError(
                f"An FP8 state ({self.dtype}) needs per-block scales: set block_size (e.g. 128); got block_size=0."
            )
        if self.dtype == "float32" and (self.block_size or self.transform != "none"):
            raise ValueError("A float32 state is stored as is: use block_size=0 and transform='none'.")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def scaled(self) -> bool:
        return self.block_size > 0

    @property
    def is_full_precision(self) -> bool:
        return self.dtype == "float32"

    def bytes_per_element(self) -> float:
        """Storage per state element, scales included (ignoring the padding of the last block)."""
        itemsize = torch.empty((), dtype=self.torch_dtype).element_size()
        return itemsize + (4.0 / self.block_size if self.scaled else 0.0)

    @classmethod
    def parse(cls, value: "StateFormat | str | dict") -> "StateFormat":
        """``StateFormat``, a dict of its fields, or a string ``"e4m3"``, ``"e4m3:128"``, ``"e4m3:128:sqrt"``."""
        if isinstance(value, StateFormat):
            return value
        if isinstance(value, dict):
            return cls(**value)
        if isinstance(value, str):
            parts = value.split(":")
            dtype = parts[0]
            block = int(parts[1]) if len(parts) > 1 else (128 if canonical_dtype_name(dtype) in _FP8 else 0)
            transform = parts[2] if len(parts) > 2 else "none"
            return cls(dtype, block, transform)
        raise TypeError(f"Cannot make a StateFormat from {type(value).__name__}: give a StateFormat, dict or str.")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------------------------------
# Pure encode / decode
# ------------------------------------------------------------------------------------------------------------


def dtype_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def padded_numel(numel: int, block_size: int) -> int:
    return math.ceil(numel / block_size) * block_size if block_size else numel


def state_block_scales(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-row multiplier ``dtype_max / amax(row)`` (float32), the amax taken over the row's finite values only;
    1 where a row has no nonzero finite value.

    A NaN or infinite element must not decide the scale of its neighbours: an infinite amax would give the row
    the scale 0 (every element decodes as 0/0) and a NaN amax the scale 1 (small moments flush to zero), where
    ``torch.optim`` loses only the one element. Here the infinity saturates to the format's largest value and a
    NaN stays NaN, each on its own, and the other elements of the row keep their values.
    """
    magnitudes = blocks.abs()
    block_amax = torch.where(torch.isfinite(magnitudes), magnitudes, 0.0).amax(dim=-1)
    return torch.where(block_amax > 0, max_over_amax(dtype_max(dtype), block_amax), 1.0)


def saturating_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Clamp to ``dtype``'s finite range, then cast (round to nearest even). NaN stays NaN. FP8 dtypes take the
    core's cast (:func:`~fp8_lightning.ops.dispatch.fast_to_fp8_saturated`, which skips the clamp where the cast
    saturates by itself)."""
    if dtype.itemsize == 1:
        return fast_to_fp8_saturated(x, dtype)
    limit = dtype_max(dtype)
    return x.clamp(-limit, limit).to(dtype)


def encode_state(x: torch.Tensor, fmt: StateFormat) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Encode a state tensor. Returns ``(data, scale)``; ``scale`` is None for unscaled formats.

    Scaled formats return ``data`` flat with ``padded_numel`` elements and ``scale`` with one float32 per block.
    """
    x32 = x.detach().float()
    if fmt.transform == "sqrt":
        x32 = x32.clamp(min=0).sqrt()
    if not fmt.scaled:
        return saturating_cast(x32, fmt.torch_dtype) if fmt.dtype != "float32" else x32.clone(), None
    flat = x32.reshape(-1)
    pad = padded_numel(flat.numel(), fmt.block_size) - flat.numel()
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    blocks = flat.view(-1, fmt.block_size)
    scale = state_block_scales(blocks, fmt.torch_dtype)
    data = saturating_cast(blocks * scale.unsqueeze(-1), fmt.torch_dtype).reshape(-1)
    return data, scale


def decode_state(data: torch.Tensor, scale: torch.Tensor | None, fmt: StateFormat, shape: torch.Size) -> torch.Tensor:
    """Inverse of :func:`encode_state`: a float32 tensor of ``shape``."""
    numel = math.prod(shape)
    if fmt.scaled:
        if scale is None:
            raise ValueError(f"A state stored as {fmt} needs its block scales; got none.")
        values = fast_fp8_to_float32(data)  # float8 codes decoded in one vectorized pass on CPU
        x = (values.view(-1, fmt.block_size) / scale.unsqueeze(-1)).reshape(-1)[:numel].reshape(shape)
    else:
        x = fast_fp8_to_float32(data).reshape(shape)
    if fmt.transform == "sqrt":
        x = x * x
    return x


def storage_nbytes(data: torch.Tensor, scale: torch.Tensor | None) -> int:
    nbytes = data.numel() * data.element_size()
    return nbytes + (scale.numel() * scale.element_size() if scale is not None else 0)
