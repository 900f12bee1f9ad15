"""The compiled (traced) fine-grained step keeps the layouts the CUDA cast kernel writes, which are cuBLAS's.

The traced cast ops (``torch.ops.fp8_lightning.fine_tile_cast`` and ``block_cast_transposed``) declare, for a CUDA
tensor, the shapes and strides the Triton kernel writes their codes, scales and inverse scales in: one scale per row
contiguous, 1x128 / 128x1 tiles column-major, 128x128 blocks row-major with each row padded to 4 floats, and the
128x128 weight's transposed copy from the same launch. Here the CUDA branch runs on CPU tensors (the kernels in
Triton's interpreter, the ops told that the tensor is on CUDA): the ops' outputs have the fakes' layouts, which are
written out below from cuBLAS's rules, hold the reference casts' bits and ``1 / scale``, and come from the kernel
with no copy; without the kernels the reference's results are copied into the same layouts. On the simulated CUDA device a compiled step's GEMMs then take
those scales as they are: the step runs the casts, the three GEMMs, the bias add and the bias gradient, nothing else.
"""

from __future__ import annotations

import collections
import contextlib
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp8_lightning.cuda_contract import Target, simulate
from fp8_lightning.fine_grained import fine_cast_twin
from fp8_lightning.ops import dispatch, layer, triton_ops
from fp8_lightning.ops.registry import HOT_OPS
from fp8_lightning.recipes import BlockwiseScaling, RowwiseScaling
from tests.environment import set_env
from tests.kernels.references import assert_same_fp8
from tests.kernels.test_fine_grained_cast import awkward

E4M3 = torch.float8_e4m3fn
M, K = 200, 300  # ragged: 2 x 3 blocks of 128, the last ones partial
# tile -> expected (shape, strides) of data, scale (and inverse), data_t, scale_t for x (M, K) on CUDA
CUBLAS_LAYOUTS = {
    (1, 0): [((M, K), (K, 1)), ((M, 1), (1, 1))],  # a scale per row, contiguous
    (0, 1): [((K, M), (M, 1)), ((K, 1), (1, 1))],  # x.T's operand: codes (K, M) row-major
    (1, 128): [((M, K), (K, 1)), ((M, 3), (1, M))],  # outer-dim-major (column-major)
    (128, 1): [((K, M), (M, 1)), ((K, 2), (1, K))],
    (128, 128): [((M, K), (K, 1)), ((2, 3), (4, 1)), ((K, M), (M, 1)), ((3, 2), (4, 1))],  # rows padded to 4
}
COPIES = ("copy_", "clone", "_to_copy", "reciprocal", "constant_pad_nd", "cat")


class _Ops(TorchDispatchMode):
    def __init__(self, on: bool = True):
        super().__init__()
        self.names, self.on = collections.Counter(), on

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[func.overloadpacket.__name__] += self.on
        return func(*args, **(kwargs or {}))


@pytest.fixture
def cuda_branch(monkeypatch):
    """The CUDA branch on CPU tensors: the kernels for the casts, the op's CUDA layouts."""
    set_env(monkeypatch, FP8_LIGHTNING_DISABLE_CPU_CODEC="1")
    monkeypatch.setattr(dispatch, "cuda_kernels", lambda x: triton_ops if triton_ops.supports_input(x) else None)
    monkeypatch.setattr(layer, "_kernel_layouts", lambda x: True)


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), tuple(s if n > 1 else 1 for n, s in zip(t.shape, t.stride()))


@pytest.mark.parametrize("kernels", [True, False], ids=["triton", "reference"])
@pytest.mark.parametrize("tile", list(CUBLAS_LAYOUTS))
def test_the_cast_op_gives_cublas_layouts_and_the_reference_bits(cuda_branch, monkeypatch, tile, kernels):
    if not kernels:
        monkeypatch.setattr(dispatch, "cuda_kernels", lambda x: None)
    x = awkward(M, K)
    transpose = tile == (128, 128)
    name, args = ("block_cast_transposed", (x, E4M3, True, 1e-12)) if transpose else \
        ("fine_tile_cast", (x, E4M3, *tile, True, 1e-12))
    with _Ops() as ops:
        outputs = HOT_OPS[name].impl(*args)
    data, scale, inverse, data_t, scale_t, inverse_t = (*outputs, *outputs[:3])[:6]
    fake = HOT_OPS[name].fake(*args)
    expected = CUBLAS_LAYOUTS[tile]
    got = [data, scale, data_t, scale_t] if transpose else [data, scale]
    assert [_layout(t) for t in got] == [(s, tuple(d if n > 1 else 1 for n, d in zip(s, st))) for s, st in expected]
    assert [_layout(t) for t in fake] == [_layout(t) for t in outputs]
    assert _layout(inverse) == _layout(scale) and (not transpose or _layout(inverse_t) == _layout(scale_t))
    if kernels:
        assert not set(ops.names) & set(COPIES), ops.names  # the kernel's own tensors: nothing copied or inverted
    ref_data, ref_scale = fine_cast_twin(x, tile, E4M3, True)
    assert_same_fp8(data, ref_data.contiguous())
    assert torch.equal(scale, ref_scale)
    assert torch.equal(inverse.double(), 1 / ref_scale.double())  # power-of-two scales: exact inverses
    if transpose:
        assert_same_fp8(data_t, ref_data.t().contiguous())
        assert torch.equal(scale_t, ref_scale.t()) and torch.equal(inverse_t, inverse.t())


def _traced_step_ops(recipe, m: int, k: int, n: int) -> collections.Counter:
    """Non-view operations of one traced layer step (forward from its autocast on, and backward) on a simulated
    sm_90 (fake CUDA tensors)."""
    counter, original, autocast = _Ops(on=False), simulate.simulated_device, simulate.fp8_autocast

    @contextlib.contextmanager
    def counted(target, triton=True):
        with original(target, triton) as fake, counter:
            yield fake

    @contextlib.contextmanager
    def counting_autocast():
        counter.on = True
        with autocast():
            yield

    with mock.patch.object(simulate, "simulated_device", counted), \
            mock.patch.object(simulate, "fp8_autocast", counting_autocast):
        simulate.run_layer(Target("sm_90", (12, 9), (2, 11)), recipe, m, k, n, "traced")
    views = {"view", "t", "transpose", "reshape", "_unsafe_view", "as_strided", "detach", "alias", "expand", "slice",
             "empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "unsqueeze", "narrow",
             "device", "dim", "sym_size", "sym_stride", "sym_numel", "is_contiguous"}  # fmt: skip
    return collections.Counter({name: c for name, c in counter.names.items() if name not in views})


@pytest.mark.parametrize("recipe, casts", [(RowwiseScaling(), 6), (BlockwiseScaling(), 5)],
                         ids=["rowwise", "blockwise"])  # fmt: skip
def test_a_compiled_step_on_cuda_hands_the_casts_scales_to_the_gemms(recipe, casts):
    """Shapes with no padding: per step the casts (x, x.T, W, W.T, g, g.T; blockwise W.T from W's launch), three
    scaled GEMMs, the bias add after the GEMM and the bias gradient's sum; no scale is inverted or laid out again."""
    ops = _traced_step_ops(recipe, 256, 1024, 3072)
    gemms = ops["_scaled_mm"] + ops["_scaled_mm_v2"]
    assert ops["fine_tile_cast"] + ops["block_cast_transposed"] == casts and gemms == 3
    assert sum(ops.values()) == casts + gemms + 2, ops  # + the bias add and the bias gradient
    assert ops["add"] == 1 and ops["sum"] == 1
