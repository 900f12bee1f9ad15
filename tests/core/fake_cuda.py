"""Fake CUDA tensors on a machine without a GPU: torch's meta implementations check a GEMM's layouts on them."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fp8_lightning.quantize import Quantized


@contextlib.contextmanager
def fake_cuda() -> Iterator[None]:
    """Tensors made inside live on a fake ``cuda`` device (shapes, strides and dtypes only, no memory)."""
    with FakeTensorMode():
        yield


def fake_operand(
    shape: tuple[int, int], scale_shape: tuple[int, ...], kind: str, dtype=torch.float8_e4m3fn
) -> Quantized:
    """A contiguous FP8 operand with float32 scales on the fake CUDA device (inside :func:`fake_cuda`)."""
    data = torch.empty(shape, dtype=dtype, device="cuda")
    return Quantized(data, torch.empty(scale_shape, dtype=torch.float32, device="cuda"), kind)
