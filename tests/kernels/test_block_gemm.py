"""Block-scaled MX GEMM kernel against float64 math on the dequantized operands, in Triton's interpreter.

A GEMM is not bit-exact with any other summation order, so the bound is the float32 accumulation error:
``|out - ref| <= K * 2**-23 * (|A| @ |B|.T)`` (plus the output dtype's rounding). Every 32-wide block of the
inputs has its own magnitude (2**-20 .. 2**20), so a scale applied to the wrong block, row or column is off by
orders of magnitude, far outside the bound.
"""

from __future__ import annotations

import pytest
import torch

from fp8_lightning import gemm
from fp8_lightning.ops import triton_ops
from fp8_lightning.kernels.block_gemm import mx_gemm_configs
from fp8_lightning.ops.dispatch import dequantize_operand, fast_quantize_mx_operand
from fp8_lightning.quantize import Quantized
from tests.environment import set_env

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def mx_operand(
    rows: int, k: int, dtype: torch.dtype, block_size: int = 32, seed: int = 0, spread: int = 20
) -> Quantized:
    g = torch.Generator().manual_seed(seed)
    magnitude = torch.exp2(torch.randint(-spread, spread, (rows, k // block_size), generator=g).float())
    x = torch.randn(rows, k, generator=g) * magnitude.repeat_interleave(block_size, dim=1)
    return fast_quantize_mx_operand(x, block_size, "rceil", dtype)


def check(out: torch.Tensor, a: Quantized, b: Quantized, out_dtype: torch.dtype) -> None:
    a64, b64 = dequantize_operand(a).double(), dequantize_operand(b).double()
    ref = a64 @ b64.t()
    k = a.data.shape[1]
    bound = k * 2.0**-23 * (a64.abs() @ b64.abs().t())
    if out_dtype != torch.float32:
        bound = bound + ref.abs() * torch.finfo(out_dtype).eps
    assert out.dtype == out_dtype and out.shape == ref.shape
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), f"max error / bound = {(err / bound.clamp_min(1e-300)).max().item():.3g}"


@pytest.mark.parametrize("a_fp8, b_fp8", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)])
def test_ragged_shapes_and_mixed_formats(a_fp8, b_fp8):
    a, b = mx_operand(33, 96, a_fp8, seed=1), mx_operand(47, 96, b_fp8, seed=2)
    check(triton_ops.triton_mx_gemm(a, b, torch.float32), a, b, torch.float32)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_half_precision_output_and_64_blocks(out_dtype):
    # Block magnitudes within 2**+-5, so that float16 does not overflow.
    a = mx_operand(40, 128, E4M3, block_size=64, seed=3, spread=5)
    b = mx_operand(24, 128, E4M3, block_size=64, seed=4, spread=5)
    check(triton_ops.triton_mx_gemm(a, b, out_dtype), a, b, out_dtype)


def test_tile_configs_are_valid_and_grouped_order_covers_every_tile():
    for config in mx_gemm_configs():
        meta = config.kwargs
        for key in ("BLOCK_M", "BLOCK_N"):
            assert meta[key] >= 16 and meta[key] & (meta[key] - 1) == 0, config
        assert meta["GROUP_M"] >= 1 and config.num_warps in (4, 8) and config.num_stages >= 2
    from fp8_lightning.kernels.block_gemm import mx_gemm as launch

    a, b = mx_operand(150, 64, E4M3, seed=5), mx_operand(70, 64, E5M2, seed=6)
    # 5 x 3 tiles of 32 in groups of 2 rows, 3 x 2 tiles of 64 in groups of 8, and Ada's non-square tiles (32x64,
    # 64x32): every output written once.
    ada = [config.kwargs for config in mx_gemm_configs((8, 9))]
    for config in ({"BLOCK_M": 32, "BLOCK_N": 32, "GROUP_M": 2}, {"BLOCK_M": 64, "BLOCK_N": 64, "GROUP_M": 8}, *ada):
        out = launch(a.data, a.scale.view(torch.uint8), b.data, b.scale.view(torch.uint8), torch.float32, config)
        check(out, a, b, torch.float32)


def test_nan_scale_poisons_its_rows_only():
    a, b = mx_operand(8, 64, E4M3), mx_operand(8, 64, E4M3, seed=1)
    a.scale.view(torch.uint8)[3, 1] = 255
    out = triton_ops.triton_mx_gemm(a, b, torch.float32)
    assert torch.isnan(out[3]).all() and not torch.isnan(out[torch.arange(8) != 3]).any()


def test_unsupported_operands_are_refused_with_the_reason():
    a, b = mx_operand(8, 64, E4M3, block_size=16), mx_operand(8, 64, E4M3, block_size=16)
    with pytest.raises(ValueError, match="block size 16 is not supported"):
        triton_ops.triton_mx_gemm(a, b)
    per_tensor = Quantized(a.data, torch.tensor(1.0), "tensor")
    assert not triton_ops.mx_gemm_supported(per_tensor, per_tensor, torch.float32)[0]


def test_the_gemm_hands_mx_operands_to_the_kernel_where_it_runs_and_emulates_otherwise(monkeypatch):
    set_env(monkeypatch, FP8_LIGHTNING_GEMM="scaled_mm")  # the CUDA route, on CPU tensors
    a, b = mx_operand(16, 64, E4M3), mx_operand(24, 64, E5M2, seed=1)
    emulated = (dequantize_operand(a) @ dequantize_operand(b).t()).to(torch.bfloat16)
    assert torch.equal(gemm.fp8_mm(a, b, torch.bfloat16), emulated)  # no kernel for CPU tensors: the emulation
    calls = []
    monkeypatch.setattr(gemm, "kernels_usable", lambda t: True)
    monkeypatch.setattr(gemm, "triton_mx_gemm", lambda *args: calls.append(args) or emulated)
    gemm.fp8_mm(a, b, torch.bfloat16)
    assert len(calls) == 1
    c16, d16 = mx_operand(16, 64, E4M3, block_size=16), mx_operand(8, 64, E4M3, block_size=16)
    gemm.fp8_mm(c16, d16, torch.float32)  # block size 16: emulated even where the kernel runs
    assert len(calls) == 1


def test_strided_and_misaligned_operands_are_read_or_copied_for_the_descriptors():
    from fp8_lightning.kernels.block_gemm import mx_gemm as launch
    from fp8_lightning.kernels.descriptors import descriptor_ready

    a, b = mx_operand(40, 64, E4M3, seed=7), mx_operand(24, 64, E5M2, seed=8)
    wide = torch.zeros(40, 160, dtype=E4M3)
    wide[:, 16:80] = a.data
    aligned = wide[:, 16:80]  # rows 160 bytes apart, starting 16 bytes in: read where it lies
    assert descriptor_ready(aligned) is aligned
    wide[:, 8:72] = a.data
    misaligned = wide[:, 8:72]  # starts 8 bytes in: copied
    copied = descriptor_ready(misaligned)
    assert copied is not misaligned and copied.is_contiguous() and copied.data_ptr() % 16 == 0
    column_major = a.data.t().contiguous().t()
    for view in (misaligned, column_major):
        out = launch(view, a.scale.view(torch.uint8), b.data, b.scale.view(torch.uint8), torch.float32)
        check(out, a, b, torch.float32)


def test_autotuner_hooks_prune_per_gpu_and_size_the_descriptor_blocks(monkeypatch):
    from triton.tools.tensor_descriptor import TensorDescriptor

    from fp8_lightning.kernels import block_gemm

    out = torch.empty(1, 1)
    every = block_gemm.mx_gemm_configs()
    for capability, tallest in (((9, 0), 128), ((10, 0), 64), ((8, 9), 64)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        kept = block_gemm._prune_for_device(every, {"c_ptr": out})
        assert kept and max(c.kwargs["BLOCK_M"] for c in kept) == tallest
    a, b = torch.zeros(64, 64, dtype=E4M3), torch.zeros(32, 64, dtype=E4M3)
    args = {"a_desc": TensorDescriptor(a, [64, 64], [64, 1], [32, 32]),
            "b_desc": TensorDescriptor(b, [32, 64], [64, 1], [32, 32]), "BLOCK_K": 64}  # fmt: skip
    for config in every:
        config.pre_hook({**args, **config.kwargs})
        assert args["a_desc"].block_shape == [config.kwargs["BLOCK_M"], 64]
        assert args["b_desc"].block_shape == [config.kwargs["BLOCK_N"], 64]


def test_one_autotuning_serves_every_token_count_of_its_power_of_two_bucket(monkeypatch):
    """A new M re-tuned every candidate tile before; now the tile chosen for M's bucket is pinned for the rest."""
    import triton

    from fp8_lightning.kernels import block_gemm

    assert [block_gemm.m_bucket(m) for m in (1, 64, 65, 100, 128, 129, 4096, 4097)] == [
        64, 64, 128, 128, 128, 256, 4096, 8192]
    chosen = triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=4, num_stages=3)
    tunings, pinned_launches = [], []

    class Autotuner:  # stands in for triton.autotune's object: each call tunes, then exposes best_config
        best_config = chosen

        def __getitem__(self, grid):
            return lambda *args, **meta: tunings.append(args[5])

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **meta: pinned_launches.append((args[5], meta))

    monkeypatch.setattr(block_gemm, "_mx_gemm_autotuned", Autotuner())
    monkeypatch.setattr(block_gemm, "_mx_gemm_kernel", Kernel())
    monkeypatch.setattr(block_gemm, "_TUNED", {})
    monkeypatch.setattr("fp8_lightning.kernels.availability.interpreting", lambda: False)
    monkeypatch.setattr("fp8_lightning.kernels.availability.gluon_mx_gemm_status", lambda device: (False, ""))
    b, b_scale = torch.zeros(256, 128, dtype=E4M3), torch.zeros(256, 4, dtype=torch.uint8)
    for m in (1000, 1024, 777, 2000):
        a, a_scale = torch.zeros(m, 128, dtype=E4M3), torch.zeros(m, 4, dtype=torch.uint8)
        block_gemm.mx_gemm(a, a_scale, b, b_scale, torch.bfloat16)
    assert tunings == [1000, 2000]  # 1024 and 777 share 1000's bucket; 2000 opens the next one
    assert [m for m, _ in pinned_launches] == [1024, 777]
    assert all(meta["BLOCK_M"] == 64 and meta["num_warps"] == 4 for _, meta in pinned_launches)
