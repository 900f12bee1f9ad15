"""The GPU benchmark suites without a GPU: kernels-gpu refuses clearly and writes nothing; the linear suite's
Llama-3-8B shapes and its printed targets; the Llama-3-8B-shaped stack of the GPT suite."""

from __future__ import annotations

import torch

from fp8_lightning.testing import LLAMA3_8B, LlamaStack, linear_targets, versus_torchao
from tests.helpers.front_door import run_suite


def test_refuses_without_cuda_and_writes_no_numbers(tmp_path):
    out = tmp_path / "kernels_gpu.md"
    done = run_suite("kernels-gpu", "--out", str(out), env={"CUDA_VISIBLE_DEVICES": ""}, check=False)
    assert done.returncode == 2
    assert "refusing to run: CUDA is not available" in done.stdout
    assert not out.exists() and not out.with_suffix(".json").exists()


def _shapes(*args: str) -> list[tuple[str, int, int, int]]:
    """(label, M, K, N) of each shape ``python -m benchmarks linear <args> --dry-run`` would time."""
    lines = run_suite("linear", *args, "--dry-run").stdout.splitlines()
    return [(" ".join(f[:-3]), *map(int, f[-3:])) for f in (line.split() for line in lines if line.strip())]


def test_linear_suite_shapes_and_targets():
    llama = _shapes("--suite", "gpu", "--llama")
    # Llama-3-8B: hidden 4096, FFN 14336, 8 KV heads x 128 = 1024; 8192 tokens
    assert {(m, k, n) for _, m, k, n in llama} == {
        (8192, 4096, 4096), (8192, 4096, 1024), (8192, 4096, 14336), (8192, 14336, 4096)
    }  # fmt: skip
    assert [s[1:] for s in _shapes("--suite", "gpu")][-1] == (8192, 8192, 8192)
    rows = [
        {"size": "8192", "config": "fp8 tensorwise", "speedup_vs_bf16": 1.7},
        {"size": "llama3-8b w2", "config": "fp8 mxfp8", "speedup_vs_bf16": 0.9},
        {"size": "llama3-8b w2", "config": "torchao tensorwise", "speedup_vs_bf16": 0.8},
    ]
    text = linear_targets(rows)
    assert "1.70x, met." in text and "NOT met: fp8 mxfp8 at llama3-8b w2 (0.90x)" in text
    assert "torchao" not in text


def test_llama_stack_has_llama3_8b_layer_shapes_and_the_peer_target():
    import torch.nn as nn

    with torch.device("meta"):
        stack = LlamaStack(n_layer=1, **LLAMA3_8B)
    shapes = {name: tuple(m.weight.shape) for name, m in stack.layers[0].named_modules() if isinstance(m, nn.Linear)}
    assert shapes == {"wq": (4096, 4096), "wk": (1024, 4096), "wv": (1024, 4096), "wo": (4096, 4096),
                      "w1": (14336, 4096), "w3": (14336, 4096), "w2": (4096, 14336)}  # fmt: skip
    # 32 such layers and the untied 128256 x 4096 embedding and head: Llama-3-8B's published 8.03B parameters
    assert abs(32 * stack.num_parameters() + 2 * 128256 * 4096 + 4096 - 8.03e9) < 0.01e9
    rows = [{"model": "m", "precision": "torchao tensorwise", "step_ms": 10.0},
            {"model": "m", "precision": "fp8 tensorwise", "step_ms": 8.0}]  # fmt: skip
    assert versus_torchao(rows) == " m fp8 tensorwise: 1.25x torchao.float8 speed (target >= 1)."
