"""MXFP8 grouped GEMMs through torch._scaled_grouped_mm (sm_100): the arguments the library builds, read back by an
independent float64 interpreter of what torch 2.11's MSLK kernel computes from them (its own un-swizzle of the E8M0
scales and of each group's padding), against float64 products of the recipe's operands and the emulated MX grouped
GEMM; and torch 2.11's rules (the CUDA contract) and torch's meta function on the same calls."""

import warnings

import pytest
import torch

from fp8_lightning import mx_grouped
from fp8_lightning.cuda_contract.rules import Facts, Target
from fp8_lightning.cuda_contract.rules_grouped import meta_error
from fp8_lightning.cuda_contract.rules_mx_grouped import mx_scaled_grouped_mm
from fp8_lightning.grouped.gemm import GroupedScaling, fp8_grouped_mm
from fp8_lightning.groups import group_bounds
from fp8_lightning.mx_grouped import MXGroupedGemm, mx_dgrad_args, mx_fprop_args, mx_wgrad_args
from fp8_lightning.recipes import MXFP8BlockScaling, Recipe

E4M3 = torch.float8_e4m3fn
SIZES = [0, 5, 33, 17, 0, 40]  # empty experts, groups that are no multiple of 32
SM100 = Target("sm_100", (13, 0), (2, 11))


def _ru(a: int, b: int) -> int:
    return -(-a // b) * b


def unswizzle(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A (rows, cols) block of E8M0 bytes from its SWIZZLE_32_4_4 bytes: 128x4 tiles, each stored as 32 rows of 16
    bytes holding rows (r, r + 32, r + 64, r + 96), 4 bytes each."""
    tiles = flat.view(rows // 128, cols // 4, 32, 4, 4)  # tile row, tile column, r % 32, r // 32, column
    return tiles.permute(0, 3, 2, 1, 4).reshape(rows, cols)


def _decode(codes: torch.Tensor, exponents: torch.Tensor, dim: int) -> torch.Tensor:
    """float64 values of FP8 codes times 2**(e - 127), each exponent repeated over its 32 codes along ``dim``."""
    return codes.to(torch.float64) * torch.exp2(exponents.double() - 127).repeat_interleave(32, dim)


def kernel_f64(mat_a, mat_b, scale_a, scale_b, offs):
    """What the MXFP8 grouped call computes, in float64: groups from ``offs``, each group's scales read at the offsets
    ``set_grouped_gemm_args_kernel`` gives them; rows (or outputs) a group does not write stay NaN."""
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    sa, sb = scale_a.view(torch.uint8).reshape(-1), scale_b.view(torch.uint8)
    if mat_b.dim() == 3:
        (m, k), n = mat_a.shape, mat_b.shape[2]
        cols, out, pos = _ru(k // 32, 4), torch.full((m, n), float("nan"), dtype=torch.float64), 0
        for e, (s, t) in enumerate(zip(starts, ends)):
            if t == s:
                continue
            rows = _ru(t - s, 128)
            a_exp = unswizzle(sa[pos * cols : (pos + rows) * cols], rows, cols)[: t - s, : k // 32]
            pos += rows
            b_exp = unswizzle(sb[e], _ru(n, 128), cols)[:n, : k // 32]  # (N, K/32)
            out[s:t] = _decode(mat_a[s:t], a_exp, 1) @ _decode(mat_b[e], b_exp.t(), 0)
        return out
    m, n = mat_a.shape[0], mat_b.shape[1]
    out, pos_a, pos_b = torch.full((len(ends), m, n), float("nan"), dtype=torch.float64), 0, 0
    for e, (s, t) in enumerate(zip(starts, ends)):
        assert (t - s) % 32 == 0, "the kernel asserts groups of whole 32-token blocks"
        cols = _ru((t - s) // 32, 4)
        a_exp = unswizzle(sa[pos_a : pos_a + _ru(m, 128) * cols], _ru(m, 128), cols)[:m, : (t - s) // 32]
        b_exp = unswizzle(sb.reshape(-1)[pos_b : pos_b + _ru(n, 128) * cols], _ru(n, 128), cols)[:n, : (t - s) // 32]
        pos_a, pos_b = pos_a + _ru(m, 128) * cols, pos_b + _ru(n, 128) * cols
        if t > s:
            out[e] = _decode(mat_a[:, s:t], a_exp, 1) @ _decode(mat_b[s:t], b_exp.t(), 0)
    return out


def _values(q) -> torch.Tensor:
    """An MX operand's values in float64 (codes times its block scales, blocks along the last dimension)."""
    return _decode(q.data, q.scale.view(torch.uint8), 1)


def _inputs(sizes=SIZES, k=64, n=96, seed=0):
    torch.manual_seed(seed)
    m = sum(sizes)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    return torch.randn(m, k) * 3, torch.randn(len(sizes), k, n) / 8, offs, torch.randn(m, n)


def _operands(recipe, a, b, offs, g):
    bounds = group_bounds(offs, a.shape[0], b.shape[0])
    x, x_cols = recipe.grouped_operands("input", a, bounds, E4M3, True, None, True)
    w = recipe.grouped_weight_operands(b.transpose(1, 2), E4M3, [None] * b.shape[0], True)
    gq, g_cols = recipe.grouped_operands("grad_output", g, bounds, E4M3, True, None, True)
    return bounds, x, x_cols, w, gq, g_cols


@pytest.mark.parametrize("sizes, k, n", [(SIZES, 64, 96), ([300, 0, 129, 7], 288, 160)],
                         ids=["small", "several 128x4 tiles per group"])
def test_the_arguments_give_each_gemm_of_the_operands(sizes, k, n):
    """Each call's arguments, read as the kernel reads them, give the float64 products of the recipe's operands:
    fprop and dgrad per expert, wgrad per expert over its own tokens, zero for empty experts; with groups and
    experts spanning several 128-row and 4-block tiles of the swizzled scales."""
    a, b, offs, g = _inputs(sizes, k, n)
    bounds, x, x_cols, w, gq, g_cols = _operands(MXFP8BlockScaling(), a, b, offs, g)
    y = kernel_f64(*mx_fprop_args(x, w, offs), offs)
    da = kernel_f64(*mx_dgrad_args(gq, w, offs), offs)
    db = kernel_f64(*mx_wgrad_args(g_cols, x_cols))
    for e, (s, t) in enumerate(bounds):
        torch.testing.assert_close(y[s:t], _values(x)[s:t] @ _values(w[e][0]).t(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(da[s:t], _values(gq)[s:t] @ _values(w[e][1]).t(), rtol=1e-12, atol=1e-12)
        if s == t:
            assert db[e].abs().max() == 0 and g_cols[e] is None and x_cols[e] is None
            continue
        torch.testing.assert_close(db[e], _values(g_cols[e]) @ _values(x_cols[e]).t(), rtol=1e-12, atol=1e-12)


def test_the_grouped_columns_have_the_bits_of_per_group_casts():
    """One cast of the padded layout equals casting each group's rows on its own (the protocol's default), with each
    group starting at a multiple of 32 tokens and an empty group holding 32 zero tokens."""
    recipe = MXFP8BlockScaling()
    a, _, offs, _ = _inputs()
    bounds = group_bounds(offs, a.shape[0], len(SIZES))
    _, per_group = Recipe.grouped_operands(recipe, "input", a, bounds, E4M3, True, None, True)
    _, grouped = recipe.grouped_operands("input", a, bounds, E4M3, True, None, True)
    assert grouped.offs.tolist() == [32, 64, 128, 160, 192, 256]
    for mine, theirs in zip(grouped, per_group):
        assert (mine is None) == (theirs is None)
        if theirs is not None:
            assert torch.equal(mine.data.view(torch.uint8), theirs.data.view(torch.uint8))
            assert torch.equal(mine.scale.view(torch.uint8), theirs.scale.view(torch.uint8))
    used = torch.zeros(grouped.codes_t.shape[1], dtype=torch.bool)
    for (start, end), pad_start in zip(bounds, [0, 32, 64, 128, 160, 192]):
        used[pad_start : pad_start + end - start] = True
    assert not grouped.codes_t[:, ~used].view(torch.uint8).any()  # padding is zero codes


def _run(recipe, a, b, offs, g):
    a_, b_ = a.clone().requires_grad_(), b.clone().requires_grad_()
    y = fp8_grouped_mm(a_, b_, offs, recipe=recipe, scaling=GroupedScaling(recipe, b.shape[0]))
    y.backward(g)
    return y, a_.grad, b_.grad


@pytest.mark.parametrize("sizes", [SIZES, [7, 0, 16, 3] * 8, [0, 0, 0]], ids=["6 experts", "32 experts", "empty"])
def test_the_layer_runs_one_launch_per_gemm_and_equals_the_emulation(sizes, monkeypatch):
    """fp8_grouped_mm with the native route, its launch read by the float64 interpreter, equals the emulated MX
    grouped GEMM on the same operands (fprop, dgrad, wgrad); three launches whatever the number of experts, none for
    an empty batch; every call passes torch 2.11's rules on a simulated sm_100 and torch's meta function."""
    recipe = MXFP8BlockScaling()
    a, b, offs, g = _inputs(sizes, seed=2)
    emulated = _run(recipe, a, b, offs, g)
    calls = []

    def launch(mat_a, mat_b, scale_a, scale_b, offs_):
        calls.append((mat_a, mat_b, scale_a, scale_b, offs_))
        return kernel_f64(mat_a, mat_b, scale_a, scale_b, offs_)

    monkeypatch.setattr(mx_grouped, "_launch", launch)
    monkeypatch.setattr(MXFP8BlockScaling, "grouped_native", lambda self, device, experts: MXGroupedGemm())
    native = _run(recipe, a, b, offs, g)
    assert [c[1].dim() for c in calls] == ([3, 3, 2] if sum(sizes) else [])
    for name, got, ref in zip(("y", "da", "db"), native, emulated):
        assert got.dtype == ref.dtype and got.shape == ref.shape and not got.isnan().any()
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * max(ref.abs().amax().item() if ref.numel() else 1.0, 1.0), msg=name)
    for args in calls:
        assert meta_error(*args) is None
        sizes_along = torch.diff(args[4], prepend=args[4].new_zeros(1)).tolist()
        outcome = mx_scaled_grouped_mm(SM100, *(Facts.of(t) for t in args), torch.bfloat16, sizes_along)
        assert outcome.violation is None and outcome.kernel == "MSLK mx8mx8bf16_grouped_mm (sm_100a)"
        assert "sm_100a" in mx_scaled_grouped_mm(Target("sm_90"), *(Facts.of(t) for t in args)).violation


def test_a_build_without_the_kernel_falls_back_with_one_warning(monkeypatch):
    """On a (simulated) sm_100 the recipe hands out its grouped kernels when the probe call runs; when torch lacks the
    kernel the grouped GEMMs are emulated and the emulation's one warning gives torch's reason; on sm_90 no reason
    beyond the route's."""
    from fp8_lightning.grouped import gemm as grouped_gemm

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    monkeypatch.setattr(grouped_gemm, "_WARNED", set())
    mx_grouped._device_reason.cache_clear()
    try:
        monkeypatch.setattr(mx_grouped, "probe", lambda device: torch.full((32, 32), 32.0))
        assert isinstance(MXFP8BlockScaling().grouped_native(cuda, 64), MXGroupedGemm)
        assert MXFP8BlockScaling().grouped_fallback_reason(cuda, 64) is None
        assert MXFP8BlockScaling().grouped_native(cuda, 1025) is None
        assert "at most 1024 groups" in MXFP8BlockScaling().grouped_fallback_reason(cuda, 1025)
        assert MXFP8BlockScaling(fp8_format="HYBRID").grouped_native(cuda, 8) is None  # e5m2 gradients
        mx_grouped._device_reason.cache_clear()

        def missing(device):
            raise NotImplementedError("mxfp8_mxfp8 grouped gemm requires compile with USE_MSLK")

        monkeypatch.setattr(mx_grouped, "probe", missing)
        assert MXFP8BlockScaling().grouped_native(cuda, 8) is None
        reason = MXFP8BlockScaling().grouped_fallback_reason(cuda, 8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                grouped_gemm.warn_once(cuda, reason)
        assert len(caught) == 1 and "requires compile with USE_MSLK" in str(caught[0].message)
        mx_grouped._device_reason.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        assert "compute capability 10.x" in mx_grouped.mx_native_unavailable_reason(cuda, 8)
        assert MXFP8BlockScaling().grouped_fallback_reason(cuda, 8) is None  # the generic warning covers sm_90
    finally:
        mx_grouped._device_reason.cache_clear()


def test_the_route_is_native_on_sm_100_only():
    from fp8_lightning.capability_table import grouped_route_on

    route = grouped_route_on(MXFP8BlockScaling(), (10, 0), (13, 0), True)
    assert route.verdict == "native" and "torch._scaled_grouped_mm" in route.gemm
    for arch in ((9, 0), (8, 9), (12, 0)):
        assert grouped_route_on(MXFP8BlockScaling(), arch, (13, 0), True).verdict == "fallback"
    assert grouped_route_on(MXFP8BlockScaling(fp8_format="HYBRID"), (10, 0), (13, 0), True).verdict == "fallback"
    assert grouped_route_on(MXFP8BlockScaling(block_size=64), (10, 0), (13, 0), True).verdict == "fallback"
    assert MXFP8BlockScaling().grouped_native(torch.device("cpu"), 8) is None


def _gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA sm_100 device with torch's MXFP8 grouped kernel: CUDA is not available"
    reason = mx_grouped.mx_native_unavailable_reason(torch.device("cuda"), 8)
    return None if reason is None else f"needs torch's MXFP8 grouped kernel: {reason}"


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
def test_on_sm_100_the_kernel_reads_the_arguments_as_the_interpreter_does():
    """The kernel's bf16 output on the library's arguments against the float64 interpreter of the same arguments."""
    a, b, offs, g = (t.cuda() for t in _inputs())
    _, x, x_cols, w, gq, g_cols = _operands(MXFP8BlockScaling(), a, b, offs, g)
    for args in (mx_fprop_args(x, w, offs) + (offs,), mx_dgrad_args(gq, w, offs) + (offs,), mx_wgrad_args(g_cols, x_cols)):
        got = mx_grouped._launch(*args).double().cpu()
        ref = kernel_f64(*(t.cpu() for t in args))
        torch.testing.assert_close(got, ref, rtol=2**-8, atol=2**-8 * ref.abs().max().item())
