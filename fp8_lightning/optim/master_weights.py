"""Master weights: where the optimizer keeps the precise copy of a parameter that its updates accumulate into.

A training step changes a weight by ``lr * update``, often far less than one unit in the last place (ulp) of a
bfloat16 weight (bf16 keeps 8 significant bits: a weight of 0.02 has an ulp of 2**-13 ~ 1.2e-4, while
``lr = 1e-4`` moves it by about 1e-4 per step, and by 1e-6 at the end of a cosine schedule). Rounding every step
to bf16 silently drops such updates. The choices, per parameter:

``"fp32"``
    A float32 parameter is its own master (nothing extra is held). A lower-precision parameter gets a float32
    copy in the optimizer state (4 extra bytes per element).
``"bf16_remainder"``
    For a bfloat16 parameter: the optimizer keeps only the 16 low bits that bf16 drops, as an int16 remainder.
    ``bf16 bits << 16 + remainder`` reconstructs the float32 master *exactly* (2 extra bytes per element instead
    of 4). The bf16 parameter the model computes with is the float32 master rounded to nearest (ties away from
    zero), so the forward pass sees the best bf16 weight, not a truncated one. Other dtypes fall back to "fp32".
``"bf16_int8_remainder"``
    For a bfloat16 parameter: one signed byte of remainder (1 extra byte per element). The master is the float32
    value rounded to nearest to 16 significant bits (bf16's 8 plus 8 more: a "float24" with bf16's exponent),
    stored as ``bf16 bits << 8 + remainder``; the bf16 parameter is that value rounded to nearest. An update is
    kept as long as it is at least half a 16-bit ulp (2**-16 of the weight's binade, i.e. 1/256 of a bf16 ulp),
    so the many updates far below a bf16 ulp still accumulate; what is lost per step is at most 2**-17 relative,
    about the float16 master's resolution (2**-11) divided by 64, for half the bytes. Reconstruction from the
    stored bytes is exact; only the rounding to 16 bits at each store loses anything. Other dtypes fall back to
    "fp32".
``"fp16_scaled"``
    A float16 copy with one power-of-two scale per tensor (2 extra bytes; 11 significant bits instead of bf16's 8).
    Lossier than the remainder, kept for parity with MS-AMP's 16-bit master weights.
``"param"``
    No master: the update is computed in float32 and rounded into the parameter's own dtype (zero extra bytes;
    updates below half an ulp are lost). For maximum savings only.

The bit arithmetic (:func:`split_fp32`, :func:`join_fp32`) is pure and exact; tests compare it with float64.
"""

from __future__ import annotations

import torch

MASTER_KINDS = ("fp32", "bf16_remainder", "bf16_int8_remainder", "fp16_scaled", "param")
_REMAINDER_KINDS = ("bf16_remainder", "bf16_int8_remainder")
_FP16_TARGET = 2.0**14  # the scaled master's amax lands in [2**13, 2**14]: far from fp16's max 65504


def split_fp32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 -> (bf16 rounded to nearest, ties away from zero; int16 remainder) with an exact inverse.

    Works on the bit patterns: a float32's magnitude bits are monotonic in its value for either sign, so adding
    ``0x8000`` to them and keeping the high half rounds the magnitude to nearest; the remainder is what is left.
    """
    bits = x.float().contiguous().view(torch.int32)
    high = (bits + 0x8000) >> 16  # arithmetic shift: the sign bit stays where it is
    low = bits - (high << 16)  # in [-32768, 32767]
    high_bf16 = high.to(torch.int16).view(torch.bfloat16)
    return high_bf16, low.to(torch.int16)


def join_fp32(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`split_fp32`: the exact float32 value."""
    high_bits = high.contiguous().view(torch.int16).to(torch.int32)
    return ((high_bits << 16) + low.to(torch.int32)).view(torch.float32)


def split_fp32_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 -> (bf16, int8 remainder): ``x`` rounded to nearest to 16 significant bits, then split.

    Same bit arithmetic as :func:`split_fp32`, twice: round the magnitude bits to nearest at bit 8 (keeping 24 of
    the 32 bits: sign, exponent and 15 stored mantissa bits), then round that to bf16 at bit 16 and keep the 8
    bits in between as a signed byte in [-128, 127]. Ties go away from zero at both roundings.
    """
    bits = x.float().contiguous().view(torch.int32)
    bits24 = (bits + 0x80) >> 8  # arithmetic shift: sign preserved, magnitude rounded to nearest
    high = (bits24 + 0x80) >> 8
    low = bits24 - (high << 8)  # in [-128, 127]
    return high.to(torch.int16).view(torch.bfloat16), low.to(torch.int8)


def join_fp32_int8(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`split_fp32_int8`: the 16-significant-bit master as an exact float32."""
    high_bits = high.contiguous().view(torch.int16).to(torch.int32)
    return (((high_bits << 8) + low.to(torch.int32)) << 8).view(torch.float32)


def fp16_master_scale(x: torch.Tensor) -> torch.Tensor:
    """Power-of-two multiplier that puts amax(x) in [2**13, 2**14] (1 for an all-zero tensor)."""
    amax = x.abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    _, exponent = torch.frexp(safe)  # safe = m * 2**exponent, m in [0.5, 1)
    scale = torch.ldexp(torch.ones_like(safe), (14 - exponent).to(torch.int32))
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def resolve_master_kind(kind: str, param_dtype: torch.dtype) -> str:
    """The kind actually used for a parameter of ``param_dtype`` ("none" when the parameter is its own master)."""
    if kind not in MASTER_KINDS:
        raise ValueError(f"master_weights={kind!r} is invalid; allowed: {MASTER_KINDS}.")
    if param_dtype in (torch.float32, torch.float64) or kind == "param":
        return "none"
    if kind in _REMAINDER_KINDS and param_dtype != torch.bfloat16:
        return "fp32"
    return kind


def init_master(param: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
    """The state entries holding the master copy of ``param`` (its local tensor) for a resolved ``kind``."""
    if kind == "none":
        return {}
    if kind == "fp32":
        return {"master": param.detach().float().clone()}
    if kind == "bf16_remainder":
        return {"master_remainder": torch.zeros_like(param, dtype=torch.int16)}
    if kind == "bf16_int8_remainder":
        return {"master_remainder": torch.zeros_like(param, dtype=torch.int8)}
    if kind == "fp16_scaled":
        return encode_fp16_master(param.detach().float())
    raise ValueError(f"Unresolved master kind {kind!r}.")


def encode_fp16_master(x32: torch.Tensor) -> dict[str, torch.Tensor]:
    scale = fp16_master_scale(x32)
    return {"master_fp16": (x32 * scale).to(torch.float16), "master_scale": scale}


def load_master(param: torch.Tensor, state: dict, kind: str) -> torch.Tensor:
    """The float32 master value of ``param`` (a new tensor unless the parameter is float32 itself)."""
    if kind == "none":
        return param.detach().float()  # the same tensor for float32 parameters: updated in place
    if kind == "fp32":
        return state["master"]
    if kind == "bf16_remainder":
        return join_fp32(param.detach(), state["master_remainder"])
    if kind == "bf16_int8_remainder":
        return join_fp32_int8(param.detach(), state["master_remainder"])
    if kind == "fp16_scaled":
        return state["master_fp16"].float() / state["master_scale"]
    raise ValueError(f"Unresolved master kind {kind!r}.")


def store_master(param: torch.Tensor, state: dict, kind: str, x32: torch.Tensor) -> None:
    """Write the updated float32 master back: into the state and into the parameter the model uses."""
    with torch.no_grad():
        if kind == "bf16_remainder":
            high, low = split_fp32(x32)
            param.copy_(high)
            state["master_remainder"].copy_(low)
            return
        if kind == "bf16_int8_remainder":
            high, low = split_fp32_int8(x32)
            param.copy_(high)
            state["master_remainder"].copy_(low)
            return
        if kind == "fp16_scaled":
            state.update(encode_fp16_master(x32))
            x32 = state["master_fp16"].float() / state["master_scale"]
        if param.data_ptr() != x32.data_ptr():
            param.copy_(x32)
