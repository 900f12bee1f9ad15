"""Master weights: where the optimizer keeps the precise copy of a parameter that its updates accumulate into.

The design in full: ``docs/design/notes.md``, section ``fp8_lightning.optim.master_weights``.
"""

from __future__ import annotations

import torch

MASTER_KINDS = ("fp32", "bf16_remainder", "bf16_int8_remainder", "fp16_scaled", "param", "bf16_stochastic")
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


def rounding_noise(numel: int, step: int, device=None) -> torch.Tensor:
    """``numel`` pseudo-random integers in [0, 2**16) (int32) from a hash of (element index, step).

    A counter-based integer hash (multiply and xor-shift rounds, all in int64 masked to 32 bits): deterministic,
    cheap, and free of generator state, so checkpoints need not carry one.
    """
    mask = 0xFFFFFFFF
    h = (torch.arange(numel, dtype=torch.int64, device=device) * 0x9E3779B1 + (step * 0x632BE5AB + 0x5851F42D)) & mask
    for multiplier in (0x2C1B3C6D, 0x297A2D39):
        h = ((h ^ (h >> 15)) * multiplier) & mask
    h = h ^ (h >> 16)
    return (h & 0xFFFF).to(torch.int32)


def round_to_bf16_stochastic(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """float32 -> bf16, rounding the magnitude up with probability (dropped bits) / 2**16, given uniform ``noise``.

    Adding ``noise`` in [0, 2**16) to the magnitude bits and truncating carries into bf16's last bit exactly when
    ``noise >= 2**16 - dropped``, i.e. with probability ``dropped / 2**16``: the expected result is ``x``.
    """
    bits = x.float().contiguous().view(torch.int32)
    high = (bits + noise.view(bits.shape)) >> 16  # arithmetic shift: sign kept, magnitude truncated after the add
    return high.to(torch.int16).view(torch.bfloat16)


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
    if kind == "bf16_stochastic" and param_dtype != torch.bfloat16:
        return "none"
    return kind


def init_master(param: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
    """The state entries holding the master copy of ``param`` (its local tensor) for a resolved ``kind``."""
    if kind in ("none", "bf16_stochastic"):
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
    if kind in ("none", "bf16_stochastic"):
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
        if kind == "bf16_stochastic":
            noise = rounding_noise(x32.numel(), int(state["step"].item()), x32.device)
            param.copy_(round_to_bf16_stochastic(x32, noise))
            return
        if kind == "fp16_scaled":
            state.update(encode_fp16_master(x32))
            x32 = state["master_fp16"].float() / state["master_scale"]
        if param.data_ptr() != x32.data_ptr():
            param.copy_(x32)
