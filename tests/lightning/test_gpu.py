"""On an FP8-capable NVIDIA GPU: the Trainer runs the FP8 GEMMs on CUDA with bf16 autocast for the rest."""

import lightning as L
import pytest
import torch

from tests.conftest import requires_cuda_fp8

from .user_model import TinyTransformerLM, loader, trainer_kwargs


@pytest.mark.gpu
@requires_cuda_fp8
@pytest.mark.parametrize("precision", ["fp8-hybrid", "fp8-tensorwise"])
def test_trainer_fits_on_cuda_with_bf16_autocast(precision):
    L.seed_everything(0, verbose=False)
    model = TinyTransformerLM()
    seen = {}
    model.head.register_forward_hook(lambda m, args, out: seen.setdefault("dtype", out.dtype))
    trainer = L.Trainer(max_steps=5, **trainer_kwargs(accelerator="gpu", precision=precision))
    trainer.fit(model, loader())
    assert seen["dtype"] == torch.bfloat16  # dtype=None: bf16 autocast for the non-FP8 parts on CUDA
    assert model.head.weight.dtype == torch.float32 and model.head.weight.is_cuda
    assert model.head.fp8_weight_casts == 5
    assert model.losses[-1] < model.losses[0]
