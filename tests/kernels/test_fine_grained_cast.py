"""The rowwise and blockwise cast kernels against their pure-torch twins, and their layouts against ``_scaled_mm``.

Bit for bit in Triton's interpreter on CPU: ``rowwise.quantize_rowwise`` and ``blockwise.quantize_blockwise``
(themselves tested against torchao and a float64 reference in ``tests/core``) on ragged shapes, zero rows and
blocks, NaN and infinities, both formats and both scale roundings. The scales the kernels write, and their
inverses, must lie where cuBLAS reads them: torch's meta ``_scaled_mm`` takes them on fake CUDA tensors, and the
GEMM's argument builders then copy nothing. The layer's CUDA branch (``dispatch.fast_fine_operands``) is run on CPU by
pointing the dispatch hook at the kernels: the training step's gradients are unchanged, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp8_lightning.ops import dispatch
from fp8_lightning import FP8Linear, fp8_autocast
from fp8_lightning.ops import triton_ops
from fp8_lightning.blockwise import blockwise_scaled_mm_args
from fp8_lightning.fine_grained import fine_cast_twin
from fp8_lightning.quantize import OperandCache, Quantized, row_major
from fp8_lightning.recipes import BlockwiseScaling, RowwiseScaling
from fp8_lightning.rowwise import rowwise_scaled_mm_args
from tests.core.fake_cuda import fake_cuda
from tests.environment import set_env
from tests.kernels.references import assert_same_fp8

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ROW, COLUMN = (1, 0), (0, 1)
BLOCK_TILES = ((1, 128), (128, 1), (128, 128))


def awkward(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Rows and 128-column stretches of magnitudes 2**-30 .. 2**30, an all-zero row, an all-zero 128x128 block,
    a NaN, +inf and -inf (each in a row and a tile of its own), and a row below eps=1e-4."""
    g = torch.Generator().manual_seed(seed)
    row_scale = torch.exp2(torch.randint(-30, 30, (rows, 1), generator=g).float())
    col_scale = torch.exp2(torch.randint(-8, 8, (1, -(-cols // 128)), generator=g).float()).repeat_interleave(128, 1)
    x = torch.randn(rows, cols, generator=g) * row_scale * col_scale[:, :cols]
    x[1] = 0.0
    x[5] = torch.randn(cols, generator=g) * 2.0**-20
    if rows > 128 and cols > 256:
        x[128:, 128:256] = 0.0
    x[2, 3], x[7, cols - 1], x[rows - 1, 130 % cols] = float("nan"), float("inf"), float("-inf")
    return x


def assert_same_operand(q, data: torch.Tensor, scale: torch.Tensor) -> None:
    assert_same_fp8(q.data, data)
    assert q.data.is_contiguous()  # codes row-major, K last: the layout the GEMM reads
    assert torch.equal(q.scale, scale), (q.scale, scale)
    assert torch.equal(q.cache.inverse, scale.reciprocal())


@pytest.mark.parametrize("tile", [ROW, COLUMN, *BLOCK_TILES])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("power_of_2", [True, False])
def test_casts_equal_the_twins_bit_for_bit(tile, dtype, power_of_2):
    x = awkward(200, 300)  # ragged: 2 x 3 blocks of 128, the last ones partial
    eps = 1e-4 if tile[0] == 0 else 1e-12  # a row below eps takes fp8_max / eps
    square = tile == (128, 128)
    q, q_t = triton_ops.triton_fine_cast(x, dtype, tile, power_of_2, eps, transpose=square)
    data, scale = fine_cast_twin(x, tile, dtype, power_of_2, eps)
    assert_same_operand(q, data, scale)
    assert q.kind == ("row" if tile in (ROW, COLUMN) else "block")
    if square:  # W.T's blocks, for dgrad: the same codes and scales, transposed
        assert_same_operand(q_t, data.t(), scale.t())
    else:
        assert q_t is None


def test_bf16_input_transposed_view_and_tiny_shapes():
    x = awkward(136, 260, seed=1).bfloat16().t()  # (260, 136), read in place through its strides
    for tile in (ROW, COLUMN, (1, 128), (128, 1)):
        q, _ = triton_ops.triton_fine_cast(x, E4M3, tile, True, 1e-12)
        assert_same_operand(q, *fine_cast_twin(x, tile, E4M3, True))
    for shape in ((1, 1), (3, 17)):
        x = torch.randn(shape)
        q, q_t = triton_ops.triton_fine_cast(x, E5M2, (128, 128), False, transpose=True)
        data, scale = fine_cast_twin(x, (128, 128), E5M2, False)
        assert_same_operand(q, data, scale)
        assert_same_operand(q_t, data.t(), scale.t())


def test_scale_layouts_are_cublas_layouts():
    x = torch.randn(200, 300)
    per_row, per_column = (triton_ops.triton_fine_cast(x, E4M3, tile)[0] for tile in (ROW, COLUMN))
    assert per_row.cache.inverse.shape == (200, 1) and per_column.cache.inverse.shape == (300, 1)
    assert per_row.cache.inverse.is_contiguous() and per_column.cache.inverse.is_contiguous()
    row_tiles, _ = triton_ops.triton_fine_cast(x, E4M3, (1, 128), True)
    assert row_tiles.scale.shape == (200, 3) and row_tiles.cache.inverse.stride() == (1, 200)  # outer-dim-major
    column_tiles, _ = triton_ops.triton_fine_cast(x, E4M3, (128, 1), True)
    assert column_tiles.data.shape == (300, 200) and column_tiles.cache.inverse.stride() == (1, 300)
    w, w_t = triton_ops.triton_fine_cast(x, E4M3, (128, 128), True, transpose=True)
    assert w.cache.inverse.shape == (2, 3) and w.cache.inverse.stride() == (4, 1)  # rows padded to 16 bytes
    assert w_t.cache.inverse.shape == (3, 2) and w_t.cache.inverse.stride() == (4, 1)


def test_bad_requests_are_refused_with_the_allowed_values():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"tile=\(1, 64\) is not supported; allowed: \(1, 0\)"):
        triton_ops.triton_fine_cast(x, E4M3, (1, 64))
    with pytest.raises(ValueError, match="transposed copy for 128x128 blocks only"):
        triton_ops.triton_fine_cast(x, E4M3, (1, 128), transpose=True)
    with pytest.raises(ValueError, match=r"non-empty 2-D tensor; got shape \(8,\)"):
        triton_ops.triton_fine_cast(x[0], E4M3)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        triton_ops.triton_fine_cast(x.double(), E4M3)


# --------------------------------------------------------------------------------------------------------
# The layouts on fake CUDA tensors
# --------------------------------------------------------------------------------------------------------


class CopyCounter(TorchDispatchMode):
    """The operations that allocate new data (views and ``_scaled_mm`` itself excluded)."""

    FREE = {"device", "t", "view", "reshape", "_reshape_alias", "transpose", "narrow", "slice", "expand", "alias", "_scaled_mm"}

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in self.FREE and not name.startswith(("sym_", "is_")):
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def _fake_cast(x, dtype, tile, transpose=False):
    """The op's fake implementation (what a CUDA launch returns, shapes and strides only), as operands."""
    data, scale, inverse, data_t, scale_t, inverse_t = torch.ops.fp8_lightning.fine_cast(
        x, dtype, *tile, True, 1e-12, transpose
    )
    kind = "block" if 128 in tile else "row"
    return (Quantized(data, scale, kind, OperandCache(inverse=inverse)),
            Quantized(data_t, scale_t, kind, OperandCache(inverse=inverse_t)))


@pytest.mark.parametrize("m, k, n", [(256, 384, 512), (208, 1024, 144), (16, 1000 // 16 * 16, 48)])
def test_fake_cuda_operands_pass_scaled_mm_and_need_no_layout_copy(m, k, n):
    """The three GEMMs of a layer (M tokens a multiple of 16, K and N of 16, as the layer requires): torch's meta
    ``_scaled_mm`` takes the kernels' outputs, and building its arguments allocates nothing."""
    with fake_cuda():
        x, g, w = (torch.empty(s, device="cuda") for s in ((m, k), (m, n), (n, k)))
        blockwise = {
            "fprop": (_fake_cast(x, E4M3, (1, 128))[0], _fake_cast(w, E4M3, (128, 128))[0]),
            "dgrad": (_fake_cast(g, E5M2, (1, 128))[0], _fake_cast(w, E4M3, (128, 128), transpose=True)[1]),
            "wgrad": (_fake_cast(g, E5M2, (128, 1))[0], _fake_cast(x, E4M3, (128, 1))[0]),
        }
        rowwise = {
            "fprop": (_fake_cast(x, E4M3, ROW)[0], _fake_cast(w, E4M3, ROW)[0]),
            "dgrad": (_fake_cast(g, E5M2, ROW)[0], _fake_cast(w, E4M3, COLUMN)[0]),
            "wgrad": (_fake_cast(g, E5M2, COLUMN)[0], _fake_cast(x, E4M3, COLUMN)[0]),
        }
        for args, pairs in ((blockwise_scaled_mm_args, blockwise), (rowwise_scaled_mm_args, rowwise)):
            for gemm, (a, b) in pairs.items():
                with CopyCounter() as copies:
                    mat1, mat2, scale_a, scale_b = args(a, b)
                    out = torch._scaled_mm(mat1, mat2, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
                assert out.shape == (a.data.shape[0], b.data.shape[0]), gemm
                assert copies.names == [], (args.__name__, gemm, copies.names)
                plain = [Quantized(q.data, row_major(q.scale), q.kind) for q in (a, b)]  # the twins' layouts
                with CopyCounter() as copies:
                    args(*plain)
                assert "reciprocal" in copies.names, (args.__name__, gemm, copies.names)


# --------------------------------------------------------------------------------------------------------
# The layer's CUDA branch
# --------------------------------------------------------------------------------------------------------


@pytest.fixture
def fine_cast_calls(monkeypatch):
    """Route the core's CUDA branch to the kernels for CPU tensors; record the tiles the casts ask for."""
    calls = []
    original = triton_ops.triton_fine_cast

    def recorded(x, fp8_format, tile, *args, **kwargs):
        calls.append(tuple(tile))
        return original(x, fp8_format, tile, *args, **kwargs)

    set_env(monkeypatch, FP8_LIGHTNING_DISABLE_CPU_CODEC="1")
    monkeypatch.setattr(triton_ops, "triton_fine_cast", recorded)
    monkeypatch.setattr(dispatch, "cuda_kernels", lambda x: triton_ops if triton_ops.supports_input(x) else None)
    return calls


def _training_step(recipe):
    torch.manual_seed(0)
    layer = FP8Linear.from_linear(torch.nn.Linear(160, 144), recipe)
    x = (torch.randn(40, 160) * torch.exp2(torch.arange(40.0)[:, None] - 20)).requires_grad_()
    with fp8_autocast():
        layer(x).square().mean().backward()
    return layer.weight.grad, x.grad


RECIPES = {
    "rowwise": (RowwiseScaling(), [ROW, COLUMN, ROW, COLUMN, ROW, COLUMN]),
    "rowwise-float32-scales-hp-wgrad": (RowwiseScaling(power_of_2_scales=False, high_precision_wgrad=True),
                                        [ROW, ROW, ROW]),
    "blockwise": (BlockwiseScaling(), [(1, 128), (128, 1), (128, 128), (1, 128), (128, 1)]),
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_layer_step_on_the_kernels_equals_the_reference(fine_cast_calls, monkeypatch, name):
    recipe, tiles = RECIPES[name]
    dw, dx = _training_step(recipe)
    assert sorted(fine_cast_calls) == sorted(tiles)  # each copy one launch; hp-wgrad copies stay on the reference
    with monkeypatch.context() as pure:
        pure.setattr(dispatch, "cuda_kernels", lambda x: None)
        ref_dw, ref_dx = _training_step(recipe)
    assert torch.equal(dw, ref_dw) and torch.equal(dx, ref_dx)


def test_traced_cast_op_runs_the_kernels_with_the_fakes_layouts(fine_cast_calls):
    x = awkward(200, 300)
    outputs = BlockwiseScaling().traced_cast(x, (), None, "input", E4M3, columnwise=True, record=True)
    assert fine_cast_calls == [(1, 128), (128, 1)]
    (row, row_scale), (col, col_scale) = (fine_cast_twin(x, tile, E4M3, True) for tile in ((1, 128), (128, 1)))
    for actual, expected in zip(outputs, (row, row_scale, col, col_scale)):
        assert actual.is_contiguous() and actual.shape == expected.shape
    assert_same_fp8(outputs[0], row)
    assert_same_fp8(outputs[2], col.contiguous())
    assert torch.equal(outputs[1], row_scale) and torch.equal(outputs[3], col_scale)
