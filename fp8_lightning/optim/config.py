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

``default`` is built for loss parity at 6 bytes per parameter or less (bf16 weights 2 + gradient 2, or about
0.1 with gradients released in backward, + 3.06): E4M3 for ``m`` is what MS-AMP/FP8-LM showed to be harmless
(``m`` is a noisy average whose sign and rough size is what matters); ``v`` goes through the square root so
that 8 bits cover the range of the gradients (``state_formats.py``); the master of a bf16 weight keeps 16
significant bits (bf16 + one remainder byte), which is what the updates need: the measured loss cost of *no*
master is about 4% for bf16 weights, the cost of the 16-bit master is within noise of an exact float32 one
(``benchmarks/results/optimizer_convergence*``). A float32 parameter is its own (exact) master.
``max_savings`` keeps no master copy. Rounded to nearest, a bf16 parameter loses every update smaller than
half a bf16 ulp (measured: +4% loss); rounded stochastically (``master_weights="bf16_stochastic"``, no extra
bytes) it keeps them in expectation, which measured at parity, so that is the preset.
Earlier configurations stay available as options: ``exp_avg_sq="fp16:128"`` (11-bit ``v``, +1 byte) and
``master_weights="bf16_remainder"`` (exact float32 master, +1 byte).

Tensors with fewer than ``min_quantize_numel`` elements (biases, norm gains) keep float32 states: their bytes are
negligible, and the padding of a 128-element block plus a 4-byte scale would cost more than it saves.
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
                overrides[name] = dataclasses.replace(fmt, block_size=int(block_size))
    unknown = set(overrides) - {f.name for f in dataclasses.fields(FP8OptimizerConfig)}
    if unknown:
        allowed = [f.name for f in dataclasses.fields(FP8OptimizerConfig)] + ["block_size"]
        raise TypeError(f"Unknown FP8 optimizer option(s) {sorted(unknown)}; allowed: {allowed}.")
    return dataclasses.replace(config, **overrides) if overrides else config
