"""On an FP8-capable NVIDIA GPU: the Trainer runs the FP8 GEMMs on CUDA with bf16 autocast for the rest."""

import lightning as L
import pytest
import torch

from fp8_lightning.lightning.precision import FP8Precision
from fp8_lightning.lightning.strings import recipe_for_precision
from tests.conftest import requires_cuda_fp8

from .user_model import TinyTransformerLM, loader, trainer_kwargs


@pytest.mark.gpu
@requires_cuda_fp8
@pytest.mark.parametrize("precision", ["fp8-hybrid", "fp8-tensorwise"])
def test_trainer_fits_on_cuda_with_bf16_autocast(precision):
    L.seed_everything(0, verbose=False)
    model = TinyTransformerLM()
    seen = {}

    def record_dtype(module, args, out):  # returns None: a forward hook's return value would replace the output
        seen.setdefault("dtype", out.dtype)
        seen.setdefault("device", module.weight.device.type)

    model.head.register_forward_hook(record_dtype)
    # The layers of this tiny model are far too small to gain from FP8, so the default gate would keep them all in
    # bf16 on a GPU; profitability=False converts them so the FP8 GEMMs run on CUDA.
    plugin = FP8Precision(recipe_for_precision(precision), profitability=False)
    trainer = L.Trainer(max_steps=5, **trainer_kwargs(accelerator="gpu", plugins=[plugin]))
    trainer.fit(model, loader())
    assert seen["dtype"] == torch.bfloat16  # dtype=None: bf16 autocast for the non-FP8 parts on CUDA
    assert model.head.weight.dtype == torch.float32 and seen["device"] == "cuda"  # Lightning moves it back after fit
    assert model.head.fp8_weight_casts == 5
    assert model.losses[-1] < model.losses[0]
