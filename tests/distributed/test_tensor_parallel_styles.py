"""The FP8 tensor-parallel styles on 2 gloo processes, every FP8 recipe, against one process with the whole layer.

An MLP (colwise ``w1``, rowwise ``w2``) trains 3 SGD steps; one spawn runs every case. What each test shows:

* TP=2 trains the losses of one process (the split GEMMs sum the same products; per-tensor recipes agree one
  scale per split operand), and an evaluation forward gives its output;
* sequence parallel with the input all-gathered in FP8 gives the bits of the same plan gathering in high precision
  (outputs and every gradient), so the FP8 wire format changes nothing, and within rounding of one process;
* the FP8 all-gather sends fewer bytes: per-tensor recipes the codes only (1 byte per element against 4 for the
  float32 activation here), block recipes both of their copies with scales; a shard that holds no whole scale
  block (32 tokens per rank, blockwise's 128-token tiles) is gathered in high precision, with a warning;
* all ranks end with identical scaling state;
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
def test_fp8_sequence_gather_sends_fewer_bytes(results, recipe):
    runs = results[0][recipe]
    # both runs also all-gather the rowwise layer's output gradient (float32) in backward: the same bytes
    backward = STEPS * TOKENS // 2 * HIDDEN * 4
    fp8, high = runs["sp_fp8_bytes"] - backward, runs["sp_hp_bytes"] - backward
    assert high == STEPS * TOKENS // 2 * HIDDEN * 4
    if recipe in ("delayed", "tensorwise"):
        assert fp8 == high // 4  # the codes only: the scale was agreed before the cast
    else:
        assert fp8 < high // 1.9  # two FP8 copies with their scales


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


def test_prepare_fp8_module_input_gathers_once_for_every_consumer(results):
    mixer = results[0]["mixer"]
    assert mixer["gathers"] == 1  # q, k and v share one cast and one all-gather
    assert mixer["gather_bytes"] == TOKENS // 2 * HIDDEN  # one byte per element of this rank's tokens
    assert mixer["out"] < 1e-5 and mixer["grad_q"] < 1e-4  # one process, to float32 summation order


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
