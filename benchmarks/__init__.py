"""The project's benchmarks and GPU checks, one front door: ``python -m benchmarks <suite> [args]``.

``SUITES`` maps each suite name to the module that runs it, the arguments the suite adds before the caller's, and
the question it answers. This module imports nothing heavy: a suite may set environment variables before torch or
triton is imported (``launch-count`` does).
"""

from __future__ import annotations

from typing import NamedTuple


class Suite(NamedTuple):
    module: str  # under benchmarks/
    question: str  # what the suite answers, in one line
    args: tuple[str, ...] = ()  # passed before the caller's arguments


SUITES: dict[str, Suite] = {
    "linear": Suite("bench_linear", "How fast is one linear layer's forward+backward in each FP8 recipe vs fp32, bf16 "
                    "and torchao.float8?"),
    "gpt": Suite("bench_gpt", "What tokens/s, step-time ratio and peak memory does a GPT training step get in each "
                 "precision?"),
    "llama-stack": Suite("bench_gpt", "How fast is a training step of four Llama-3-8B-shaped decoder layers (GPU) in "
                         "each precision?", ("--suite", "gpu", "--models", "llama3_8b_x4")),
    "grouped": Suite("bench_grouped", "How fast is an MoE projection's grouped GEMM step in each FP8 recipe vs bf16 "
                     "grouped and a per-expert loop, at DeepSeek-V3 and Qwen3-30B-A3B shapes with skewed routing?"),
    "memory": Suite("bench_memory", "How many bytes do saved activations, optimizer states and FSDP2 all-gathers "
                    "take in each precision?"),
    "host-time": Suite("host_time", "How many host microseconds does one FP8 layer step cost, eager and compiled, "
                       "next to nn.Linear?"),
    "launch-count": Suite("launch_count", "How many tensor operations (kernel launches) does one FP8 layer step "
                          "issue on the CUDA branch?"),
    "traced-launches": Suite("traced_launches", "How many tensor operations does one compiled (traced) rowwise, "
                             "blockwise or MXFP8 layer step run on CUDA (simulated device, no GPU)?"),
    "traced-gpu-check": Suite("traced_gpu_check", "Does the compiled rowwise, blockwise and MXFP8 layer step give the "
                              "eager step's bits on a GPU, and how many CUDA kernels does it run?"),
    "optim-memory": Suite("optimizer_memory", "How much memory do FP8 optimizer states and master weights save?"),
    "optim-convergence": Suite("optimizer_convergence", "Does training with FP8 optimizer states converge like "
                               "float32 AdamW?"),
    "optim-state-error": Suite("optimizer_state_error", "How large is the error of each FP8 optimizer-state "
                               "format on real Adam moments?"),
    "grad-comm": Suite("grad_comm_convergence", "Does training with FP8 gradient communication (DDP, FSDP2) "
                       "converge like float32?"),
    "grad-bytes": Suite("grad_bytes", "How many bytes does gradient communication put on the wire: float32, bf16, "
                        "FP8?"),
    "tp-bytes": Suite("tp_bytes", "How many bytes do the sequence-parallel all-gathers move per step with FP8 "
                      "tensor-parallel styles vs the same plan in bf16?"),
    "allgather-bytes": Suite("allgather_bytes", "How many bytes do FSDP2 weight all-gathers move with FP8 vs "
                             "fp32 and bf16?"),
    "aot": Suite("aot_compile", "Does every Triton kernel configuration compile for sm_89/sm_90a/sm_100a, with how "
                 "many registers and spills?"),
    "mx-gemm-overlap": Suite("mx_gemm_overlap", "Which forms of the Hopper MX GEMM loop keep a wgmma in flight "
                             "(registers, waits)?"),
    "kernels-gpu": Suite("kernels_gpu", "Are the Triton kernels bit-identical to their twins on a GPU, and what "
                         "bandwidth and TFLOP/s do they reach?"),
    "gpu-check": Suite("gpu_check", "Do the CUDA paths of the FP8 core match the CPU reference (casts bit for bit, "
                       "GEMMs)?"),
    "grouped-gpu-check": Suite("grouped_gpu_check", "Does the native grouped FP8 GEMM (rowwise, "
                               "torch._scaled_grouped_mm) match the CPU emulation on a GPU, with one launch per GEMM?"),
    "mx-grouped-gpu": Suite("mx_grouped_gpu_check", "Do the MXFP8 grouped GEMMs on sm_100 (torch._scaled_grouped_mm) "
                            "match the emulation, and how fast are they vs bf16 torch._grouped_mm?"),
    "mx-grouped-launches": Suite("mx_grouped_launches", "How many tensor operations does one MXFP8 fp8_grouped_mm "
                                 "forward+backward run at 4, 16 and 64 experts (casts, emulated, native route)?"),
    "grouped-triton": Suite("grouped_triton_gpu", "Does the Triton grouped FP8 GEMM match float64 math on a GPU, and "
                            "how fast is it, alone and in a whole fwd+bwd step, vs bf16 and torch's FP8 grouped GEMM?"),
    "nvfp4-gpu": Suite("nvfp4_gpu_check", "Does the Triton NVFP4 cast write the reference's bytes on a GPU, and how fast "
                       "is it against the reference and a bf16 copy?"),
    "nvfp4-gemm-gpu": Suite("nvfp4_gemm_gpu_check", "Do the NVFP4 layer's native cuBLAS FP4 GEMMs (sm_100+) match "
                            "the emulation and float64 math, and how fast are they against the emulation and bf16?"),
    "fsdp-gpu-check": Suite("fsdp_gpu_check", "Does FP8 all-gather under FSDP2 on NCCL run its hooks, move the "
                            "expected bytes and match unsharded?"),
    "fsdp-experts-gpu-check": Suite("fsdp_experts_gpu_check", "Do fused expert weights all-gather in FP8 under "
                                    "FSDP2 on NCCL and train like a high-precision gather?"),
    "tried-with": Suite("tried_with", "Do Hugging Face model families train through Trainer(precision='fp8-...') "
                        "like float32?"),
    "tried-with-strategies": Suite("tried_with_strategies", "Do Hugging Face models train under ddp, fp8_ddp and "
                                   "fp8_fsdp on 2 processes like one process?"),
}


def suite_of(module: str) -> str:
    """The front-door name that runs ``module`` (``benchmarks.<name>`` or ``<name>``) with no preset arguments."""
    name = module.rpartition(".")[2]
    return next(suite for suite, entry in SUITES.items() if entry.module == name and not entry.args)


def command(module: str, argv: list[str] | None) -> str:
    """The command line that reproduces this run: ``python -m benchmarks <suite> <args>`` (``argv`` None: the
    process's own arguments)."""
    import sys

    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join(["python -m benchmarks", suite_of(module), *args])
