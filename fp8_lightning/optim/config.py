"""What the FP8 optimizer stores, and the two presets.

:class:`FP8OptimizerConfig` says, per state, how it is stored (:class:`StateFormat`), how master weights are kept
(see ``master_weights.py``) and below which size a tensor is not worth quantizing.

Presets (bytes per parameter *held by the optimizer* for a large tensor, block size 128, scales included):

==============  =====================  ===========================  =========================  ==========
preset          first moment m         second moment v              master weights             optimizer
==============  =====================  ===========================  =========================  ==========
``default``     E4M3, per-block scales  E4M3 of sqrt(v), per-block  bf16 params: +int8          2.06 (+1)
                                                                    remainder (16-bit master)
``max_savings`` E4M3, per-block scales  E4M3 of sqrt(v), per-block  none; bf16 params: updates  2.06
                                                                    rounded stochastically
==============  =====================  ===========================  =========================  ==========

The design in full: ``docs/design/notes.md``, section ``fp8_lightning.optim.config``.
"""

from __future__ import annotations

import dataclasses

from fp8_lightning.optim.master_weights import MASTER_KINDS
from fp8_lightning.optim.state_formats import StateFormat

DEFAULT_BLOCK_SIZE = 128
DEFAULT_MIN_QUANTIZE_NUMEL = 4096


@dataclasses.dataclass(frozen=True)
class FP8OptimizerConfig:
    """Storage of each optimizer state. ``exp_avg`` is also the format of SGD's momentum buffer."""

    exp_avg: StateFormat = StateFormat("float8_e4m3fn", DEFAULT_BLOCK_SIZE)
    exp_avg_sq: StateFormat = StateFormat("float8_e4m3fn", DEFAULT_BLOCK_SIZE, "sqrt")
    master_weights: str = "bf16_int8_remainder"
    min_quantize_numel: int = DEFAULT_MIN_QUANTIZE_NUMEL
    use_triton: bool = True

    def __post_init__(self):
        object.__setattr__(self, "exp_avg", StateFormat.parse(self.exp_avg))
        object.__setattr__(self, "exp_avg_sq", StateFormat.parse(self.exp_avg_sq))
        if self.master_weights not in MASTER_KINDS:
            raise ValueError(f"master_weights={self.master_weights!r} is invalid; allowed: {MASTER_KINDS}.")
        if self.exp_avg.transform != "none":
            raise ValueError(
                f"exp_avg transform={self.exp_avg.transform!r}: the first moment can be negative, so it cannot be "
                "stored through a square root; use transform='none'."
            )
        if not isinstance(self.use_triton, bool):  # bool("false") is True: a string must not turn the kernel on
            raise ValueError(f"use_triton={self.use_triton!r} is invalid; allowed: True or False.")
        if isinstance(self.min_quantize_numel, bool) or not isinstance(self.min_quantize_numel, int):
            raise ValueError(f"min_quantize_numel={self.min_quantize_numel!r} is invalid; allowed: an integer >= 0.")
        if self.min_quantize_numel < 0:
            raise ValueError(f"min_quantize_numel={self.min_quantize_numel} must be >= 0.")

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["exp_avg"] = self.exp_avg.to_dict()
        out["exp_avg_sq"] = self.exp_avg_sq.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "FP8OptimizerConfig":
        return cls(**data)


PRESETS: dict[str, FP8OptimizerConfig] = {
    "default": FP8OptimizerConfig(),
    "max_savings": FP8OptimizerConfig(
        exp_avg=StateFormat("float8_e4m3fn", DEFAULT_BLOCK_SIZE),
        exp_avg_sq=StateFormat("float8_e4m3fn", DEFAULT_BLOCK_SIZE, "sqrt"),
        master_weights="bf16_stochastic",
    ),
    # Every state in float32: the wrapper then reproduces torch.optim exactly (a reference and a debugging aid).
    "fp32": FP8OptimizerConfig(
        exp_avg=StateFormat("float32"), exp_avg_sq=StateFormat("float32"), master_weights="fp32"
    ),
}


def config_from(preset: "str | FP8OptimizerConfig | dict | None" = "default", **overrides) -> FP8OptimizerConfig:
    """A preset name (``"default"``, ``"max_savings"``, ``"fp32"``), a config, or a dict; then field overrides.

    ``block_size=N`` is a shortcut that sets the block size of both moments (where they are scaled).
    """
    if preset is None:
        preset = "default"
    if isinstance(preset, FP8OptimizerConfig):
        config = preset
    elif isinstance(preset, dict):
        config = FP8OptimizerConfig.from_dict(preset)
    elif isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"Unknown FP8 optimizer preset {preset!r}; allowed: {sorted(PRESETS)}.")
        config = PRESETS[preset]
    else:
        raise TypeError(f"preset must be a name, an FP8OptimizerConfig or a dict; got {type(preset).__name__}.")
    block_size = overrides.pop("block_size", None)
    if block_size is not None:
        for name in ("exp_avg", "exp_avg_sq"):
            fmt = StateFormat.parse(overrides.get(name, getattr(config, name)))
            if fmt.scaled:
                overrides[name] = dataclasses.replace(fmt, block_size=block_size)  # StateFormat checks it
    unknown = set(overrides) - {f.name for f in dataclasses.fields(FP8OptimizerConfig)}
    if unknown:
        allowed = [f.name for f in dataclasses.fields(FP8OptimizerConfig)] + ["block_size"]
        raise TypeError(f"Unknown FP8 optimizer option(s) {sorted(unknown)}; allowed: {allowed}.")
    return dataclasses.replace(config, **overrides) if overrides else config
