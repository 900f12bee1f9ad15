"""The CPU codec's rowwise and blockwise casts compute the bits of the pure-torch reference, on every class of input.

The references are :func:`fp8_lightning.rowwise.quantize_rowwise` and :func:`fp8_lightning.blockwise.quantize_blockwise`
(held to torchao and to float64 formulas by ``test_rowwise.py`` and ``test_blockwise.py``). Inputs cover rows and
tiles whose amax spans float32's exponent range (so that the float64 quotient's single rounding to float32, its cap
at float32's max and the power-of-two rounding are all exercised), ragged shapes, all-zero rows, columns and blocks,
rows below ``eps``, subnormals, NaN and infinity; both FP8 formats, both scale kinds, float32 and bfloat16 input.
"""

from __future__ import annotations

import pytest
import torch

from fp8_lightning import fine_grained
from fp8_lightning.ops import dispatch
from fp8_lightning.blockwise import dequantize_blockwise, quantize_blockwise
from fp8_lightning.kernels import cpu_codec
from fp8_lightning.recipes import BlockwiseScaling, RowwiseScaling
from fp8_lightning.rowwise import quantize_rowwise
from tests.core.test_cpu_codec import same_bits
from tests.environment import set_env

pytestmark = pytest.mark.skipif(
    not cpu_codec.status()[0], reason=f"the CPU codec is not built here: {cpu_codec.status()[1]}"
)

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
ROWWISE = [(1, 0), (0, 1)]
BLOCKWISE = [(1, 128), (128, 1), (128, 128)]


def hard_input(m: int, k: int, seed: int) -> torch.Tensor:
    """(m, k) float32 with rows and columns scaled by powers of two from 2**-140 to 2**126 (subnormal and huge
    amaxes), all-zero rows, columns and 128x128 blocks, a NaN, infinities of both signs and a row below eps."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, k, generator=g).mul(3).exp()
    x *= torch.exp2(torch.randint(-40, 40, (m, 1), generator=g).float())
    x[0] *= 2.0**-100  # subnormal products below
    x[min(1, m - 1)] *= 2.0**80
    if m > 4 and k > 4:
        x[2] = 0.0
        x[:, 3] = 0.0
        x[4] = torch.randn(k, generator=g) * 1e-14  # under the rowwise eps: clamped
        x[min(5, m - 1), 1] = float("nan")
        x[m - 1, k - 1] = float("inf")
        x[m // 2, 0] = float("-inf")
        x[m - 1, 0] = 1e-45  # a subnormal amax in its tile
    if m > 130 and k > 130:
        x[:128, :128] = 0.0  # a zero 128x128 block, zero 1x128 / 128x1 tiles
    return x


def reference_cast(x: torch.Tensor, tile, dtype, power_of_2: bool, eps: float):
    """(data, scale, GEMM values) from the pure-torch reference, in the codec's layout (x's own)."""
    if 0 in tile:
        data, scale = quantize_rowwise(x, dtype, -1 if tile == (1, 0) else 0, eps, power_of_2)
        return data, scale, data.float()
    data, scale = quantize_blockwise(x, tile, dtype, power_of_2)
    return data, scale, dequantize_blockwise(data, scale)


@pytest.mark.parametrize("tile", ROWWISE + BLOCKWISE)
@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("power_of_2", [True, False])
@pytest.mark.parametrize("shape", [(300, 260), (7, 5), (129, 1), (1, 131)])
def test_casts_match_the_reference(tile, dtype, power_of_2, shape):
    for input_dtype in (torch.float32, torch.bfloat16):
        x = hard_input(*shape, seed=sum(shape)).to(input_dtype)
        for eps in (1e-12, 0.0):
            data, scale, inverse, values = cpu_codec.fine_quantize(x, tile, dtype, power_of_2, eps)
            want_data, want_scale, want_values = reference_cast(x, tile, dtype, power_of_2, eps)
            assert same_bits(data, want_data)
            assert same_bits(scale, want_scale)
            assert same_bits(inverse, want_scale.reciprocal())
            assert same_bits(values, want_values)


def test_scale_edges_on_single_rows():
    """Each scale rule, row by row: eps clamps small and zero rows, eps 0 makes a zero row's scale float32's max
    (2**127 as a power of two), inf/NaN rows get 1, and a subnormal amax overflows the quotient to the cap."""
    fmax, big = torch.finfo(torch.float32).max, 2.0**127
    x = torch.tensor([[0.0, 0.0], [1e-45, 0.0], [float("inf"), 1.0], [float("nan"), 1.0], [3.0, -448.0]])
    _, scale, _, _ = cpu_codec.fine_quantize(x, (1, 0), torch.float8_e4m3fn, False, 0.0)
    assert scale.flatten().tolist() == [fmax, fmax, 1.0, 1.0, 1.0]
    _, scale, _, _ = cpu_codec.fine_quantize(x, (1, 0), torch.float8_e4m3fn, True, 0.0)
    assert scale.flatten().tolist() == [big, big, 1.0, 1.0, 1.0]
    _, scale, _, _ = cpu_codec.fine_quantize(x, (1, 0), torch.float8_e4m3fn, False, 1e-12)
    eps32 = torch.tensor(1e-12).item()  # eps rounded to float32, as torch.clamp rounds it
    assert scale[0].item() == torch.tensor(448.0 / eps32, dtype=torch.float64).float().item()
    _, scale, _, _ = cpu_codec.fine_quantize(x, (1, 128), torch.float8_e4m3fn, True)
    assert scale.flatten().tolist() == [1.0, big, 1.0, 1.0, 1.0]  # blockwise: a zero tile gets 1


@pytest.mark.parametrize(
    "recipe",
    [RowwiseScaling(), RowwiseScaling(power_of_2_scales=False), RowwiseScaling(high_precision_wgrad=True),
     BlockwiseScaling(), BlockwiseScaling(power_of_2_scales=False)],
    ids=["rowwise", "rowwise-f32", "rowwise-hp-wgrad", "blockwise", "blockwise-f32"],
)
@pytest.mark.parametrize("role", ["input", "weight", "grad_output"])
def test_backend_operands_match_the_reference_operands(recipe, role):
    x = hard_input(150, 140, seed=3)
    got = dispatch.fast_fine_operands(recipe, role, x, torch.float8_e4m3fn, columnwise=True)
    want = fine_grained.fine_operands(recipe, role, x, torch.float8_e4m3fn, columnwise=True)
    assert got[0].cache.f32 is not None  # the codec made the row copy and its GEMM values
    for q, r in zip(got, want):
        assert q.kind == r.kind and q.data.shape == r.data.shape
        assert same_bits(q.data, r.data) and same_bits(q.scale.float(), r.scale.float())
        if q.kind == "row":
            assert same_bits(dispatch.operand_f32(q), r.data.float())
            assert same_bits(q.inverse_scale(), r.scale.reciprocal())
        elif q.kind == "block":
            assert same_bits(q.cache.f32, dequantize_blockwise(r.data, r.scale))
        assert same_bits(dispatch.dequantize_operand(q), dispatch.dequantize_operand(r))


def test_disabling_the_codec_keeps_the_reference(monkeypatch):
    set_env(monkeypatch, **{cpu_codec.CODEC_DISABLE_ENV: "1"})
    row, col = dispatch.fast_fine_operands(BlockwiseScaling(), "input", torch.randn(8, 256), torch.float8_e4m3fn, True)
    assert row.cache.f32 is None and col.cache.f32 is None


def test_threads_split_the_bands_without_changing_a_bit(monkeypatch):
    monkeypatch.setattr(cpu_codec, "PARALLEL_MIN_ELEMENTS", 1024)  # split this small tensor too
    threads = torch.get_num_threads()
    x = hard_input(520, 300, seed=5)
    try:
        torch.set_num_threads(2)
        casts = {tile: cpu_codec.fine_quantize(x, tile, torch.float8_e5m2, True, 1e-12) for tile in ROWWISE + BLOCKWISE}
    finally:
        torch.set_num_threads(threads)
    for tile, (data, scale, _, values) in casts.items():
        want_data, want_scale, want_values = reference_cast(x, tile, torch.float8_e5m2, True, 1e-12)
        assert same_bits(data, want_data) and same_bits(scale, want_scale) and same_bits(values, want_values)


def test_direct_calls_refuse_what_the_c_code_cannot_read():
    with pytest.raises(ValueError, match=r"tile=\(64, 64\) is invalid; allowed: \(1, 0\)"):
        cpu_codec.fine_quantize(torch.ones(4, 4), (64, 64), torch.float8_e4m3fn, True)
    with pytest.raises(ValueError, match=r"non-empty 2-D tensor; got shape \(4,\)"):
        cpu_codec.fine_quantize(torch.ones(4), (1, 128), torch.float8_e4m3fn, True)
    with pytest.raises(ValueError, match=r"got shape \(0, 4\)"):
        cpu_codec.fine_quantize(torch.ones(0, 4), (1, 0), torch.float8_e4m3fn, True)
    with pytest.raises(TypeError, match="takes plain CPU tensors"):
        cpu_codec.fine_quantize(torch.ones(4, 4, device="meta"), (1, 0), torch.float8_e4m3fn, True)
