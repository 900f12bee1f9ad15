"""The FP8 weight cache never serves a stale weight: evaluation and inference cast afresh, so an edit through
``weight.data`` (which keeps the version counter and the data pointer) is seen, and models built or run under
``torch.inference_mode`` work and leave training unharmed. Each result is compared with a layer that held the new
weight from the start."""

from __future__ import annotations

import copy

import pytest
import torch

from fp8_lightning import FP8Linear, fp8_autocast
from tests.helpers.layers import EVERY_RECIPE, fp8_layer


def _eval(layer: FP8Linear, x: torch.Tensor) -> torch.Tensor:
    layer.eval()
    with fp8_autocast(), torch.no_grad():
        return layer(x)


@pytest.mark.parametrize("edit", ["copy_", "mul_"])
@pytest.mark.parametrize("recipe", EVERY_RECIPE, ids=lambda r: r.name)
def test_an_evaluation_after_a_data_edit_sees_the_new_weight(recipe, edit):
    layer, x = fp8_layer(recipe), torch.randn(8, 64)
    before = _eval(layer, x)
    new = torch.randn(32, 64) if edit == "copy_" else layer.weight.detach() * 3
    version = layer.weight._version
    getattr(layer.weight.data, edit)(new if edit == "copy_" else 3.0)
    assert layer.weight._version == version  # the edit is invisible to the version counter
    fresh = fp8_layer(recipe)
    with torch.no_grad():
        fresh.weight.copy_(new)
    after = _eval(layer, x)
    assert not torch.equal(after, before)
    assert torch.equal(after, _eval(fresh, x))


@pytest.mark.parametrize("recipe", EVERY_RECIPE, ids=lambda r: r.name)
def test_a_model_built_under_inference_mode_runs_in_fp8(recipe):
    with torch.inference_mode():
        layer = fp8_layer(recipe)
        x = torch.randn(8, 64)
        with fp8_autocast():
            y = layer(x)  # a training-mode forward under inference mode: evaluation
    reference = fp8_layer(recipe)
    assert torch.equal(y, _eval(reference, x.clone()))


@pytest.mark.parametrize("recipe", EVERY_RECIPE, ids=lambda r: r.name)
def test_an_inference_mode_forward_leaves_training_unharmed(recipe):
    layer, x = fp8_layer(recipe), torch.randn(8, 64)
    twin = copy.deepcopy(layer)
    with torch.inference_mode(), fp8_autocast():
        layer(x)  # train mode, but no cast may be kept for the training step that follows
    for module in (layer, twin):
        with fp8_autocast():
            module(x).square().sum().backward()
    assert torch.equal(layer.weight.grad, twin.weight.grad)


def test_lightning_validation_after_an_ema_swap_reports_the_swapped_weights():
    """Validate, swap other weights in through ``p.data.copy_`` (what EMA callbacks do), validate again: the second
    loss is the swapped model's, as in fp32."""
    L = pytest.importorskip("lightning")
    from fp8_lightning import FP8Precision
    from tests.lightning.user_model import TinyTransformerLM, loader, trainer_kwargs

    def validate(model) -> float:
        trainer = L.Trainer(plugins=[FP8Precision()], **trainer_kwargs(limit_val_batches=2))
        return trainer.validate(model, loader(64), verbose=False)[0]["val_loss"]

    L.seed_everything(0, verbose=False)
    model = TinyTransformerLM()
    L.seed_everything(1, verbose=False)
    other = TinyTransformerLM()
    first = validate(model)
    with torch.no_grad():
        for p, q in zip(model.parameters(), other.parameters()):
            p.data.copy_(q)
    swapped = validate(model)
    assert swapped != first
    assert swapped == validate(other)


@pytest.mark.parametrize("recipe", [r for r in EVERY_RECIPE if r.per_tensor], ids=lambda r: r.name)
def test_an_fsdp_weight_pack_under_inference_mode_keeps_the_scaling_state(recipe):
    """FSDP2 packs a per-tensor weight for the all-gather with the layer's scale; under inference mode a
    training-mode layer is evaluated, so the pack must not move the state (nor keep an inference tensor in it)."""
    layer = fp8_layer(recipe)
    twin = copy.deepcopy(layer)
    layer.train()
    weight = layer.weight.detach()
    with torch.inference_mode():
        data, (scale, _) = recipe.fsdp_pack(weight, layer, lambda: weight.abs().amax())
    state, untouched = layer.fp8_scaling(recipe).operands["weight"], twin.fp8_scaling(recipe).operands["weight"]
    assert state.initialized == untouched.initialized
    assert torch.equal(state.scale, untouched.scale) and not state.scale.is_inference()
    assert torch.equal(scale, untouched.evaluation_scale(weight.abs().amax()))


@pytest.mark.parametrize("edit", ["copy_", "mul_"])
@pytest.mark.parametrize("recipe", EVERY_RECIPE, ids=lambda r: r.name)
def test_a_data_edit_between_micro_batches_is_cast_again(recipe, edit):
    """Inside one accumulation window (no optimizer step, so the cached cast would be reused), an edit through
    ``weight.data`` reaches the next micro-batch: its output and gradients equal those of a twin with the same
    scaling state but no cached cast (a deep copy keeps none), holding the edited weight."""
    layer, x = fp8_layer(recipe), torch.randn(8, 64)
    for _ in range(2):  # micro-batches 1 and 2: the layer reuses its cast from now on, checking it
        with fp8_autocast():
            layer(x).square().sum().backward()
    casts = layer.fp8_weight_casts
    twin = copy.deepcopy(layer)
    new = torch.randn(32, 64) if edit == "copy_" else layer.weight.detach() * 0.5
    version = layer.weight._version
    getattr(layer.weight.data, edit)(new if edit == "copy_" else 0.5)
    assert layer.weight._version == version  # the edit is invisible to the version counter
    twin.weight.data.copy_(new)
    layer.weight.grad = layer.bias.grad = None  # compare micro-batch 2's gradients alone (a copy keeps none)
    outputs = []
    for module in (layer, twin):
        with fp8_autocast():
            y = module(x)
            y.square().sum().backward()  # micro-batch 3 of the same window
        outputs.append(y)
    assert torch.equal(outputs[0], outputs[1])
    assert torch.equal(layer.weight.grad, twin.weight.grad)
    assert layer.fp8_weight_casts == casts + 1


@pytest.mark.parametrize("recipe", EVERY_RECIPE, ids=lambda r: r.name)
def test_micro_batches_without_an_edit_reuse_the_cast(recipe):
    """The first reuse of a layer's cast casts again (no checksum was taken: a layer that never reuses a cast pays
    for none); from then on each optimizer step casts once."""
    layer, x = fp8_layer(recipe), torch.randn(8, 64)
    casts = []
    for step in range(3):
        for _ in range(4):
            with fp8_autocast():
                layer(x).square().sum().backward()
        casts.append(layer.fp8_weight_casts)
        with torch.no_grad():
            layer.weight.sub_(1e-3 * layer.weight.grad)  # the optimizer step: a new version
        layer.weight.grad = None
    assert casts == [2, 3, 4]


@pytest.mark.parametrize("recipe", EVERY_RECIPE, ids=lambda r: r.name)
def test_expert_weights_are_cast_again_after_a_data_edit(recipe):
    """The grouped GEMM's weight cache (MoE experts) follows the same rule: after an edit through ``.data`` the
    training cast equals that of a state with no cached cast."""
    from fp8_lightning.grouped.gemm import GroupedScaling

    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(3, 32, 64))
    scaling = GroupedScaling(recipe, 3)
    for _ in range(2):  # the second call reuses the cast, so checksums are taken from then on
        scaling.weight_operands(weight, True)
    twin = copy.deepcopy(scaling)  # no cached cast
    weight.data.mul_(0.5)
    got, want = scaling.weight_operands(weight, True), twin.weight_operands(weight, True)
    for (row, col), (row_want, col_want) in zip(got, want):
        for q, q_want in ((row, row_want), (col, col_want)):
            assert torch.equal(q.data.view(torch.uint8), q_want.data.view(torch.uint8))
            assert torch.equal(q.scale, q_want.scale)
    assert scaling.weight_casts == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_weight_checksum_sees_one_ulp_in_one_element_and_a_power_of_two_scaling(dtype):
    """Edits the integer sum of the bits alone would miss (every element doubled: 4096 times 2**23 wraps to 0 in
    32 bits) and edits the float sum alone would miss (one element moved by one ulp) both change the checksum."""
    from fp8_lightning.layer_scaling import LayerScaling

    torch.manual_seed(0)
    weight = torch.randn(64, 64).to(dtype)
    edits = {
        "one ulp": lambda w: w.view(-1)[17].copy_(torch.nextafter(w.view(-1)[17], torch.tensor(9.0, dtype=dtype))),
        "times two": lambda w: w.mul_(2),
        "times minus one": lambda w: w.mul_(-1),
        "copy": lambda w: w.copy_(torch.randn(64, 64)),
    }
    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(LayerScaling.bits_checksum(a), LayerScaling.bits_checksum(b)))

    for name, edit in edits.items():
        edited = weight.clone()
        edit(edited)
        assert not torch.equal(edited, weight), name
        assert not same(edited, weight), name
    assert same(weight.clone(), weight)


def test_without_the_checksum_the_version_counter_alone_keys_the_cache():
    """``FP8_LIGHTNING_WEIGHT_CHECKSUM=0`` (read into each layer's ``check_weight_bits``): a reuse reads nothing of
    the weight, so an edit through ``.data`` goes unseen, as documented."""
    layer, x = fp8_layer(EVERY_RECIPE[1]), torch.randn(8, 64)
    layer.fp8_scaling().check_weight_bits = False
    with fp8_autocast():
        before = layer(x)
        assert torch.equal(layer(x), before)
        layer.weight.data.mul_(0.5)
        assert torch.equal(layer(x), before)
    assert layer.fp8_weight_casts == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the device-sync check of the reuse path")
@pytest.mark.parametrize("recipe", EVERY_RECIPE, ids=lambda r: r.name)
def test_on_a_gpu_a_reuse_casts_again_without_a_device_sync(recipe):
    """On CUDA the accumulation window's reuse makes no host-device sync (torch's sync debug mode raises on one):
    each micro-batch casts again, so an edit through ``weight.data`` reaches the next micro-batch."""
    layer, x = fp8_layer(recipe).cuda(), torch.randn(8, 64, device="cuda")
    with fp8_autocast():
        layer(x).square().sum().backward()  # warm-up: kernels compiled, states on the device
    casts = layer.fp8_weight_casts
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            with fp8_autocast():
                layer(x).square().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert layer.fp8_weight_casts == casts + 3
    layer.weight.data.mul_(0.5)
    with fp8_autocast():
        edited = layer(x)
    twin = copy.deepcopy(layer)
    with fp8_autocast():
        assert torch.equal(edited, twin(x))
