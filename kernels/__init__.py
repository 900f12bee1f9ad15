"""Triton kernels and the C codec for the FP8 hot paths (``fp8_lightning.kernels``): they take and return tensors.

Modules: ``availability`` (can they run here, what they take; no Triton import), ``per_tensor`` (amax and per-tensor
casts), ``mxfp8`` (MX quantization), ``fine_grained_cast`` (rowwise and blockwise casts; their output layouts in
``fine_grained_layout``), ``grouped_cast`` (every group's columnwise rowwise copy for the grouped GEMMs),
``block_gemm`` (MX GEMM and its autotune configs; ``block_gemm_gluon``: its opt-in Hopper form in Gluon, whose wgmma
overlaps the scale math), ``aot`` (ahead-of-time compilation for GPUs this machine lacks) and ``cpu_codec`` (not
Triton: the CPU casts and MX (de)quantization fused in C, built with the machine's C compiler on first use; same
bits as the core's pure-torch code).

Each kernel is declared as an operation of the op registry (:mod:`fp8_lightning.ops`): the Triton launchers as the
ops of :mod:`fp8_lightning.ops.triton_ops` (``torch.ops.fp8_lightning.*``, with fake implementations so
``torch.compile`` traces through them), the backend choice in :mod:`fp8_lightning.ops.dispatch`. Importing this
package never imports Triton; the kernels are compiled on first use.
"""
