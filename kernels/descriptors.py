"""What a Triton/Gluon tensor descriptor (TMA) can read, shared by ``block_gemm`` and ``block_gemm_gluon``.

Plain torch (no Triton import), so that both kernels import it without importing each other.
"""

from __future__ import annotations

import torch

TMA_ALIGNMENT = 16  # bytes: a tensor descriptor's base address and row stride


def descriptor_ready(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a tensor descriptor can read it: K contiguous, row stride and base 16-byte aligned (else a copy)."""
    aligned = x.stride(1) == 1 and x.stride(0) % TMA_ALIGNMENT == 0 and x.data_ptr() % TMA_ALIGNMENT == 0
    return x if aligned else x.clone(memory_format=torch.contiguous_format)
