"""FP8 statistics: overflow/underflow counts against hand-built tensors and float64 references, and the
collector's per-step bookkeeping on a real FP8Linear."""

import math

import pytest
import torch
import torch.nn as nn

from fp8_lightning import DelayedScaling, convert_to_fp8, fp8_autocast
from fp8_lightning.blockwise import per_element
from fp8_lightning.mx import quantize_mxfp8
from fp8_lightning.quantize import Quantized, quantize_with_scale
from fp8_lightning.stats import (
    OperandStats,
    attach_collector,
    detach_collector,
    headroom_bits,
    overflow_count,
    representative_scale,
    underflow_count,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def tensor_operand(x: torch.Tensor, scale: float, dtype=E4M3) -> Quantized:
    s = torch.tensor(scale)
    return Quantized(quantize_with_scale(x, s, dtype), s, "tensor")


def test_overflow_counts_values_beyond_the_max_after_scaling():
    x = torch.tensor([0.0, 100.0, 224.0, 231.0, 232.5, 300.0, -500.0, float("inf")])
    q = tensor_operand(x, 2.0)  # x*2 > 464 (past 448, beyond rounding's reach) for 232.5, 300, -500, inf
    assert overflow_count(x, q).item() == 4
    assert overflow_count(x, tensor_operand(x, 1e-3)).item() == 1  # only inf


def test_underflow_counts_nonzero_values_flushed_to_zero():
    # E4M3 smallest subnormal is 2**-9; with scale 1, |x| < 2**-10 rounds to 0 (2**-10 itself ties to even: 0)
    x = torch.tensor([0.0, 2.0**-12, -(2.0**-11), 2.0**-10, 2.0**-9, 1.0, float("nan")])
    q = tensor_operand(x, 1.0)
    assert underflow_count(x, q).item() == 3  # 2**-12, -2**-11, 2**-10; zero and NaN do not count
    assert underflow_count(x, tensor_operand(x, 2.0**4)).item() == 0  # scaled up, nothing flushes


def test_counts_for_mx_blocks_use_each_blocks_own_scale():
    torch.manual_seed(0)
    x = torch.randn(4, 64, dtype=torch.float64)
    x[0, :32] *= 1e6  # one loud block, the rest quiet
    x[1, 5] = 1e-30  # flushes inside its block
    data, scale = quantize_mxfp8(x.float(), block_size=32, scale_rounding="floor")
    q = Quantized(data, scale, "mx")
    # independent reference: decode E8M0 bytes with math, count in float64
    exps = scale.view(torch.uint8).to(torch.int64) - 127
    over = under = 0
    for i in range(4):
        for j in range(64):
            v = x[i, j].item() / math.ldexp(1.0, int(exps[i, j // 32]))
            over += abs(v) > 464  # past 448 by more than rounding reaches (the next E4M3 step would be 480)
            under += x[i, j].item() != 0 and data[i, j].float().item() == 0
    assert overflow_count(x.float(), q).item() == over and over > 0  # "floor" saturates block tops
    assert underflow_count(x.float(), q).item() == under and under >= 1


def test_counts_for_tiles_and_rows_use_each_ones_own_scale():
    """Blockwise (1x128 tiles, here with float32 scales and a hand-made loud tile) and rowwise operands: each
    element is judged by its own tile's or row's multiplier (float64 reference, element by element)."""
    torch.manual_seed(0)
    x = torch.randn(3, 200, dtype=torch.float64)
    x[0, :128] *= 1e6  # one loud tile
    x[1, 5], x[2, 150] = 1e-30, 1e-30  # flush inside their tiles
    tile_scale = torch.tensor([[448 / 5e6, 448 / 3.0], [448 / 3.0, 448 / 3.0], [448 / 2.0, 448 / 3.0]])  # 2 tiles/row
    data = quantize_with_scale(x.float(), per_element(tile_scale, x.shape), E4M3)
    for q, factor in ((Quantized(data, tile_scale, "block"), lambda i, j: tile_scale[i, j // 128].item()),
                      (Quantized(data, tile_scale[:, :1], "row"), lambda i, j: tile_scale[i, 0].item())):  # fmt: skip
        over = sum(abs(x[i, j].item() * factor(i, j)) > 464 for i in range(3) for j in range(200))  # past rounding
        under = sum(x[i, j].item() != 0 and data[i, j].float().item() == 0 for i in range(3) for j in range(200))
        assert overflow_count(x.float(), q).item() == over and underflow_count(x.float(), q).item() == under >= 2
        assert representative_scale(q).item() == pytest.approx(448 / 5e6)  # the loudest tile or row
    assert over > 0  # row 2 takes its first tile's scale, too large for its second tile: those saturate


def test_headroom_bits():
    assert headroom_bits(1.0, 448.0, 448.0) == 0.0
    assert headroom_bits(1.0, 112.0, 448.0) == 2.0
    assert headroom_bits(4.0, 448.0, 448.0) == -2.0
    assert headroom_bits(0.0, 1.0, 448.0) == math.inf and math.isnan(headroom_bits(float("nan"), 1.0, 448.0))
    s = OperandStats("l", "input", amax=2.0, scale=56.0, overflow=0, underflow=0, nonfinite=False, fp8_max=448.0)
    assert s.headroom_bits == 2.0


def _layer_model():
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    convert_to_fp8(model, DelayedScaling())
    return model


def test_collector_records_a_step_per_layer_and_role():
    model = _layer_model()
    collector = attach_collector(model)
    assert attach_collector(model) is collector  # shared, one per model
    collector.always = True
    x = torch.randn(8, 32, dtype=torch.float64).float()
    x[0, 0] = 9.0
    with fp8_autocast():
        model(x).sum().backward()
    stats = collector.finish_step()
    assert set(stats) == {(n, r) for n in ("0", "2") for r in ("input", "weight", "grad_output")}
    first = stats[("0", "input")]
    assert first.amax == 9.0 and first.fp8_max == 448.0
    assert first.scale == pytest.approx(448.0 / 9.0, rel=1e-6)  # first use: just-in-time delayed scale
    assert first.overflow == 0.0 and not first.nonfinite
    assert stats[("2", "grad_output")].fp8_max == 57344.0  # HYBRID: E5M2 gradients
    assert stats[("2", "grad_output")].amax == 1.0  # d(sum)/dy = 1
    assert stats[("0", "input")].order < stats[("2", "input")].order < stats[("2", "grad_output")].order
    assert not collector.pending and collector.finish_step() == {}  # counts were reset


def test_collector_only_counts_requested_steps_and_detaches():
    model = _layer_model()
    collector = attach_collector(model)
    with fp8_autocast():
        model(torch.randn(4, 32))
    assert not collector.pending  # neither always nor requested
    collector.request_step()
    with fp8_autocast():
        model(torch.full((4, 32), float("nan")))
    stats = collector.finish_step()
    assert stats[("0", "input")].nonfinite and stats[("0", "input")].amax == 0.0
    detach_collector(model)
    assert model[0].fp8_observer is None and "_fp8_stats_collector" not in model.__dict__


def test_core_modules_never_import_lightning():
    import ast
    import pathlib

    import fp8_lightning

    root = pathlib.Path(fp8_lightning.__file__).parent
    for name in ("stats.py", "guard.py"):
        tree = ast.parse((root / name).read_text())
        imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in imported if m.split(".")[0] in ("lightning", "pytorch_lightning")], name


@pytest.mark.parametrize(("dtype", "threshold"), [(torch.float8_e4m3fn, 464.0), (torch.float8_e5m2, 61440.0)])
def test_overflow_counts_only_values_the_clamp_changed(dtype, threshold):
    """E4M3: max 448, the next step would be 480, so values up to the midpoint 464 round to 448 unclamped; E5M2:
    max 57344, next 65536 (inf), midpoint 61440. A tensor scaled so that its largest element is a float32 hair
    above the max has no overflow."""
    from fp8_lightning.stats import overflow_count, saturation_threshold

    assert saturation_threshold(dtype) == threshold
    top = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}[dtype]
    x = torch.tensor([top * (1 + 2**-23), -top, 1.0, threshold * 0.999, threshold * 1.001, -2 * top])
    q = Quantized(quantize_with_scale(x, torch.tensor(1.0), dtype), torch.tensor(1.0), "tensor")
    assert int(overflow_count(x, q)) == 2  # only the last two: beyond the midpoint
    weight = torch.randn(64, 64)
    scale = torch.tensor(top) / weight.abs().max()  # the weight's own amax scaled to the max
    qw = Quantized(quantize_with_scale(weight, scale, dtype), scale, "tensor")
    assert int(overflow_count(weight, qw)) == 0
