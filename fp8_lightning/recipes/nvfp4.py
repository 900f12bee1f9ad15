"""NVFP4 (TransformerEngine's ``NVFP4BlockScaling``, NVIDIA's 4-bit training recipe): E2M1 values in 1x16 blocks
with E4M3 block scales and a float32 tensor scale (:mod:`fp8_lightning.nvfp4` holds the math).

Per GEMM operand, as in TE and the NVFP4 paper:

* input and output gradient: 1x16 blocks along each GEMM's K, cast from high precision twice (rowwise for fprop
  and dgrad, columnwise for wgrad); the columnwise (wgrad) copies of both pass through the random Hadamard
  transform (one seeded sign vector per layer, saved in its scaling state), so wgrad's product is unchanged in
  exact arithmetic;
* weight: 16x16 tiles (``fp4_2d_weights``), so its rowwise (fprop) and columnwise (dgrad) copies are the same
  numbers; with ``fp4_2d_weights=False`` 1x16 blocks along each GEMM's K;
* gradients round stochastically (``disable_stochastic_rounding=False``), with uniform numbers drawn from the
  layer's seed, the data-parallel rank and a per-layer cast counter (saved with the state): runs repeat exactly and
  a resumed run continues exactly; everything else rounds to nearest even.

The operand kind ``NVFP4`` holds the packed codes (uint8, K / 2 bytes per row) and each 16-block's float32
multiplier ``s_global * s_block`` (the divisor the cast used, so ``x_q = e2m1 * multiplier`` exactly), and in its
cache the GEMM scales (E4M3 block scales and the float32 global scale, :mod:`fp8_lightning.nvfp4_gemm`), which
:func:`_operand`, the one place operands are made, fills. Its GEMM runs cuBLAS's FP4 GEMM on CUDA sm_100+ (CUDA 12.8,
torch's ``scaled_mm`` with BlockWise1x16), else the dequantized operands multiplied in float32. Rows of columnwise
copies (the token dimension M) are zero-padded to whole blocks; both wgrad operands are padded alike, so zeros add
nothing.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import ClassVar

import torch
import torch.distributed as dist

from fp8_lightning.formats import Format
from fp8_lightning.gemm_routes import GemmRoute, arch_name, cuda_name, emulated_on_gpu, native_fp4
from fp8_lightning.nvfp4 import (
    E2M1_MAX,
    NVFP4_BLOCK,
    block_multipliers,
    e2m1_values,
    global_scale_from_amax,
    mix_seed,
    quantize_nvfp4,
    rht_blocks,
    rht_signs,
    unpack_e2m1,
)
from fp8_lightning.nvfp4_grouped import (
    NVFP4ExpertRows,
    group_keys,
    nvfp4_gathered_weights,
    nvfp4_group_columns,
    nvfp4_stacked_weights,
)
from fp8_lightning.nvfp4_shards import (
    nvfp4_recast_columns,
    nvfp4_shard_reason,
    nvfp4_transposed_tiles,
    pack_nvfp4_experts,
    pack_nvfp4_shard,
    unpack_nvfp4_experts,
    unpack_nvfp4_gathered,
)
from fp8_lightning.nvfp4_gemm import (
    NATIVE_NVFP4_MIN_CAPABILITY,
    NATIVE_NVFP4_MIN_CUDA,
    gemm_scales,
    nvfp4_mm,
    nvfp4_tensor,
)
from fp8_lightning.ops import dispatch
from fp8_lightning.quantize import OperandCache, OperandKind, Quantized
from fp8_lightning.traced import plan_for
from fp8_lightning.recipes.base import Recipe, check_flags, invalid
from fp8_lightning.scaling import agreed_amax

NVFP4 = OperandKind("nvfp4")
_ROW, _COLUMN = 0, 1  # which copy a stochastic cast makes: part of its seed


class NVFP4LayerState:
    """One layer's NVFP4 state: the RHT sign vector, the count of stochastic casts (the per-step part of the
    rounding seed) and the layer's rounding seed (the recipe's seed, mixed with the layer's name at conversion:
    :meth:`bind_name`, so that layers draw independent noise). Shared by the ``"input"`` and ``"grad_output"`` roles;
    it holds no amax, so the once-per-step scale update passes it by (``delayed = False``)."""

    delayed = False
    _dirty = False
    dirty = False
    generation = 0

    def __init__(self, recipe: "NVFP4BlockScaling", device: torch.device | str = "cpu"):
        self.signs = rht_signs(recipe.seed).to(device)
        self.sr_casts = torch.zeros((), dtype=torch.int64, device=device)
        self.seed = recipe.seed
        self.sr_seed = torch.full((), recipe.seed, dtype=torch.int64, device=device)
        # tensor parallelism: the group holding the parts of each split operand (role -> group), whose casts take
        # the global scale of the whole tensor (NVFP4BlockScaling.tensor_parallel_bind)
        self.amax_groups: dict = {}

    def __getstate__(self) -> dict:
        """For pickle and deepcopy: process groups do not travel (a copy casts as an unsplit layer)."""
        return {**self.__dict__, "amax_groups": {}}

    def bind_name(self, name: str) -> None:
        """The layer named ``name`` gets its own stochastic-rounding seed (alike on every rank and run)."""
        seed = zlib.crc32(f"{self.seed}/{name}".encode())
        self.sr_seed = torch.full((), seed, dtype=torch.int64, device=self.sr_casts.device)

    def traced_tensors(self) -> tuple[torch.Tensor, ...]:
        return self.signs, self.sr_casts, self.sr_seed

    def state_dict(self) -> dict:
        return {"rht_signs": self.signs.detach().cpu().clone(), "sr_casts": self.sr_casts.detach().cpu().clone(),
                "sr_seed": self.sr_seed.detach().cpu().clone()}

    def load_state_dict(self, state: dict) -> None:
        device = self.signs.device
        self.signs = state["rht_signs"].to(device=device, dtype=torch.float32).clone()
        self.sr_casts = state["sr_casts"].to(device=device, dtype=torch.int64).clone()
        seed = state.get("sr_seed", torch.tensor(self.seed))  # saved before per-layer seeds: the recipe's, as then
        self.sr_seed = seed.to(device=device, dtype=torch.int64).clone()

    def move_to(self, device: torch.device) -> None:
        if self.signs.device != device:
            self.signs, self.sr_casts, self.sr_seed = (t.to(device) for t in (self.signs, self.sr_casts, self.sr_seed))


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _operand(q) -> Quantized:
    """The GEMM operand of a cast: its codes, each block's multiplier (the emulation's) and, in its cache, the GEMM
    scales cuBLAS's FP4 GEMM reads (:mod:`fp8_lightning.nvfp4_gemm`)."""
    rows = q.codes.shape[0]
    return Quantized(q.codes, block_multipliers(q)[:rows], NVFP4, OperandCache(native=gemm_scales(q, rows)))


def _agreed_copy(x: torch.Tensor, key, copy: int, group) -> Quantized:
    """1x16 blocks of ``x`` with the global scale of the amax agreed across ``group`` (one part of a split
    tensor); ``key``: stochastic rounding's key, or None (round to nearest)."""
    sr_key = None if key is None else mix_seed(key, copy)
    return _operand(quantize_nvfp4(x, global_scale_from_amax(agreed_amax(x, group)), sr_key=sr_key))


def _pad_columns(x: torch.Tensor) -> torch.Tensor:
    extra = (-x.shape[1]) % NVFP4_BLOCK
    return torch.nn.functional.pad(x, (0, extra)) if extra else x


@dataclasses.dataclass(frozen=True)
class NVFP4BlockScaling(Recipe):
    """NVFP4: E2M1 codes, an E4M3 scale per 16 elements along K and a float32 scale per tensor.

    ``disable_rht``: no random Hadamard transform on the wgrad operands. ``disable_stochastic_rounding``: gradients
    round to nearest even too. ``fp4_2d_weights``: 16x16 weight tiles (the rowwise and columnwise weight copies are
    the same numbers); False: 1x16 blocks along each GEMM's K. ``seed``: the RHT sign vector's seed and the base of
    the stochastic-rounding seeds. The GEMMs run on cuBLAS's FP4 tensor cores on sm_100+ and are emulated
    (dequantized operands multiplied in float32) elsewhere.

    Args:
        fp8_format, fprop_fast_accum, grad_fast_accum: the fields every recipe has (:class:`Recipe`); both FP4
            GEMMs accumulate in float32 (cuBLAS refuses fast accumulation for FP4).
        disable_rht: skip the random Hadamard transform of the weight-gradient operands.
        disable_stochastic_rounding: round gradients to nearest instead of stochastically.
        fp4_2d_weights: 16x16 weight tiles (the same numbers in both weight copies) instead of 1x16 blocks.
        seed: seeds the Hadamard sign vector and the stochastic rounding (per step and rank).
    """

    name: ClassVar[str] = "nvfp4"
    operand_kind: ClassVar = NVFP4
    global_weight_amax: ClassVar[bool] = True  # FSDP2: every shard is cast with the whole weight's global scale
    wgrad_sums_padding: ClassVar[bool] = True  # the RHT spreads a group's tokens into its block padding

    fp8_format: Format = Format.E4M3  # the block scales' format (the values are E2M1)
    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    fp4_2d_weights: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        fmt = self.fp8_format
        if str(getattr(fmt, "value", fmt)).strip().upper() in ("HYBRID", "E5M2"):  # values are E2M1 whatever it says
            raise invalid(type(self).__name__, "fp8_format", fmt,
                          "E4M3, the format of NVFP4's block scales (values and gradients are E2M1)")
        super().__post_init__()
        check_flags(self, "disable_rht", "disable_stochastic_rounding", "fp4_2d_weights")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**31:
            raise invalid(type(self).__name__, "seed", self.seed, "an integer in [0, 2**31)")

    # -- the layer ------------------------------------------------------------------------------------------

    def shape_unsupported_reason(self, in_features, out_features, names=("in_features", "out_features")):
        bad = [f"{n}={v}" for n, v in zip(names, (in_features, out_features)) if v % 16]
        if not bad:
            return None
        return (f"{', '.join(bad)} not divisible by 16: NVFP4 scales blocks of 16 elements along each GEMM's K "
                "(NVFP4BlockScaling)")

    def operand_states(self, forward_dtype, backward_dtype) -> dict:
        state = NVFP4LayerState(self)
        return {"input": state, "grad_output": state}

    def cast(self, role, x, dtype, columnwise, columnwise_f32, state, record):
        if state is not None and role in state.amax_groups:  # a part of a tensor split by tensor parallelism
            return self._split_copies(role, x, columnwise, state, record)
        signs, counter, seed = (None, None, None) if state is None else state.traced_tensors()
        row, col = self._copies(role, x, signs, counter, record, seed)
        if not columnwise:
            return row, None
        return row, col()

    def _copies(self, role, x, signs, counter, record, seed=None):
        """(rowwise operand, a function making the columnwise operand) of a 2-D ``x``; ``seed``: the layer's."""
        if role == "weight":
            tile = NVFP4_BLOCK if self.fp4_2d_weights else 1
            return _operand(quantize_nvfp4(x, tile_rows=tile)), lambda: _operand(quantize_nvfp4(x.t(), tile_rows=tile))
        stochastic = role == "grad_output" and not self.disable_stochastic_rounding
        key = None
        if stochastic:
            key = mix_seed(self.seed if seed is None else seed, _rank(), counter if counter is not None else 0)
            if record and counter is not None:
                counter.add_(1)
        row = self._activation_copy(x, key, _ROW)
        return row, lambda: self._activation_copy(x.t(), key, _COLUMN, self._wgrad_signs(signs))

    def _wgrad_form(self, x_t: torch.Tensor, signs: torch.Tensor | None) -> torch.Tensor:
        """``x.T`` padded along M to whole blocks and, unless disabled, through the RHT: what a wgrad copy's cast
        with :meth:`_wgrad_signs` quantizes, for the casts that need its amax first (split and grouped copies)."""
        x_t = _pad_columns(x_t.float())
        wgrad_signs = self._wgrad_signs(signs)
        return x_t if wgrad_signs is None else rht_blocks(x_t, wgrad_signs)

    def _wgrad_signs(self, signs: torch.Tensor | None) -> torch.Tensor | None:
        """The RHT signs of the wgrad copies (``x.T`` padded along M to whole blocks, then transformed), or None."""
        if self.disable_rht:
            return None
        return signs if signs is not None else rht_signs(self.seed)

    @staticmethod
    def _activation_copy(x: torch.Tensor, key, copy: int, signs: torch.Tensor | None = None) -> Quantized:
        sr_key = None if key is None else mix_seed(key, copy)
        return _operand(quantize_nvfp4(x, rht_signs=signs, sr_key=sr_key))

    def traced_plan(self, device, out_dtype, emulate):
        """Each cast hands out its copies' GEMM scales too (the plan's extra tensors per copy)."""
        return plan_for(self, device, out_dtype, emulate, inverses=True)

    def traced_cast(self, x, state, plan, role, dtype, columnwise, record):
        signs, counter, seed = state if state else (None, None, None)
        row, col = self._copies(role, x, signs, counter, record, seed)
        if not columnwise:
            return row.data, row.scale, None, None, row.cache.native, None
        col = col()
        return row.data, row.scale, col.data, col.scale, row.cache.native, col.cache.native

    def traced_grouped_unsupported_reason(self) -> str | None:
        return ("NVFP4 experts: each group's weight-gradient cast draws its stochastic-rounding noise from the "
                "layer's cast counter and advances it, state that the traced grouped step's custom ops do not carry "
                "(they mutate nothing); compile without fullgraph=True (the experts run between graphs) or use "
                "another recipe for the experts")

    def default_layers(self) -> dict:
        """The NVFP4 paper's policy: the last ~15% of the repeated blocks in high precision (``layers={"last": 0}``
        turns it off)."""
        return {"last": 0.15}

    # -- grouped GEMMs (mixtures of experts) ----------------------------------------------------------------

    def grouped_operands(self, role, x, bounds, dtype, columnwise, state, record):
        """The rowwise copy is one cast of ``x`` (1x16 blocks along K lie within a row, so within one expert's
        tokens). Each group's wgrad copy is ``x[start:end].T`` zero-padded along its own tokens to whole 16-blocks,
        through the RHT and cast with the group's own global scale: no block or scale spans two experts. Gradients
        round stochastically, each group from its own key. All groups in one pass
        (:func:`~fp8_lightning.nvfp4_grouped.nvfp4_group_columns`)."""
        signs, counter, seed = (None, None, None) if state is None else state.traced_tensors()
        row, _ = self._copies(role, x, signs, counter, record, seed)
        if not columnwise:
            return row, None
        keys = None
        if role == "grad_output" and not self.disable_stochastic_rounding:  # the counter as the row copy left it
            keys = group_keys(self.seed if seed is None else seed, _rank(), counter, len(bounds), _COLUMN, x.device)
        return row, nvfp4_group_columns(x, bounds, self._wgrad_signs(signs), keys, _operand, NVFP4)

    def grouped_weight_operands(self, weight, dtype, states, record):
        """Every expert (E, N, K) cast as on its own (its own global scale from its own amax, 16x16 tiles or 1x16
        blocks inside it: the rowwise copy for fprop and the copy of ``W_e.T`` for dgrad), all in one pass."""
        return nvfp4_stacked_weights(weight, self._weight_tile(), _operand, NVFP4)

    # -- tensor and sequence parallelism ---------------------------------------------------------------------

    def tensor_parallel_bind(self, operands, roles, group) -> None:
        """The layer's one state records each split operand's group (the weight's too: the state then serves its
        casts), whose casts take the whole tensor's global scale, from the amax agreed across it (one all-reduce)."""
        state = operands.get("input")
        if state is None:
            return
        for role in roles:
            state.amax_groups.setdefault(role, group)
        if "weight" in roles:
            operands.setdefault("weight", state)

    def _split_copies(self, role, x, columnwise, state, record):
        """The copies of this rank's part ``x`` of a split operand, cast with the global scale of the whole (for wgrad
        copies: transformed) tensor's agreed amax: the unsplit cast's codes and scales. Rounding keys as in cast."""
        group = state.amax_groups[role]
        if role == "weight":
            tile = self._weight_tile()
            global_scale = global_scale_from_amax(agreed_amax(x, group))
            row = _operand(quantize_nvfp4(x, global_scale, tile))
            return row, (_operand(quantize_nvfp4(x.t(), global_scale, tile)) if columnwise else None)
        key = None
        if role == "grad_output" and not self.disable_stochastic_rounding:
            key = mix_seed(state.sr_seed, _rank(), state.sr_casts)
            if record:
                state.sr_casts.add_(1)
        row = _agreed_copy(x, key, _ROW, group)
        if not columnwise:
            return row, None
        return row, _agreed_copy(self._wgrad_form(x.t(), state.signs), key, _COLUMN, group)

    def sequence_cast(self, x, dtype, state, record, group, columnwise=True):
        """None: a sequence-parallel input is gathered in high precision and cast whole (each rank's wgrad copy
        would pad its own tokens to 16-blocks and carry its own global scale, which the gathered copy cannot)."""
        return None

    # -- FSDP2 ----------------------------------------------------------------------------------------------

    def fsdp_unsupported_reason(self, rows: int, cols: int, world_size: int) -> str | None:
        return nvfp4_shard_reason(rows, cols, world_size, self._weight_tile())

    def fsdp_pack(self, shard, module, global_amax):
        """This rank's rows as packed codes and E4M3 block scales, cast with the whole weight's global scale (from
        the amax agreed across the shard group), which travels as metadata (:mod:`fp8_lightning.nvfp4_shards`)."""
        return pack_nvfp4_shard(shard, global_amax(), self._weight_tile())

    def fsdp_unpack(self, gathered, shard_rows, k, metadata):
        return _operand(unpack_nvfp4_gathered(gathered, shard_rows, k, metadata, self._weight_tile()))

    def fsdp_operands(self, gathered, scaling, metadata, record, columnwise=True):
        """dgrad's ``W.T``: the gathered 16x16 tiles transposed (the bits of casting ``W.T``), or with 1x16 blocks
        re-cast along N from the gathered values (one more rounding, in dgrad only)."""
        weight = nvfp4_tensor(gathered, self._weight_tile())
        row = _operand(weight._replace(codes=weight.codes.contiguous()))
        if not columnwise:
            return row, None
        if self.fp4_2d_weights:
            return row, _operand(nvfp4_transposed_tiles(weight))
        return row, _operand(nvfp4_recast_columns(dispatch.operand_f32(row), metadata))

    def fsdp_experts_pack(self, shard, scaling, first, record, global_amax):
        """This rank's experts packed as :meth:`fsdp_pack` packs a weight, each with its own global scale from its own
        agreed amax, all in one cast (:func:`~fp8_lightning.nvfp4_shards.pack_nvfp4_experts`)."""
        agreed = global_amax()  # every expert's amax, agreed in the step's one all-reduce
        packed, _ = pack_nvfp4_experts(shard, agreed[first : first + shard.shape[0]], self._weight_tile())
        return packed, global_scale_from_amax(agreed)  # every expert's global scale, on every rank

    def fsdp_experts_unpack(self, gathered, experts, n, k, metadata):
        """Every expert's fprop operand, from one stacked view of the gathered bytes."""
        cast = unpack_nvfp4_experts(gathered, experts, n, k, metadata, self._weight_tile())
        return NVFP4ExpertRows(cast, metadata, experts, _operand)

    def fsdp_experts_operands(self, gathered, scaling, metadata, record):
        """Stacked as :meth:`grouped_weight_operands` stacks them, in one pass: W_e.T as :meth:`fsdp_operands`
        makes W.T (:func:`~fp8_lightning.nvfp4_grouped.nvfp4_gathered_weights`)."""
        return nvfp4_gathered_weights(gathered, _operand, NVFP4)

    def _weight_tile(self) -> int:
        return NVFP4_BLOCK if self.fp4_2d_weights else 1

    # -- cost model -----------------------------------------------------------------------------------------

    def cast_bytes_per_element(self) -> float:
        """Rowwise and columnwise copies each read bf16 twice (amax, cast) and write half a byte and the scales."""
        return 2 * (2 + 2 + 0.5 + 1 / NVFP4_BLOCK)

    def grouped_gemm_route(self, capability, cuda, has_grouped_api) -> GemmRoute:
        return emulated_on_gpu("NVFP4 experts' grouped GEMMs are emulated: torch 2.11's scaled grouped GEMM takes "
                               "E4M3 operands only (its meta function, _meta_grouped_mm_common)")

    def gemm_route(self, capability, cuda, has_scaled_mm_v2) -> GemmRoute:
        arch = arch_name(capability)
        if capability < NATIVE_NVFP4_MIN_CAPABILITY:
            return emulated_on_gpu(f"{arch} has no FP4 tensor cores (sm_100 and later have them)")
        if cuda is None or cuda < NATIVE_NVFP4_MIN_CUDA:
            return emulated_on_gpu(f"{arch} has FP4 tensor cores, but the cuBLAS of {cuda_name(cuda)} has no NVFP4 "
                                   "GEMM (12.8+)")
        if not has_scaled_mm_v2:
            return emulated_on_gpu(f"{arch} has FP4 tensor cores, but this torch has no torch.nn.functional.scaled_mm "
                                   "with BlockWise1x16 scales (torch 2.10+)")
        return native_fp4("cuBLAS NVFP4 block-scaled GEMM (torch.nn.functional.scaled_mm, E4M3 1x16 scales)",
                          f"{arch} has FP4 tensor cores")


def nvfp4_to_f32(q: Quantized) -> torch.Tensor:
    """The dequantized values of an NVFP4 operand, float32: each code's value times its block's multiplier."""
    values = e2m1_values(unpack_e2m1(q.data))
    return values * q.scale.float().repeat_interleave(NVFP4_BLOCK, dim=-1)


def _multiplier(q: Quantized, k: int) -> torch.Tensor:
    return q.scale.float().reciprocal().repeat_interleave(NVFP4_BLOCK, dim=-1)[..., :k]


NVFP4.implement(
    gemm=nvfp4_mm,
    to_f32=nvfp4_to_f32,
    dequantize=lambda q, out_dtype: dispatch.operand_f32(q).to(out_dtype),
    scale_multiplier=_multiplier,
    representative_scale=lambda q: q.scale.float().amax().reciprocal(),
    value_limits=lambda q: (E2M1_MAX, E2M1_MAX + 1.0),  # half of the top binade's step (2) above 6
    code_values=lambda q: e2m1_values(unpack_e2m1(q.data)),
    traced_cache=lambda native: OperandCache(native=native),
)

__all__ = ["NVFP4BlockScaling", "NVFP4LayerState"]
