"""The CPU codec (fused C casts) computes the bits of the pure-torch reference code, on every class of input.

The reference is the library's own pure-torch path, run with ``FP8_LIGHTNING_DISABLE_CPU_CODEC=1``; it is itself
held to float64 formulas and torch's casts by ``test_quantize.py`` and ``test_formats_bits.py``. Inputs cover
random float32 bit patterns (every exponent, NaN and infinity included), exact ties between neighbouring FP8
values and their float32 neighbours, subnormals of both formats, and MX blocks whose amax sits on, just below and
just above each rounding boundary of the shared exponent.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from fp8_lightning import mx
from fp8_lightning.ops import dispatch
from fp8_lightning.kernels import cpu_codec
from fp8_lightning.recipes import BlockwiseScaling, RowwiseScaling
from tests.environment import set_env

pytestmark = pytest.mark.skipif(
    not cpu_codec.status()[0], reason=f"the CPU codec is not built here: {cpu_codec.status()[1]}"
)

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.fixture
def reference(monkeypatch):
    """Runs a function of ``fp8_lightning.ops.dispatch`` on its pure-torch path."""

    def run(fn, *args, **kwargs):
        with monkeypatch.context() as patch:
            set_env(patch, **{cpu_codec.CODEC_DISABLE_ENV: "1"})
            assert dispatch.cpu_codec() is None
            return fn(*args, **kwargs)

    return run


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality; NaN equals NaN whatever its payload (values made by multiplying NaN may differ)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.itemsize == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    a32, b32 = a.float(), b.float()
    nan = a32.isnan()
    return torch.equal(nan, b32.isnan()) and torch.equal(a32[~nan].view(torch.int32), b32[~nan].view(torch.int32))


def fp8_ties_and_neighbours(dtype: torch.dtype) -> torch.Tensor:
    """Every finite FP8 value, the exact midpoint of each pair of neighbours, and the float32 values on either side
    of each midpoint (round-to-nearest-even decides the midpoints, the neighbours decide the direction)."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    finite = values[torch.isfinite(values) & (values >= 0)].unique().sort().values
    mids = (finite[1:] + finite[:-1]) / 2
    above = torch.nextafter(mids, torch.full_like(mids, float("inf")))
    below = torch.nextafter(mids, torch.zeros_like(mids))
    top = finite[-1:] * torch.tensor([1.0, 1.0625, 1.125, 1.25, 2.0])  # beyond the largest value: saturates
    magnitudes = torch.cat([finite, mids, above, below, top])
    return torch.cat([magnitudes, -magnitudes])


def random_float32(n: int) -> torch.Tensor:
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int64).to(torch.int32)
    specials = torch.tensor([float("inf"), -float("inf"), float("nan"), -float("nan"), 0.0, -0.0, 1e-45, -3e-39])
    return torch.cat([bits.view(torch.float32), specials])


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("scale", [1.0, 3.7, 2.0**-20, 2.0**40])
def test_per_tensor_cast_matches_the_reference(dtype, scale, reference):
    x = torch.cat([fp8_ties_and_neighbours(dtype) / scale, random_float32(1 << 16), torch.randn(4096) * 30])
    scale_t = torch.tensor(scale)
    expected = reference(dispatch.fast_quantize_with_scale, x, scale_t, dtype)
    data, values, amax = cpu_codec.fp8_cast(x, scale, dtype, with_amax=True)
    assert same_bits(data, expected)
    assert same_bits(values, expected.float())  # the codes' exact values
    assert amax != amax  # the input holds NaN
    assert same_bits(dispatch.fast_quantize_with_scale(x, scale_t, dtype), expected)  # what the core calls


@pytest.mark.parametrize("dtype", FORMATS)
def test_bfloat16_input_and_amax(dtype, reference):
    x = (torch.randn(3000) * torch.logspace(-30, 30, 3000)).bfloat16()
    data, values, amax = cpu_codec.fp8_cast(x, 0.5, dtype, with_amax=True)
    assert same_bits(data, reference(dispatch.fast_quantize_with_scale, x, torch.tensor(0.5), dtype))
    assert amax == x.float().abs().max().item()
    assert cpu_codec.fp8_cast(torch.zeros(5), 1.0, dtype, with_amax=True)[2] == 0.0


def mx_boundary_input(rows: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Random blocks of very different magnitudes, plus blocks whose amax sits on each boundary of the shared
    exponent (fp8_max * 2**j and its float32 neighbours, powers of two), zero blocks, subnormal blocks, and single
    NaN and infinity entries."""
    x = torch.randn(rows, k) * torch.logspace(-42, 37, rows).unsqueeze(1)
    limit = torch.finfo(dtype).max
    edges = torch.tensor([limit, limit / 2, 1.0, 2.0**-126, 2.0**-130, 2.0**100])
    edges = torch.cat([edges, torch.nextafter(edges, edges * 2), torch.nextafter(edges, torch.zeros_like(edges))])
    for i, edge in enumerate(edges.tolist()):
        x[i % rows, (i * 7) % k] = edge * (-1) ** i
    x[-1] = 0.0
    x[-2, : k // 2] = 1e-44
    x[1, 3], x[2, 5], x[3, 0] = float("nan"), float("inf"), -float("inf")
    return x


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("rows", [96, 50])  # a whole number of blocks, and one padded to it
def test_mx_rowwise_and_columnwise_match_the_reference(dtype, rounding, block, rows, reference):
    x = mx_boundary_input(rows, 64, dtype)
    for source in (x, x.bfloat16()):
        want_row, want_col = reference(dispatch.fast_quantize_mx_operands, source, block, rounding, dtype)
        row, col = dispatch.fast_quantize_mx_operands(source, block, rounding, dtype)
        for got, want in ((row, want_row), (col, want_col)):
            assert got.data.shape == want.data.shape and got.scale.shape == want.scale.shape
            assert same_bits(got.data, want.data) and same_bits(got.scale, want.scale)
            assert same_bits(got.cache.f32, reference(dispatch.fast_dequantize_mxfp8, want.data, want.scale))
        saved = dispatch.fast_quantize_mx_operands(source, block, rounding, dtype, columnwise_f32=False)[1]
        assert saved.cache.f32 is None and same_bits(saved.data, want_col.data)
        assert same_bits(dispatch.operand_f32(saved), want_col.cache.f32 if want_col.cache.f32 is not None else dispatch.operand_f32(want_col))
        columns = dispatch.fast_quantize_mx_columns(source, block, rounding, dtype)
        assert same_bits(columns.data, want_col.data) and same_bits(columns.scale, want_col.scale)


@pytest.mark.parametrize("dtype", FORMATS)
def test_mx_public_functions_match_the_reference(dtype, reference):
    x = mx_boundary_input(48, 128, dtype).reshape(6, 8, 128)
    data, scale = dispatch.fast_quantize_mxfp8(x, fp8_format=dtype)
    want_data, want_scale = reference(dispatch.fast_quantize_mxfp8, x, fp8_format=dtype)
    assert same_bits(data, want_data) and same_bits(scale, want_scale)
    assert same_bits(dispatch.fast_dequantize_mxfp8(data, scale), reference(dispatch.fast_dequantize_mxfp8, data, scale))
    assert same_bits(
        dispatch.fast_dequantize_mxfp8(data, scale, torch.bfloat16), reference(dispatch.fast_dequantize_mxfp8, data, scale, torch.bfloat16)
    )


@pytest.mark.parametrize("dtype", FORMATS)
def test_every_code_and_every_scale_byte_decodes_like_the_reference(dtype, reference):
    """All 256 codes decode as torch's cast; all 256 x 256 (code, E8M0 byte) pairs dequantize as the reference,
    in both block layouts."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    assert same_bits(cpu_codec.fp8_decode(codes), codes.float())
    data = codes.repeat(256, 1)  # row r holds every code; its one block has scale byte r
    scale = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(mx.E8M0_DTYPE).reshape(256, 1)
    want = reference(dispatch.fast_dequantize_mxfp8, data, scale)
    assert same_bits(dispatch.fast_dequantize_mxfp8(data, scale), want)
    columns = data.t().contiguous().t()  # the columnwise layout: blocks run down the base's rows
    assert same_bits(dispatch.fast_dequantize_mxfp8(columns, scale.t().contiguous().t()), want)


def test_threads_split_the_work_without_changing_a_bit(reference, monkeypatch):
    """Large tensors are cut into ranges cast by several threads; the bits, and a NaN in any range, survive."""
    monkeypatch.setattr(cpu_codec, "PARALLEL_MIN_ELEMENTS", 1024)  # split this small tensor too
    threads = torch.get_num_threads()
    x = torch.randn(1024, 512) * 7
    x[900, 3] = float("nan")  # in the last range only
    try:
        torch.set_num_threads(2)
        assert len(cpu_codec._ranges(x.numel(), x.numel())) == 2
        data, values, amax = cpu_codec.fp8_cast(x, 2.0, torch.float8_e4m3fn, with_amax=True)
        row, col = dispatch.fast_quantize_mx_operands(x, 32, "rceil", torch.float8_e5m2)
    finally:
        torch.set_num_threads(threads)
    assert amax != amax
    assert same_bits(data, reference(dispatch.fast_quantize_with_scale, x, torch.tensor(2.0), torch.float8_e4m3fn))
    want_row, want_col = reference(dispatch.fast_quantize_mx_operands, x, 32, "rceil", torch.float8_e5m2)
    assert same_bits(row.data, want_row.data) and same_bits(col.data, want_col.data)
    assert same_bits(col.scale, want_col.scale) and same_bits(row.cache.f32, dispatch.operand_f32(want_row))


@pytest.mark.parametrize(
    "recipe",
    ["delayed", "tensorwise", "mxfp8", RowwiseScaling(), RowwiseScaling(power_of_2_scales=False),
     RowwiseScaling(high_precision_wgrad=True), BlockwiseScaling(), BlockwiseScaling(power_of_2_scales=False)],
    ids=["delayed", "tensorwise", "mxfp8", "rowwise", "rowwise-f32", "rowwise-hp-wgrad", "blockwise", "blockwise-f32"],
)
def test_a_layer_trains_bit_for_bit_as_on_the_reference_path(recipe, monkeypatch):
    """Forward outputs and every gradient of a two-layer FP8 model over three steps (delayed scaling's fused
    cast-and-amax, ragged 1x128 tiles and 128x128 blocks included) are the same with and without the codec."""
    from fp8_lightning import convert_to_fp8, fp8_autocast, sync_scales

    def train(codec_off: bool):
        set_env(monkeypatch, **{cpu_codec.CODEC_DISABLE_ENV: "1" if codec_off else "0"})
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(160, 192), torch.nn.GELU(), torch.nn.Linear(192, 32))
        report = convert_to_fp8(model, recipe, profitability=False)
        assert len(report.converted) == 2, report  # both layers run FP8: the comparison is not a vacuous one
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        results = []
        for step in range(3):
            x = torch.randn(40, 160) * (step + 1)
            with fp8_autocast():
                y = model(x)
            y.square().mean().backward()
            results += [y.detach()] + [p.grad.clone() for p in model.parameters()]
            optimizer.step()
            optimizer.zero_grad()
            sync_scales(model)
        return results

    for got, want in zip(train(codec_off=False), train(codec_off=True)):
        assert same_bits(got, want)


def test_direct_calls_refuse_what_the_c_code_cannot_read():
    with pytest.raises(TypeError, match="takes float32, bfloat16 tensors; got torch.float16"):
        cpu_codec.fp8_cast(torch.ones(4, dtype=torch.float16), 1.0, torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="takes plain CPU tensors"):
        cpu_codec.fp8_decode(torch.ones(4).to(torch.float8_e4m3fn).as_subclass(_Wrapper))
    with pytest.raises(ValueError, match="whole blocks of 32"):
        cpu_codec.mx_quantize(torch.ones(4, 48), 32, "rceil", torch.float8_e4m3fn)
    codes = torch.zeros(4, 64, dtype=torch.uint8).view(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="do not match codes"):
        cpu_codec.mx_decode(codes, torch.zeros(4, 3, dtype=torch.uint8).view(mx.E8M0_DTYPE), False)


class _Wrapper(torch.Tensor):
    pass


def test_no_compiler_means_the_reference_path_with_the_reason(monkeypatch, tmp_path, reference):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    set_env(monkeypatch, **{cpu_codec.CACHE_ENV: str(tmp_path)})
    cpu_codec._load.cache_clear()
    try:
        ok, reason = cpu_codec.status()
        assert not ok and "no C compiler" in reason and "no-such-compiler" in reason
        assert dispatch.cpu_codec() is None
        x = torch.randn(64, 64)
        data, scale = dispatch.fast_quantize_mxfp8(x)
        want_data, want_scale = reference(dispatch.fast_quantize_mxfp8, x)
        assert same_bits(data, want_data) and same_bits(scale, want_scale)
        with pytest.raises(RuntimeError, match="CPU FP8 codec is not available: no C compiler"):
            cpu_codec.fp8_cast(x, 1.0, torch.float8_e4m3fn)
    finally:
        cpu_codec._load.cache_clear()


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler (cc) to build the codec")
def test_an_unwritable_cache_falls_back_with_the_reason(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    set_env(monkeypatch, **{cpu_codec.CACHE_ENV: str(blocker / "cache")})  # cannot be created under a file
    cpu_codec._load.cache_clear()
    try:
        ok, reason = cpu_codec.status()
        assert not ok and "building the CPU codec in" in reason and cpu_codec.CACHE_ENV in reason
        assert dispatch.cpu_codec() is None and not cpu_codec.enabled()
    finally:
        cpu_codec._load.cache_clear()


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler (cc) to build the codec")
def test_a_fresh_cache_builds_the_library_once(monkeypatch, tmp_path):
    set_env(monkeypatch, **{cpu_codec.CACHE_ENV: str(tmp_path)})
    cpu_codec._load.cache_clear()
    try:
        ok, path = cpu_codec.status()
        assert ok and path.startswith(str(tmp_path)) and path.endswith(".so")
        names = sorted(p.name for p in tmp_path.iterdir())  # the library and its record, no partial files
        assert len(names) == 2 and path.rsplit("/", 1)[1] in names and any(n.endswith(".json") for n in names)
    finally:
        cpu_codec._load.cache_clear()
