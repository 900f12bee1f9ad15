"""The opt-in Gluon MX GEMM for Hopper: when it is chosen, and what its launcher hands the kernel.

It cannot run here (the Triton interpreter cannot run Gluon, and there is no GPU); its PTX is checked in
``test_aot_compile.py`` and its numbers by ``benchmarks/kernels_gpu.py`` on a GPU. Here: the choice (opted in,
capability 9.x, Gluon importable, never under the interpreter; the capability query is monkeypatched), that the
shipped kernel stays the default and takes over what the Gluon kernel refuses (computing the right product, in the
interpreter), and that the launcher's arguments bind to the kernel's signature with the tiles and layouts that were
compiled ahead of time.
"""

from __future__ import annotations

import pytest
import torch

from fp8_lightning import settings as settings_module
from fp8_lightning.kernels import availability
from tests.environment import set_env
from tests.kernels.test_block_gemm import check, mx_operand

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CUDA0 = torch.device("cuda", 0)
needs_gluon = pytest.mark.skipif(not availability.gluon_status()[0], reason=availability.gluon_status()[1])


@pytest.fixture
def hopper(monkeypatch):
    """A CUDA device of capability 9.0 as far as the choice can tell, outside the interpreter, opted in."""
    monkeypatch.delenv(availability.INTERPRET_ENV)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    set_env(monkeypatch, **{availability.GLUON_MX_GEMM_ENV: "1"})
    return monkeypatch


def test_the_setting_is_off_by_default_and_parsed_once():
    assert settings_module.Settings.from_environ({}).gluon_mx_gemm is False
    assert settings_module.Settings.from_environ({availability.GLUON_MX_GEMM_ENV: "yes"}).gluon_mx_gemm is True
    with pytest.raises(ValueError, match="FP8_LIGHTNING_GLUON_MX_GEMM='sometimes' is not a boolean"):
        settings_module.Settings.from_environ({availability.GLUON_MX_GEMM_ENV: "sometimes"})


@needs_gluon
def test_chosen_only_when_opted_in_on_capability_9(hopper):
    ok, reason = availability.gluon_mx_gemm_status(CUDA0)
    assert ok and "capability 9.0" in reason
    set_env(hopper, **{availability.GLUON_MX_GEMM_ENV: None})
    ok, reason = availability.gluon_mx_gemm_status(CUDA0)
    assert not ok and availability.GLUON_MX_GEMM_ENV in reason
    set_env(hopper, **{availability.GLUON_MX_GEMM_ENV: "1"})
    for capability in ((8, 9), (10, 0), (12, 0)):
        hopper.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        ok, reason = availability.gluon_mx_gemm_status(CUDA0)
        assert not ok and f"{capability[0]}.{capability[1]}" in reason and "Hopper" in reason


def test_never_chosen_on_cpu_under_the_interpreter_or_without_gluon(hopper):
    assert availability.gluon_mx_gemm_status("cpu") == (
        False, "the Gluon MX GEMM runs on CUDA devices; got cpu")  # fmt: skip
    hopper.setenv(availability.INTERPRET_ENV, "1")
    ok, reason = availability.gluon_mx_gemm_status(CUDA0)
    assert not ok and "interpreter" in reason
    hopper.delenv(availability.INTERPRET_ENV)
    hopper.setattr(availability, "gluon_status", lambda: (False, "Triton 3.2.0 has no usable Gluon dialect"))
    assert availability.gluon_mx_gemm_status(CUDA0) == (False, "Triton 3.2.0 has no usable Gluon dialect")


def _route(monkeypatch, chosen: bool) -> list:
    """Make the MX GEMM's choice ``chosen`` and record calls to the Gluon launcher instead of launching it."""
    from fp8_lightning.kernels import block_gemm_gluon

    calls = []
    monkeypatch.setattr(availability, "gluon_mx_gemm_status", lambda device: (chosen, "patched"))
    monkeypatch.setattr(block_gemm_gluon, "gluon_mx_gemm", lambda *args: calls.append(args) or "gluon")
    return calls


def _dense(q):
    return q.data, q.scale.view(torch.uint8)


@needs_gluon
def test_the_mx_gemm_hands_over_to_gluon_only_when_chosen(monkeypatch):
    from fp8_lightning.kernels import block_gemm

    a, b = mx_operand(33, 96, E4M3, seed=1), mx_operand(47, 96, E5M2, seed=2)
    calls = _route(monkeypatch, chosen=True)
    assert block_gemm.mx_gemm(*_dense(a), *_dense(b), torch.bfloat16) == "gluon"
    assert calls and calls[0][0] is a.data and calls[0][4] is torch.bfloat16
    assert block_gemm.mx_gemm(*_dense(a), *_dense(b), torch.float32, config=block_gemm.INTERPRETER_CONFIG) != "gluon"
    calls = _route(monkeypatch, chosen=False)  # the default: the shipped kernel computes the product
    check(block_gemm.mx_gemm(*_dense(a), *_dense(b), torch.float32), a, b, torch.float32)
    assert not calls


@needs_gluon
def test_what_the_gluon_kernel_refuses_goes_to_the_shipped_kernel(monkeypatch):
    from fp8_lightning.kernels import block_gemm, block_gemm_gluon

    a, b = mx_operand(16, 128, E4M3, seed=3), mx_operand(24, 128, E4M3, seed=4)
    strided = torch.zeros(16, 8, dtype=torch.uint8)[:, ::2]
    strided.copy_(a.scale.view(torch.uint8))
    assert "K-contiguous" in block_gemm_gluon.refusal(strided, b.scale.view(torch.uint8))
    assert block_gemm_gluon.refusal(a.scale.view(torch.uint8), b.scale.view(torch.uint8)) is None
    with pytest.raises(ValueError, match="K-contiguous scales; got strides"):  # asked directly: a clear error
        block_gemm_gluon.gluon_mx_gemm(a.data, strided, *_dense(b), torch.float32)
    calls = _route(monkeypatch, chosen=True)
    check(block_gemm.mx_gemm(a.data, strided, *_dense(b), torch.float32), a, b, torch.float32)
    assert not calls


@needs_gluon
def test_tiles_fit_the_output_and_the_block_size():
    from fp8_lightning.kernels.block_gemm_gluon import GLUON_TILES as TILES, tile_for, tiles_for_block

    assert tile_for(4096, 4096, 32) == (128, 128, 8) == TILES[0] and tile_for(4096, 4096, 64) == TILES[0]
    assert tile_for(4096, 4096, 128) == (128, 64, 8), "128-wide tiles spill at block 128 (Triton 3.6)"
    assert tile_for(100, 4096, 32) == (64, 128, 4) and tile_for(4096, 100, 32) == (128, 64, 8)
    assert tile_for(1, 1, 32) == tile_for(100, 100, 128) == (64, 64, 4)
    assert tiles_for_block(32) == TILES and (128, 128, 8) not in tiles_for_block(128)
    assert all(bm == 16 * warps for bm, _, warps in TILES), "each warp owns 16 rows of the wgmma tile"


@needs_gluon
@pytest.mark.parametrize("m, n, block, tile", [
    (200, 333, 32, None), (4096, 130, 128, None), (70, 300, 64, (64, 64, 4)),
])  # fmt: skip
def test_launcher_binds_the_kernel_signature_with_compiled_layouts(monkeypatch, m, n, block, tile):
    from fp8_lightning.kernels import block_gemm_gluon as module

    launches = []

    class Recorder:  # stands in for the kernel: ``kernel[grid](*args, **constexprs)``
        arg_names = module._gluon_mx_gemm_kernel.arg_names

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, args, kwargs))

    monkeypatch.setattr(module, "_gluon_mx_gemm_kernel", Recorder())
    a, b = mx_operand(m, 256, E4M3, block_size=block, seed=5), mx_operand(n, 256, E5M2, block_size=block, seed=6)
    out = module.gluon_mx_gemm(*_dense(a), *_dense(b), torch.float16, tile=tile)
    assert out.shape == (m, n) and out.dtype == torch.float16
    (grid, args, kwargs), = launches
    bound = dict(zip(Recorder.arg_names, args)) | kwargs
    assert set(bound) == set(Recorder.arg_names), "every kernel argument given once"
    bm, bn, warps = tile or module.tile_for(m, n, block)
    assert (bound["BLOCK_M"], bound["BLOCK_N"], bound["BLOCK_K"], bound["num_warps"]) == (bm, bn, block, warps)
    assert grid == (-(-m // bm) * -(-n // bn),)
    assert (bound["M"], bound["N"], bound["K"], bound["stride_cm"]) == (m, n, 256, n)
    for desc, rows, dtype in ((bound["a_desc"], bm, E4M3), (bound["b_desc"], bn, E5M2)):
        assert desc.block_shape == [rows, block] and desc.base.dtype == dtype
        assert desc.layout == module.shared_layout(rows, block, dtype)
        assert desc.layout.swizzle_byte_width == min(block, 128), "widest swizzle of a K-wide FP8 row"
    with pytest.raises(ValueError, match=f"not one of the tiles compiled for block size {block}"):
        module.gluon_mx_gemm(*_dense(a), *_dense(b), torch.float16, tile=(128, 128, 8) if block == 128 else (32, 32, 4))
