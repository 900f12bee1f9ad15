"""FP8Optimizer: exactness against torch.optim with float32 storage, quantized behaviour, refusals, checkpoints."""

import copy
import io

import pytest
import torch
import torch.nn as nn

from fp8_lightning.optim import FP8Optimizer, fp8_adamw, master_parameters, to_plain_state_dict


def tiny_model(seed: int = 0, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 16))
    return model.to(dtype)


def batches(n: int, seed: int = 1, dtype=torch.float32):
    """A learnable regression: targets from a fixed random linear teacher."""
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(64, 16, generator=gen) / 8
    inputs = [torch.randn(8, 64, generator=gen) for _ in range(n)]
    return [(x.to(dtype), (x @ teacher).to(dtype)) for x in inputs]


def train(model, optimizer, data) -> list[float]:
    losses = []
    for x, y in data:
        loss = nn.functional.mse_loss(model(x).float(), y.float())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=False),
        lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.01, foreach=False),
        lambda p: torch.optim.Adam(p, lr=1e-2, maximize=True, foreach=False),
        lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3, foreach=False),
        lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, dampening=0.1, foreach=False),
        lambda p: torch.optim.SGD(p, lr=1e-2, foreach=False),
    ],
    ids=["adamw", "adam_l2", "adam_maximize", "sgd_nesterov", "sgd_dampening", "sgd_plain"],
)
def test_fp32_storage_reproduces_torch_optim_bit_for_bit(make):
    reference, wrapped = tiny_model(), tiny_model()
    ref_opt = make(reference.parameters())
    fp8_opt = FP8Optimizer(make(wrapped.parameters()), "fp32")
    data = batches(6)
    assert train(reference, ref_opt, data) == train(wrapped, fp8_opt, data)
    for a, b in zip(reference.parameters(), wrapped.parameters()):
        assert torch.equal(a, b)


def test_default_preset_stores_fp8_states_and_tracks_fp32_adamw():
    reference, model = tiny_model(), tiny_model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)
    opt = fp8_adamw(model.parameters(), lr=1e-2, min_quantize_numel=1000)
    data = batches(30)
    ref_losses, losses = train(reference, ref_opt, data), train(model, opt, data)
    big, bias = model[0].weight, model[0].bias
    assert opt.state[big]["exp_avg"].dtype == torch.float8_e4m3fn
    assert opt.state[big]["exp_avg_sq"].dtype == torch.float8_e4m3fn  # sqrt(v), see state_formats.py
    assert opt.config.exp_avg_sq.transform == "sqrt"
    assert opt.state[big]["exp_avg_scale"].numel() == big.numel() // 128
    assert opt.state[bias]["exp_avg"].dtype == torch.float32  # 96 elements: too small to quantize
    assert losses[-1] < 0.7 * losses[0]
    assert abs(losses[-1] - ref_losses[-1]) < 0.05 * ref_losses[-1]
    # the quantized moments are close to the float32 ones (E4M3: ~6% per element; compare norms)
    ref_m, m = ref_opt.state[reference[0].weight]["exp_avg"], to_plain_state_dict(opt.state_dict())["state"][0]
    assert (m["exp_avg"] - ref_m).norm() < 0.35 * ref_m.norm()


def test_max_savings_preset_stores_sqrt_second_moment_in_fp8_and_trains():
    model = tiny_model()
    opt = fp8_adamw(model.parameters(), lr=1e-2, preset="max_savings", min_quantize_numel=1000)
    losses = train(model, opt, batches(30))
    assert opt.state[model[0].weight]["exp_avg_sq"].dtype == torch.float8_e4m3fn
    assert losses[-1] < 0.7 * losses[0]


def test_bf16_parameters_get_exact_master_weights_from_the_remainder():
    model = tiny_model(dtype=torch.bfloat16)
    reference = copy.deepcopy(model).float()  # the same initial values, held in float32
    opt = FP8Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False), "fp32",
                       master_weights="bf16_remainder")
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, foreach=False)
    for x, y in batches(5):
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            nn.functional.mse_loss(m(x.to(next(m.parameters()).dtype)).float(), y).backward()
        # feed both the same (bf16-model) gradients so only master precision differs
        for p, q in zip(model.parameters(), reference.parameters()):
            q.grad = p.grad.float()
        opt.step()
        ref_opt.step()
    masters = master_parameters(opt)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(masters[p], q)  # exactly the float32 AdamW trajectory
        assert torch.equal(p, q.to(torch.bfloat16)) or (p.float() - q).abs().max() <= q.abs().max() * 2**-8


def test_param_groups_are_shared_with_the_inner_optimizer_and_schedulers_work():
    model = tiny_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1.0)
    opt = FP8Optimizer(inner)
    assert opt.param_groups is inner.param_groups
    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, lambda step: 0.5**step)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
        train(model, opt, batches(1))
        scheduler.step()
    assert opt.param_groups[0]["lr"] == 0.5
    extra = nn.Parameter(torch.zeros(3))
    opt.add_param_group({"params": [extra]})
    assert len(inner.param_groups) == 2


def test_unsupported_optimizers_are_refused_with_the_supported_names():
    params = tiny_model().parameters()
    with pytest.raises(TypeError, match="Adam, AdamW, SGD"):
        FP8Optimizer(torch.optim.RMSprop(params))
    with pytest.raises(ValueError, match="amsgrad"):
        FP8Optimizer(torch.optim.AdamW(tiny_model().parameters(), amsgrad=True))
    with pytest.raises(ValueError, match="preset"):
        FP8Optimizer(torch.optim.AdamW(tiny_model().parameters()), "smallest")


def _roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("preset", ["default", "max_savings"])
def test_resume_from_state_dict_reproduces_uninterrupted_losses(preset):
    data = batches(12)
    model = tiny_model()
    opt = fp8_adamw(model.parameters(), lr=3e-3, preset=preset, min_quantize_numel=1000)
    uninterrupted = train(model, opt, data)

    first = tiny_model()
    opt1 = fp8_adamw(first.parameters(), lr=3e-3, preset=preset, min_quantize_numel=1000)
    head = train(first, opt1, data[:5])
    checkpoint = _roundtrip({"model": first.state_dict(), "optimizer": opt1.state_dict()})

    resumed = tiny_model(seed=99)  # different initial values: everything must come from the checkpoint
    opt2 = fp8_adamw(resumed.parameters(), lr=3e-3, preset=preset, min_quantize_numel=1000)
    resumed.load_state_dict(checkpoint["model"])
    opt2.load_state_dict(checkpoint["optimizer"])
    tail = train(resumed, opt2, data[5:])
    assert head + tail == uninterrupted
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("master", ["bf16_int8_remainder", "bf16_stochastic"])
def test_resume_with_bf16_weights_reproduces_uninterrupted_losses(master):
    """bf16 weights: the int8 remainder and the step-derived rounding noise come back from the checkpoint."""
    data = batches(10, dtype=torch.bfloat16)

    def make(model):
        return fp8_adamw(model.parameters(), lr=3e-3, master_weights=master, min_quantize_numel=1000)

    model = tiny_model(dtype=torch.bfloat16)
    uninterrupted = train(model, make(model), data)

    first = tiny_model(dtype=torch.bfloat16)
    opt1 = make(first)
    head = train(first, opt1, data[:4])
    checkpoint = _roundtrip({"model": first.state_dict(), "optimizer": opt1.state_dict()})
    resumed = tiny_model(seed=99, dtype=torch.bfloat16)
    opt2 = make(resumed)
    resumed.load_state_dict(checkpoint["model"])
    opt2.load_state_dict(checkpoint["optimizer"])
    assert head + train(resumed, opt2, data[4:]) == uninterrupted
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_loading_with_another_config_is_refused():
    model = tiny_model()
    opt = fp8_adamw(model.parameters(), preset="default")
    train(model, opt, batches(1))
    other = fp8_adamw(model.parameters(), preset="max_savings")
    with pytest.raises(ValueError, match="same preset"):
        other.load_state_dict(opt.state_dict())


def test_conversion_to_plain_adamw_and_back():
    data = batches(8)
    model = tiny_model()
    opt = fp8_adamw(model.parameters(), lr=3e-3, min_quantize_numel=1000)
    train(model, opt, data[:4])
    plain = to_plain_state_dict(_roundtrip(opt.state_dict()))
    assert plain["state"][0]["exp_avg"].shape == model[0].weight.shape
    assert "fp8_optimizer" not in plain and "exp_avg_scale" not in plain["state"][0]

    # a user leaving FP8 continues with torch AdamW
    leaving = copy.deepcopy(model)
    adamw = torch.optim.AdamW(leaving.parameters(), lr=3e-3)
    adamw.load_state_dict(copy.deepcopy(plain))  # torch keeps (and then updates) the loaded tensors
    assert adamw.state[leaving[0].weight]["exp_avg"].dtype == torch.float32
    continued = train(leaving, adamw, data[4:])

    # and a plain AdamW state dict loads into an FP8 optimizer (quantized on load), re-encoding the same values
    back = copy.deepcopy(model)
    opt_back = fp8_adamw(back.parameters(), lr=3e-3, min_quantize_numel=1000)
    opt_back.load_state_dict(plain)
    again = to_plain_state_dict(opt_back.state_dict())
    for index, entry in plain["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(again["state"][index][name], entry[name], rtol=1e-5, atol=0)
    fp8_continued = train(back, opt_back, data[4:])
    assert abs(fp8_continued[-1] - continued[-1]) < 0.05 * continued[-1]


def test_wrapping_a_stepped_optimizer_imports_its_states():
    model = tiny_model()
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train(model, inner, batches(2))
    exp_avg = inner.state[model[0].weight]["exp_avg"].clone()
    opt = FP8Optimizer(inner, min_quantize_numel=1000)
    assert not inner.state  # released: the float32 copies do not stay around
    decoded = to_plain_state_dict(opt.state_dict())["state"][0]["exp_avg"]
    assert opt.state[model[0].weight]["step"].item() == 2
    torch.testing.assert_close(decoded, exp_avg, rtol=2.0**-4, atol=exp_avg.abs().max().item() * 2.0**-9)


@pytest.mark.parametrize("preset", ["default", "max_savings"])
def test_release_gradients_in_backward_gives_the_same_training_without_holding_gradients(preset):
    data = batches(5)
    regular, released = tiny_model(), tiny_model()
    opt = fp8_adamw(regular.parameters(), lr=1e-2, preset=preset, min_quantize_numel=1000)
    opt_released = fp8_adamw(released.parameters(), lr=1e-2, preset=preset, min_quantize_numel=1000)
    opt_released.release_gradients_in_backward()
    live_grads = []
    for x, y in data:
        nn.functional.mse_loss(released(x), y).backward()
        live_grads.append(sum(p.grad is not None for p in released.parameters()))
        opt_released.step()  # nothing left to do: every parameter stepped during backward
    train(regular, opt, data)
    assert live_grads == [0] * len(data)
    for a, b in zip(regular.parameters(), released.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind, key, dtype", [("fp32", "master", torch.float32),
                                              ("fp16_scaled", "master_fp16", torch.float16),
                                              ("bf16_remainder", "master_remainder", torch.int16),
                                              ("bf16_int8_remainder", "master_remainder", torch.int8)])
def test_master_weight_kinds_for_bf16_parameters(kind, key, dtype):
    """Each master kind holds its copy in its dtype and follows the float32 AdamW trajectory to its precision."""
    model = tiny_model(dtype=torch.bfloat16)
    reference = copy.deepcopy(model).float()
    opt = FP8Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False), "fp32", master_weights=kind)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, foreach=False)
    for x, y in batches(4):
        opt.zero_grad()
        ref_opt.zero_grad()
        nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            q.grad = p.grad.float()
        opt.step()
        ref_opt.step()
    weight = model[0].weight
    assert opt.state[weight][key].dtype == dtype and opt.state[weight][key].shape == weight.shape
    masters = master_parameters(opt)
    # fp16_scaled rounds each step to half an FP16 ulp of a tensor whose amax is scaled into [2**13, 2**14]:
    # at most 2**-10 of the amax per step, 4 steps
    # bf16_int8_remainder rounds each step to half a 16-significant-bit ulp: at most 2**-16 of |x|, 4 steps
    tolerance = {"fp32": 0.0, "bf16_remainder": 0.0, "fp16_scaled": 4 * 2.0**-10,
                 "bf16_int8_remainder": 4 * 2.0**-16}[kind]
    for p, q in zip(model.parameters(), reference.parameters()):
        assert ((masters[p] - q).abs() <= tolerance * q.abs().max()).all()
