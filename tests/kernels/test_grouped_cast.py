"""The grouped columnwise cast kernel against its pure-torch twin and the per-group reference casts, bit for bit.

In Triton's interpreter on CPU: every group's columnwise copy of sorted tokens (``grouped_columnwise`` with the
kernel against the pure-torch scatter/cast/pad/transpose, and each group against ``quantize_rowwise`` of its rows on
their own), and the transposed copy of stacked expert weights (against the rowwise cast of each expert's ``W_e.T``).
Groups of 0 tokens, groups not a multiple of 16, NaN, infinities, zero columns and tiny magnitudes are included.
"""

from __future__ import annotations

import pytest
import torch

from fp8_lightning.groups import GroupBounds, device_layout
from fp8_lightning.ops import triton_ops
from fp8_lightning.rowwise import quantize_rowwise
from fp8_lightning.rowwise_grouped import GROUP_ALIGN, grouped_columnwise, stacked_columns
from tests.kernels.conftest import requires_cuda_kernels
from tests.kernels.references import assert_same_fp8

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SIZES = [0, 5, 33, 17, 0, 40, 1]


def tokens(sizes, k: int, dtype=torch.float32, seed: int = 0) -> tuple[torch.Tensor, GroupBounds]:
    """Sorted tokens of magnitudes 2**-20 .. 2**20 per column, a zero column, a NaN, +inf and -inf, and their
    bounds with ``offs`` attached as ``fp8_grouped_mm`` makes them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes), k, generator=g) * torch.exp2(torch.randint(-20, 20, (1, k), generator=g).float())
    x[:, 3] = 0.0
    x[6, 1], x[10, k - 1], x[-1, 2] = float("nan"), float("inf"), float("-inf")
    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
    starts = [0, *offs.tolist()[:-1]]
    return x.to(dtype), GroupBounds(zip(starts, offs.tolist()), offs)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("power_of_2", [True, False])
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
def test_tokens_equal_the_pure_torch_twin_and_each_group_cast_alone(dtype, power_of_2, source):
    x, bounds = tokens(SIZES, 72, source)
    eps = 1e-12
    kernel = grouped_columnwise(x, bounds, dtype, eps, power_of_2, triton_ops.triton_grouped_column_cast)
    twin = grouped_columnwise(x, bounds, dtype, eps, power_of_2)
    assert_same_fp8(kernel.codes_t, twin.codes_t)
    assert torch.equal(kernel.scale, twin.scale)
    assert kernel.offs.tolist() == twin.offs.tolist() == [16, 32, 80, 112, 128, 176, 192]
    for (start, end), mine in zip(bounds, kernel):
        if start == end:
            assert mine is None
            continue
        data, scale = quantize_rowwise(x[start:end], dtype, 0, eps, power_of_2)  # one scale per column
        assert_same_fp8(mine.data, data.t())
        assert torch.equal(mine.scale.reshape(-1), scale.reshape(-1))


def test_padding_is_zero_codes_and_an_empty_batch_of_groups_works():
    x, bounds = tokens([3, 0, 20], 32)
    kernel = grouped_columnwise(x, bounds, E4M3, 1e-12, True, triton_ops.triton_grouped_column_cast)
    used = torch.zeros(kernel.codes_t.shape[1], dtype=torch.bool)
    for (start, end), pad_start in zip(bounds, [0, 16, 32]):
        used[pad_start : pad_start + end - start] = True
    assert kernel.codes_t.shape == (32, 64)
    assert not kernel.codes_t[:, ~used].view(torch.uint8).any()


def test_device_layout_matches_the_host_bounds():
    offs = torch.cumsum(torch.tensor(SIZES), 0).to(torch.int32)
    starts, rows, out_starts, out_ends = device_layout(offs, GROUP_ALIGN)
    assert starts.tolist() == [0, 0, 5, 38, 55, 55, 95] and rows.tolist() == SIZES
    assert out_starts.tolist() == [0, 16, 32, 80, 112, 128, 176] and out_ends.tolist()[-1] == 192
    assert (starts.dtype, rows.dtype, out_starts.dtype, out_ends.dtype) == (torch.int32,) * 2 + (torch.int64,
                                                                                                  torch.int32)


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
def test_stacked_weights_transposed_copy_equals_each_expert_cast_alone(source):
    g = torch.Generator().manual_seed(1)
    experts, n, k = 3, 48, 80
    weight = (torch.randn(experts, n, k, generator=g) * 2.0 ** torch.randint(-8, 8, (experts, 1, k), generator=g))
    weight[1, :, 5] = 0.0
    weight[2, 7, 9] = float("inf")
    weight = weight.to(source)
    q = stacked_columns(weight, E4M3, 1e-12, True, triton_ops.triton_grouped_column_cast)
    assert q.data.shape == (experts * k, n) and q.data.is_contiguous() and q.kind == "row"
    for e in range(experts):
        data, scale = quantize_rowwise(weight[e].t(), E4M3, -1, 1e-12, True)  # W_e.T, one scale per row
        assert_same_fp8(q.data[e * k : (e + 1) * k], data)
        assert torch.equal(q.scale[e * k : (e + 1) * k], scale)
        assert torch.equal(q.cache.inverse[e * k : (e + 1) * k], scale.reciprocal())


def test_bad_bounds_say_what_is_wanted():
    x = torch.randn(8, 16)
    ok = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="out_starts must be a 1-D torch.int64"):
        triton_ops.triton_grouped_column_cast(x, ok, ok + 8, ok, 16 * 16, 16)
    with pytest.raises(ValueError, match="align must be a positive"):
        triton_ops.triton_grouped_column_cast(x, ok, ok + 8, ok.long(), 16 * 16, 16, align=0)


def test_grouped_mm_on_the_kernels_equals_the_pure_path(monkeypatch):
    """The rowwise recipe's CUDA branch (every cast a Triton launch, the grouped columnwise copies and the experts'
    W.T from the grouped kernel) run on CPU by pointing the dispatch hook at the kernels: the forward and both
    gradients of ``fp8_grouped_mm`` are those of the pure-torch casts, bit for bit."""
    from fp8_lightning import RowwiseScaling, fp8_grouped_mm
    from fp8_lightning.ops import dispatch
    from tests.environment import set_env

    set_env(monkeypatch, FP8_LIGHTNING_DISABLE_CPU_CODEC="1")
    calls, kernel = [], triton_ops.triton_grouped_column_cast

    def recorded(*args, **kwargs):
        calls.append(args[0].shape)
        return kernel(*args, **kwargs)

    g = torch.Generator().manual_seed(3)
    sizes, k, n = [9, 0, 40, 23], 64, 96
    a = torch.randn(sum(sizes), k, generator=g)
    b = torch.randn(len(sizes), n, k, generator=g).transpose(1, 2) / 8  # (E, N, K) storage, as transformers
    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
    grad = torch.randn(sum(sizes), n, generator=g)

    def run():
        x, w = a.clone().requires_grad_(), b.clone().requires_grad_()
        y = fp8_grouped_mm(x, w, offs, recipe=RowwiseScaling(fp8_format="E4M3"))
        y.backward(grad)
        return y.detach(), x.grad, w.grad

    pure = run()
    monkeypatch.setattr(dispatch, "cuda_kernels", lambda x: triton_ops if triton_ops.supports_input(x) else None)
    monkeypatch.setattr(triton_ops, "triton_grouped_column_cast", recorded)
    kernels = run()
    assert len(calls) == 3  # the input's and the gradient's columnwise copies, and the experts' W.T
    for mine, theirs in zip(kernels, pure):
        assert torch.equal(mine, theirs)
    b = b.contiguous()  # (E, K, N) storage: W.T's rows are a view of it, cast without the grouped kernel
    calls.clear()
    for mine, theirs in zip(run(), pure):
        assert torch.equal(mine, theirs)
    assert len(calls) == 2


@pytest.mark.gpu
@requires_cuda_kernels
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
def test_compiled_kernel_on_cuda_equals_the_pure_torch_twin(source):
    """The compiled kernel on a GPU: the tokens' and the stacked weights' copies equal the pure-torch twin's bits on
    the same CUDA tensors (bf16 subnormals included, which the interpreter flushes)."""
    x, bounds = tokens(SIZES + [300, 0, 129], 192, source)
    x[20, 7] = 2.0**-130
    x, offs = x.cuda(), bounds.offs.cuda()
    bounds = GroupBounds(list(bounds), offs)
    kernel = grouped_columnwise(x, bounds, E4M3, 1e-12, True, triton_ops.triton_grouped_column_cast)
    twin = grouped_columnwise(x, bounds, E4M3, 1e-12, True)
    assert_same_fp8(kernel.codes_t, twin.codes_t)
    assert torch.equal(kernel.scale, twin.scale) and torch.equal(kernel.offs, twin.offs)
    weight = torch.randn(5, 96, 160, device="cuda").to(source)
    q = stacked_columns(weight, E5M2, 1e-12, False, triton_ops.triton_grouped_column_cast)
    data, scale = quantize_rowwise(weight.transpose(1, 2).reshape(5 * 160, 96), E5M2, -1, 1e-12, False)
    assert_same_fp8(q.data, data)
    assert torch.equal(q.scale, scale)
