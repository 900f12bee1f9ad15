"""FP8 gradient communication on 2 gloo processes: the DDP hook's mean and FSDP2's FP8 reduce-scatter.

One spawn runs every case (process start-up dominates the cost). What each assertion shows:

* On adversarial gradients (one rank 1e4x larger, magnitudes down to 2**-40 of the block's maximum so many codes
  are FP8 subnormals, a gradient near float32's smallest normals, zeros on one or both ranks), in E4M3 and E5M2,
  the mean differs from the float64 mean by at most the FP8 rounding bound, element by element: half a unit in
  the last place of each rank's scaled value (the sent codes), plus, for the all-reduce, half a unit of the
  scaled mean (the code sent back), at the block scale ``fp8_max / amax`` computed here from both ranks' data.
  Both ranks get the same mean bit for bit.
* A block holding NaN or inf on any rank comes back NaN (on every rank); the other blocks stay within the bound.
* The automatic factor doubles after a clean call and backs off when the mean would overflow, without saturating.
* Wire bytes per rank for one backward, counted at the torch.distributed calls (scales included): the FP8 hook
  moves at most 0.55x a bf16 all-reduce hook (and about a quarter of float32); FP8ReduceScatter at most 0.55x
  FSDP2's bf16 reduce-scatter. The averaged gradients are those of float32 communication to FP8 precision.
* Lightning: ``FP8DDPStrategy(fp8_gradients=True)`` and ``FP8FSDPStrategy(fp8_reduce_scatter=True)`` put the FP8
  communication in place and train to the losses of the same strategies without it.
"""

import math

import pytest
import torch
import torch.multiprocessing as mp

from fp8_lightning.distributed import FP8CommState, FP8ReduceScatter
from tests.distributed._grad_comm_workers import BLOCK, CASES, NUMEL, worker
from fp8_lightning.testing import free_port

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")]
WORLD = 2
FORMATS = {"e4m3": (448.0, 3, -6), "e5m2": (57344.0, 2, -14)}  # max, mantissa bits, smallest normal exponent


@pytest.fixture(scope="module")
def results():
    out = mp.Manager().dict()
    mp.spawn(worker, args=(WORLD, free_port(), out), nprocs=WORLD)
    return dict(out)


def half_ulp(scaled: torch.Tensor, fmt: str) -> torch.Tensor:
    """Half the spacing of FP8 values around |scaled| (float64): round-to-nearest's worst error there."""
    _, mantissa_bits, min_exponent = FORMATS[fmt]
    exponent = torch.floor(torch.log2(scaled.abs().clamp(min=1e-300))).clamp(min=min_exponent)
    return torch.exp2(exponent - mantissa_bits - 1)


def block_scales(inputs: list[torch.Tensor], fmt: str) -> torch.Tensor:
    """Per element, the scale of its block: fp8_max / (max |g| over the block and the ranks), in float32."""
    chunk = math.ceil(NUMEL / WORLD)
    index = torch.arange(NUMEL)
    block_id = (index // chunk) * 1000 + (index % chunk) // BLOCK
    magnitude = torch.stack(inputs).double().abs().nan_to_num(0.0, 0.0).amax(0)
    amax = torch.zeros(block_id.max() + 1, dtype=torch.float64).scatter_reduce(0, block_id, magnitude, "amax")
    scale = (FORMATS[fmt][0] / amax).clamp(max=torch.finfo(torch.float32).max).float().double()
    return scale[block_id], block_id


def bounds(inputs, fmt, factor=1.0):
    """(float64 mean, reduce-scatter bound, all-reduce bound) per element."""
    scale, _ = block_scales(inputs, fmt)
    stacked = torch.stack(inputs).double()
    mean = stacked.mean(0)
    sent = sum(half_ulp(g * scale, fmt) for g in stacked) / scale / WORLD
    slack = 1e-6 * stacked.abs().mean(0) + 1e-45
    reduced = sent + slack
    back = half_ulp((mean.abs() + reduced) * scale * factor, fmt) / (scale * factor)
    return mean, reduced, reduced + back


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", [c for c in CASES if c != "nonfinite"])
def test_mean_within_fp8_rounding_bound(results, fmt, case):
    r = results[fmt, case]
    mean, rs_bound, ar_bound = bounds(r["inputs"], fmt)
    assert torch.equal(r["means"][0], r["means"][1])
    assert ((r["means"][0].double() - mean).abs() <= ar_bound).all()
    shards = torch.cat(r["shards"])[:NUMEL].double()
    assert ((shards - mean).abs() <= rs_bound).all()
    if case.startswith("zeros"):
        assert torch.equal(r["means"][0] == 0, mean == 0)  # exact zeros stay zeros
    if case == "log_uniform":  # the case reaches the subnormals and the bound there is not vacuous
        scale, _ = block_scales(r["inputs"], fmt)
        assert ((mean.abs() * scale) < 2.0 ** FORMATS[fmt][2]).float().mean() > 0.05
        assert (r["means"][0].double() - mean).abs().max() > 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_nonfinite_blocks_come_back_nan(results, fmt):
    r = results[fmt, "nonfinite"]
    _, block_id = block_scales(r["inputs"], fmt)
    bad = torch.zeros_like(block_id, dtype=torch.bool)
    for g in r["inputs"]:
        bad |= torch.isin(block_id, block_id[~torch.isfinite(g)])
    assert bad.sum() == 2 * BLOCK  # one block from each rank
    clean = [g.masked_fill(bad, 0.0) for g in r["inputs"]]
    mean, rs_bound, ar_bound = bounds(clean, fmt)
    for result, bound in [(r["means"][0], ar_bound), (r["means"][1], ar_bound),
                          (torch.cat(r["shards"])[:NUMEL], rs_bound)]:
        assert result[bad].isnan().all()
        assert ((result[~bad].double() - mean[~bad]).abs() <= bound[~bad]).all()


def test_factor_grows_then_backs_off_on_overflow(results):
    r = results["backoff"]
    assert r["grown"] == 2.0  # one clean call with growth_interval=1
    assert r["after"] == 1.0 and r["backoffs"] == 1  # identical ranks: mean == the gradient, 2x would overflow
    for result in (r["first"], r["second"]):
        mean, _, bound = bounds([r["input"], r["input"]], "e4m3")
        assert ((result.double() - mean).abs() <= bound).all()


def test_factor_stays_at_one_for_adversarial_means(results):
    """A fresh state uses factor 1 and a single call does not grow it (growth_interval defaults to 50)."""
    assert {results[fmt, case]["factor"] for fmt in FORMATS for case in CASES} == {1.0}


def relative_error(grads, reference) -> float:
    num = sum((g - r).double().square().sum() for g, r in zip(grads, reference))
    return math.sqrt(num / sum(r.double().square().sum() for r in reference))


def test_ddp_hook_halves_bf16_bytes(results):
    ddp = results["ddp"]
    fp32, bf16, fp8 = (ddp[name][0] for name in ("fp32", "bf16", "fp8"))
    assert set(ddp["fp8"][1]) == {"all_reduce", "all_to_all_single", "all_gather_single"}
    assert fp8 <= 0.55 * bf16 and fp8 <= 0.28 * fp32
    assert relative_error(ddp["fp8"][2], ddp["fp32"][2]) < 0.05
    assert relative_error(ddp["bf16"][2], ddp["fp32"][2]) < 0.01


def test_fsdp_reduce_scatter_halves_bf16_bytes(results):
    fsdp = results["fsdp"]

    def gradient_bytes(counted):  # the parameter all-gathers are the same in every run: leave them out
        return sum(v for k, v in counted.items() if not k.startswith("all_gather"))

    fp32, bf16, fp8 = (gradient_bytes(fsdp[name][1]) for name in ("fp32", "bf16", "fp8"))
    assert "reduce_scatter_single" not in fsdp["fp8"][1] and fp8 > 0
    assert fp8 <= 0.55 * bf16 and fp8 <= 0.28 * fp32
    assert relative_error(fsdp["fp8"][2], fsdp["fp32"][2]) < 0.05


def test_lightning_strategies_switch_fp8_gradients_on(results):
    """FP8DDPStrategy(fp8_gradients=True) registers the hook on CPU too (Lightning's DDPStrategy registers hooks
    on CUDA only); FP8FSDPStrategy(fp8_reduce_scatter=True) gives every FSDP2 group the FP8 reduce-scatter. Both
    train to the losses of the same strategy without FP8 gradients, to FP8 precision."""
    r = results["lightning"]
    assert r["ddp_fp8_buckets"] >= 1
    assert r["fsdp_fp8_comms"] and set(r["fsdp_fp8_comms"]) == {"FP8ReduceScatter"}
    assert r["ddp_fp8"] == pytest.approx(r["ddp"], rel=1e-2) and r["ddp_fp8"] != r["ddp"]
    assert r["fsdp_fp8"] == pytest.approx(r["fsdp"], rel=1e-2) and r["fsdp_fp8"] != r["fsdp"]


def test_bad_settings_are_explained():
    with pytest.raises(ValueError, match="'e4m3' or 'e5m2'"):
        FP8CommState(fp8_format="hybrid")
    with pytest.raises(ValueError, match="block_size"):
        FP8ReduceScatter(block_size=0)
    with pytest.raises(ValueError, match="growth_interval"):
        FP8CommState(growth_interval=0)
