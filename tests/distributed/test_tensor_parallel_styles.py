"""The FP8 tensor-parallel styles on 2 gloo processes, every FP8 recipe, against one process with the whole layer.

An MLP (colwise ``w1``, rowwise ``w2``) trains 3 SGD steps; one spawn runs every case. What each test shows:

* TP=2 trains the losses of one process (the split GEMMs sum the same products; per-tensor recipes agree one
  scale per split operand), and an evaluation forward gives its output;
* sequence parallel with the input all-gathered in FP8 gives the bits of the same plan gathering in high precision
  (outputs and every gradient), so the FP8 wire format changes nothing, and within rounding of one process;
* the FP8 all-gather sends fewer bytes: per-tensor recipes the codes only (1 byte per element against 4 for the
  float32 activation here), block recipes both of their copies with scales, or with ``fp8_all_gather="fprop"`` the
  forward copy alone (same output, the weight gradient within FP8 rounding); a shard that holds no whole scale
  block (32 tokens per rank, blockwise's 128-token tiles) is gathered in high precision, with a warning;
* all ranks end with identical scaling state;
* NVFP4 splits too: each split operand's global scale comes from the amax agreed across the group, so rounding to
  nearest the split layers compute the one-process casts (same losses, outputs and gradients to float32 summation
  order); with stochastic rounding (keyed by the rank) the losses stay within 1%;
* ``PrepareFP8ModuleInput`` gathers once for three consumers;
* set-up refuses a shard that splits a scale block, a recipe that cannot be split, and a module of another type.
"""

import pytest
import torch
import torch.multiprocessing as mp

from fp8_lightning.testing import free_port
from tests.distributed._tp_style_workers import RECIPES, STEPS, tp_worker

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore")]
TOKENS, HIDDEN = 2 * 256, 256  # the whole activation's rows and features (float32)


@pytest.fixture(scope="module")
def results():
    out = mp.Manager().dict()
    mp.spawn(tp_worker, args=(2, free_port(), out), nprocs=2)
    return dict(out)


@pytest.mark.parametrize("recipe", RECIPES)
def test_tensor_parallel_trains_like_one_process(results, recipe):
    runs = results[0][recipe]
    assert len(runs["tp"][0]) == STEPS
    assert runs["tp"][0] == pytest.approx(runs["single"][0], rel=1e-5)
    assert runs["eval"] < 1e-5


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_sequence_gather_equals_high_precision_gather(results, recipe):
    runs = results[0][recipe]
    (out_fp8, grads_fp8), (out_hp, grads_hp) = runs["sp_fp8"][1], runs["sp_hp"][1]
    assert torch.equal(out_fp8, out_hp)
    for name in grads_hp:
        assert torch.equal(grads_fp8[name], grads_hp[name]), name
    assert runs["sp_fp8"][0] == pytest.approx(runs["single"][0], rel=1e-5)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_fprop_only_gather_keeps_the_output_and_rounds_the_weight_gradient_once_more(results, recipe):
    """``fp8_all_gather="fprop"`` sends the forward copy alone: the output and the input gradient are the bits of
    the full FP8 gather; the weight gradient of the gathering layer, from the re-quantized copy, stays within FP8
    rounding of it (per-tensor recipes: the same bits, their wgrad copy is the transpose of the gathered codes)."""
    runs = results[0][recipe]
    (out, grads), (out_full, grads_full) = runs["sp_fprop"][1], runs["sp_fp8"][1]
    assert torch.equal(out, out_full)
    for name in grads_full:
        if recipe in ("delayed", "tensorwise") or name != "w1.weight":
            assert torch.equal(grads[name], grads_full[name]), name
    error = (grads["w1.weight"] - grads_full["w1.weight"]).norm() / grads_full["w1.weight"].norm()
    assert error < 2**-4, error
    assert runs["sp_fprop"][0] == pytest.approx(runs["single"][0], rel=1e-3)


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_sequence_gather_sends_fewer_bytes(results, recipe):
    runs = results[0][recipe]
    # both runs also all-gather the rowwise layer's output gradient (float32) in backward: the same bytes
    backward = STEPS * TOKENS // 2 * HIDDEN * 4
    fp8, high = runs["sp_fp8_bytes"] - backward, runs["sp_hp_bytes"] - backward
    assert high == STEPS * TOKENS // 2 * HIDDEN * 4
    fprop = runs["sp_fprop_bytes"] - backward
    if recipe in ("delayed", "tensorwise"):
        assert fp8 == fprop == high // 4  # the codes only: the scale was agreed before the cast
    else:
        assert fp8 < high // 1.9  # two FP8 copies with their scales
        assert fprop < high // 3.8  # the forward copy and its scales


def test_a_shard_without_whole_blocks_is_gathered_in_high_precision_with_a_warning(results):
    short = results[0]["short"]
    tokens = 2 * 64 // 2
    assert short["bytes"] == 2 * tokens * HIDDEN * 4  # the input forward and the output gradient backward, float32
    assert any("run of 32 tokens is not a whole number of BlockwiseScaling's 128-token blocks" in w
               for w in short["warnings"])


@pytest.mark.parametrize("recipe", RECIPES)
def test_ranks_end_with_identical_scales(results, recipe):
    for run in ("tp_scales", "sp_fp8_scales"):
        a, b = results[0][recipe][run], results[1][recipe][run]
        assert _flat(a).keys() == _flat(b).keys()
        for key, value in _flat(a).items():
            assert torch.equal(value, _flat(b)[key]), (run, key)


def test_nvfp4_splits_with_agreed_global_scales(results):
    rtn = results[0]["nvfp4"]["rtn"]
    losses, (out, grads) = rtn["tp"]
    single_losses, (single_out, single_grads) = rtn["single"]
    assert losses == pytest.approx(single_losses, rel=1e-5)
    torch.testing.assert_close(out, single_out, rtol=0, atol=1e-5 * single_out.abs().max().item())
    for name, grad in single_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-4 * grad.abs().max().item(), msg=name)
    sr = results[0]["nvfp4"]["sr"]
    assert sr["tp"][0] == pytest.approx(sr["single"][0], rel=1e-2)
    for label in ("rtn", "sr"):  # the signs and the stochastic-rounding counters agree
        a, b = _flat(results[0]["nvfp4"][label]["scales"]), _flat(results[1]["nvfp4"][label]["scales"])
        assert a.keys() == b.keys() and all(torch.equal(v, b[k]) for k, v in a.items())


def test_prepare_fp8_module_input_gathers_once_for_every_consumer(results):
    mixer = results[0]["mixer"]
    assert mixer["gathers"] == 1  # q, k and v share one cast and one all-gather
    assert mixer["gather_bytes"] == TOKENS // 2 * HIDDEN  # one byte per element of this rank's tokens
    # one process, to float32 summation order (which follows the thread count: 1.5e-5 with one thread)
    assert mixer["out"] < 1e-4 and mixer["grad_q"] < 1e-4


def test_set_up_refuses_what_cannot_be_split(results):
    errors = results[0]["errors"]
    assert "out_features=96 split over 2 ranks gives shards of 48" in errors["mxfp8_split_block"]
    assert "blocks of 32" in errors["mxfp8_split_block"] and "Layer '0'" in errors["mxfp8_split_block"]
    assert "NVFP4" in errors["nvfp4"]
    assert "got Conv1d" in errors["conv"]


def _flat(state, prefix=""):
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in _flat(value, f"{prefix}{key}/").items()}
    return {prefix: state} if torch.is_tensor(state) else {prefix: torch.tensor(float(hash(str(state))))}


@pytest.mark.parametrize("value", ["false", "True", 1, None, "fprop "])
def test_fp8_all_gather_takes_true_fprop_or_false_and_names_them(value):
    from fp8_lightning.distributed import FP8ColwiseParallel, PrepareFP8ModuleInput

    for build in (lambda: FP8ColwiseParallel(fp8_all_gather=value),
                  lambda: PrepareFP8ModuleInput(consumers=("q",), fp8_all_gather=value)):
        with pytest.raises(ValueError, match=r"fp8_all_gather=.*use True .*'fprop' .*or False"):
            build()
